"""A built-in demo: a small GPT-style language model in plain PyTorch, trained a few steps under `record`.

The model follows GPT-2's layout and module names, so recorded nodes read like a real model's:

    transformer.wte, transformer.wpe            token and position embeddings
    transformer.h.{i}.ln_1                      pre-LayerNorm of block i
    transformer.h.{i}.attn.c_attn / .c_proj     causal multi-head self-attention (qkv and output Linear)
    transformer.h.{i}.ln_2                      pre-LayerNorm of the MLP
    transformer.h.{i}.mlp.c_fc / .c_proj        MLP: Linear -> GELU -> Linear
    transformer.ln_f, lm_head                   final LayerNorm, LM head (weight tied to transformer.wte)

Training data are synthetic: uniform random token ids from a seeded `torch.Generator`, next-token targets.
Nothing is downloaded. With the defaults the whole demo takes a few seconds on a laptop CPU.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .recording.recorder import record
from .store.database import DEFAULT_DB


@dataclass(frozen=True)
class GPTConfig:
    """Model size: vocab_size (tokens), block_size (longest sequence), n_layer, n_head, n_embd (width)."""

    vocab_size: int = 256
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t attends to positions <= t.

    c_attn projects to queries, keys and values in one Linear; scores are softmax(q k^T / sqrt(head_dim))
    with future positions set to -inf before the softmax; c_proj mixes the heads back.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd ({cfg.n_embd}) must be a multiple of n_head ({cfg.n_head})")
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        self.register_buffer("causal_mask", mask.view(1, 1, cfg.block_size, cfg.block_size), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, time, n_embd) -> (batch, time, n_embd)."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        hd = C // self.n_head
        q = q.view(B, T, self.n_head, hd).transpose(1, 2)  # (B, heads, T, head_dim)
        k = k.view(B, T, self.n_head, hd).transpose(1, 2)
        v = v.view(B, T, self.n_head, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = att.masked_fill(~self.causal_mask[:, :, :T, :T], float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    """The block's feed-forward part: c_fc (n_embd -> 4 n_embd), GELU, c_proj (4 n_embd -> n_embd)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.act = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class Block(nn.Module):
    """A pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT-2-style decoder-only language model; `forward(idx, targets)` returns (logits, loss or None)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
                ln_f=nn.LayerNorm(cfg.n_embd),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # weight tying, as in GPT-2
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx, targets: (batch, time) int64 token ids, time <= block_size.

        Returns (logits (batch, time, vocab_size), mean cross-entropy loss or None). Raises ValueError for a
        sequence longer than block_size.
        """
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def _poison_grad(grad: torch.Tensor) -> torch.Tensor:
    """Tensor hook: a copy of `grad` with one NaN element (the demo's injected fault)."""
    grad = grad.clone()
    grad.view(-1)[0] = float("nan")
    return grad


def run_demo(
    db: str = DEFAULT_DB,
    run: str = "demo",
    steps: int = 3,
    seed: int = 0,
    *,
    n_layer: int = 2,
    n_head: int = 4,
    n_embd: int = 64,
    vocab_size: int = 256,
    block_size: int = 32,
    batch_size: int = 4,
    lr: float = 3e-4,
    nan_step: int | None = None,
) -> dict:
    """Build the demo GPT, train it `steps` steps on synthetic tokens with AdamW, recording each step.

    Each step (zero_grad, forward, loss.backward(), optimizer.step()) is one call of a function decorated
    with `gradstore.record(run, db=db, model=model)`, so it is one recorded step with one backward pass.

    Args:
        db: SQLite file path (created if missing) or SQLAlchemy URL.
        run: run name; recording into an existing run continues its step numbering.
        steps: number of training steps (int >= 1).
        seed: seeds the parameter init and the synthetic token generator (same seed, same numbers).
        n_layer, n_head, n_embd, vocab_size, block_size: model size (see `GPTConfig`).
        batch_size: sequences per step; each is block_size tokens long.
        lr: AdamW learning rate.
        nan_step: when given, the 0-based index of the training step (of this call) in which a tensor hook
            puts a NaN into the gradient w.r.t. the output of transformer.h.0.mlp.c_fc, so that
            `first_nonfinite` has something to find. The optimizer step is skipped there.
    Returns:
        dict with db, run, steps, first_step (the recorded step number of the first step), losses (list of
        float), parameters (count, tied weights once), config (dict) and seconds (wall time, float).
    Raises:
        ValueError: steps < 1 or a bad model size. RecordUsageError / SchemaTooNew from `record`.
    Relies on: `torch.Tensor.register_hook` for nan_step, everything else is ordinary nn.Module training.
    """
    if steps < 1:
        raise ValueError(f"run_demo(steps=...) must be >= 1, got {steps}")
    started = time.perf_counter()
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    gen = torch.Generator().manual_seed(seed)
    state = {"poison": False, "handle": None}

    def poison_hook(_module, _args, output):
        if state["poison"] and output.requires_grad:
            output.register_hook(_poison_grad)

    state["handle"] = model.transformer.h[0].mlp.c_fc.register_forward_hook(poison_hook)

    recorder = record(run, db=db, model=model, meta={"demo": asdict(cfg), "seed": seed, "batch_size": batch_size})

    @recorder
    def train_step(batch: torch.Tensor) -> float:
        recorded_steps.append(recorder.current_step)
        optimizer.zero_grad(set_to_none=True)
        _, loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        if not state["poison"]:
            optimizer.step()
        return loss.item()

    losses: list[float] = []
    recorded_steps: list[int] = []
    try:
        for i in range(steps):
            batch = torch.randint(0, vocab_size, (batch_size, block_size + 1), generator=gen)
            state["poison"] = nan_step is not None and i == nan_step
            losses.append(train_step(batch))
    finally:
        state["handle"].remove()
        recorder.flush()
    return {
        "db": str(db),
        "run": run,
        "steps": steps,
        "first_step": recorded_steps[0],
        "losses": losses,
        "parameters": sum(p.numel() for p in model.parameters()),
        "config": asdict(cfg),
        "seconds": time.perf_counter() - started,
    }
