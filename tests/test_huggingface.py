"""The HuggingFace callback (gradstore.integrations.huggingface) under the real `transformers.Trainer`: a tiny GPT-2
built from a config (no download), a few optimizer steps with gradient accumulation and clipping, on the CPU,
alone and under DDP (2 gloo ranks, forked, 127.0.0.1).

What is expected comes from the Trainer itself (state.log_history), from a plain callback of the test's own
that reads `p.grad` with torch where the Trainer hands the gradients to the optimizer, and from micro-batches
counted with a forward pre-hook: never from gradstore.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from _procs import free_port, run_processes  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import gradstore  # noqa: E402
from gradstore.integrations.huggingface import GradstoreCallback  # noqa: E402

VOCAB = 40


def _model(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 24, seq: int = 8):
        self.x = torch.randint(0, VOCAB, (n, seq), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


class SeeGrads(TrainerCallback):
    """The test's own eyes: each parameter's .grad norm (torch, float64) where the Trainer is about to step."""

    def __init__(self):
        self.norms: list[dict[str, float]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.norms.append({n: float(p.grad.double().norm()) for n, p in model.named_parameters() if p.grad is not None})


def _args(out, **kw) -> TrainingArguments:
    base = dict(
        output_dir=str(out),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        max_grad_norm=0.5,
        learning_rate=1e-3,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    base.update(kw)
    return TrainingArguments(**base)


def _train(tmp_path, db, run="hf", **kw):
    model = _model()
    forwards = []
    model.register_forward_pre_hook(lambda m, args: forwards.append(1) if m.training else None)
    see = SeeGrads()
    callback = GradstoreCallback(run, db=db)
    trainer = Trainer(
        model=model, args=_args(tmp_path / "out", **kw), train_dataset=Tokens(), callbacks=[callback, see]
    )
    trainer.train()
    return trainer, callback, see, len(forwards)


def test_steps_passes_values_and_final_gradients_match_the_trainer(tmp_path):
    db = str(tmp_path / "hf.db")
    trainer, callback, see, micro_batches = _train(tmp_path, db)
    history = trainer.state.log_history
    store = gradstore.open(db)
    steps = store.steps("hf")
    # one gradstore step per optimizer step, each with its micro-batches as passes
    assert list(steps["step"]) == [0, 1, 2] == list(range(trainer.state.global_step))
    assert micro_batches == 6 and list(steps["passes"]) == [2, 2, 2] and set(steps["status"]) == {"ok"}
    # the values the Trainer logged (log_history), at the step they belong to
    values = store.values("hf")
    for entry in history:
        row = values.loc[(entry["step"] - 1, 0)]
        for name, logged in entry.items():
            if name != "step":
                assert row[name] == pytest.approx(logged, rel=1e-12), name
    assert list(values["global_step"]) == [1, 2, 3]
    assert {"loss", "grad_norm", "learning_rate", "epoch", "clip_grad_norm", "train_loss"} <= set(values.columns)
    # gradstore's own observation of the Trainer's clipping is the grad_norm it logged (the pre-clip norm)
    logged_norms = [e["grad_norm"] for e in history if "grad_norm" in e]
    assert list(values["clip_grad_norm"]) == pytest.approx(logged_norms, rel=1e-6)
    # final rows: .grad where the Trainer hands it to the optimizer (after clipping), as the test read it
    grads = store.param_grads("hf", which="all")
    final = grads[grads["final"] == 1]
    at_pass = grads[grads["final"] == 0]
    assert len(see.norms) == 3
    for step, norms in enumerate(see.norms):
        got = final[final["step"] == step].set_index("param")["norm"]
        assert set(got.index) == set(norms)
        for name, norm in norms.items():
            assert got[name] == pytest.approx(norm, rel=1e-6), (step, name)
        # the pass's rows stay what the hooks saw: before clipping by the coefficient the Trainer used
        total = values.loc[(step, 0), "clip_grad_norm"]
        coef = min(1.0, 0.5 / (total + 1e-6))
        assert coef < 1  # the test clips for real
        before = at_pass[at_pass["step"] == step].set_index("param")["norm"]
        for name, norm in norms.items():
            assert before[name] * coef == pytest.approx(norm, rel=1e-5), (step, name)
    assert (at_pass["pass"] == 1).all()  # the last micro-batch's pass
    assert callback.recorder.last_step.step == 2 and callback.recorder.last_step.status == "ok"
    assert store.runs().set_index("run").loc["hf", "status"] == "finished"


def test_on_nonfinite_raise_stops_the_trainer_after_the_step_is_written(tmp_path):
    db = str(tmp_path / "nan.db")
    model = _model()
    with torch.no_grad():
        model.transformer.h[0].mlp.c_fc.weight[0, 0] = float("nan")
    callback = GradstoreCallback("hf-nan", db=db, on_nonfinite="raise")
    trainer = Trainer(
        model=model, args=_args(tmp_path / "out", max_grad_norm=0.0), train_dataset=Tokens(), callbacks=[callback]
    )
    with pytest.raises(gradstore.NonFiniteGradient) as info:
        trainer.train()
    callback.close(info.value)
    store = gradstore.open(db)
    steps = store.steps("hf-nan")
    assert list(steps["status"]) == ["nonfinite"] and info.value.step == 0
    first = store.first_nonfinite("hf-nan")
    assert info.value.key == first["key"].iloc[0] and info.value.module == first["module"].iloc[0]


# ---- DDP: two ranks, each recording its own steps -------------------------------------------------------------
def _ddp_rank(rank: int, port: int, db: str, out: str):
    # OMP_NUM_THREADS: accelerate would otherwise set more torch threads for a multi-CPU run, and the intra-op
    # pool inherited through fork from a parent that already used it hangs
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        OMP_NUM_THREADS="1",
    )
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(True)  # the parent's (single-process) state came along with the fork
    PartialState._reset_state()
    model = _model()
    see = SeeGrads()
    callback = GradstoreCallback("hf-ddp", db=db)
    args = _args(out, ddp_backend="gloo", max_steps=2)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback, see])
    trainer.train()
    world = torch.distributed.get_world_size()
    history = [dict(e) for e in trainer.state.log_history]
    torch.distributed.destroy_process_group()
    return {"world": world, "history": history, "norms": see.norms}


@pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="gloo is not available")
def test_ddp_two_ranks_each_record_their_steps(tmp_path):
    import torch._dynamo  # noqa: F401 - DDP imports it: once here, not in each forked rank

    db = str(tmp_path / "ddp.db")
    results = run_processes(_ddp_rank, 2, free_port(), db, str(tmp_path / "out"), timeout=180)
    assert [r["world"] for r in results] == [2, 2]
    store = gradstore.open(db)
    steps = store.steps("hf-ddp")
    assert sorted(zip(steps["rank"], steps["step"])) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert set(steps["passes"]) == {2} and set(steps["status"]) == {"ok"}
    assert store.runs().set_index("run").loc["hf-ddp", "world_size"] == 2
    values = store.values("hf-ddp")
    for rank, result in enumerate(results):
        for entry in result["history"]:
            if "loss" in entry:
                assert values.loc[(entry["step"] - 1, rank), "loss"] == pytest.approx(entry["loss"], rel=1e-12)
        final = store.param_grads("hf-ddp", rank=rank)
        for step, norms in enumerate(result["norms"]):
            got = final[final["step"] == step].set_index("param")["norm"]
            for name, norm in norms.items():
                assert got[name] == pytest.approx(norm, rel=1e-6)
    # after the all-reduce the ranks' final gradients agree bitwise (their checksums), step by step
    assert store.rank_divergence("hf-ddp").empty
    assert not math.isnan(values["grad_norm"].iloc[0])
