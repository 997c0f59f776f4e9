"""Steps and parameters the report's parameter table used to lose without a word: a step whose backward pass raised
(caught by the loop) has only its final .grad rows, not the pass rows the table reads; a dead expert (never routed
to) gets an all-zero gradient, or none, in every step and never reaches the table's top, while every step's status
is ok. Every expectation comes from the loop and from plain PyTorch's p.grad, never from gradstore."""

from __future__ import annotations

import html
import re

import torch
from click.testing import CliRunner
from torch import nn

import gradstore
from gradstore.cli import main
from gradstore.view import story, write_report

STEPS = 4


def _text(db: str, run: str, out) -> str:
    write_report(db, run, out=str(out))
    page = re.sub(r"<(script|style|svg)[^>]*>.*?</\1>", "", out.read_text(), flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", page)))


class _Rnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn, self.head = nn.GRU(3, 4, batch_first=True), nn.Linear(4, 1)

    def forward(self, x, h):
        o, h = self.rnn(x, h)
        return self.head(o), h


def test_steps_whose_backward_raised_are_counted_not_dropped(tmp_path):
    db = str(tmp_path / "r.db")
    torch.manual_seed(0)
    m = _Rnn()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    h, raised, plain = torch.zeros(1, 2, 4), [], []
    with gradstore.record("bptt", db=db, model=m) as rec:
        for step in range(STEPS):
            pred, h = m(torch.randn(2, 5, 3), h)  # h not detached: the second backward raises
            opt.zero_grad(set_to_none=True)
            try:
                pred.pow(2).mean().backward()
                opt.step()
            except RuntimeError:
                raised.append(step)
            plain.append(
                {n: None if p.grad is None else p.grad.double().norm().item() for n, p in m.named_parameters()}
            )
            rec.step()
    assert raised == [1, 2, 3]
    st = gradstore.open(db)
    view = story.changed_most(st, "bptt", top=None).set_index("param")  # the pass rows, as the report reads them
    for name in plain[0]:
        r = view.loc[name]
        # every recorded step is counted somewhere: a raised step is not in this view, and says so
        assert r["steps"] + r["not_measured"] + r["no_gradient"] + r["not_in_view"] == STEPS
        assert r["not_in_view"] == len(raised)
        assert "steps 1-3" in r["not_in_view_why"] and "raised" in r["not_in_view_why"]
    final = story.changed_most(st, "bptt", top=None, which="final").set_index("param")
    for name in plain[0]:
        norms = [p[name] for p in plain if p[name] is not None]
        none = sum(p[name] is None for p in plain)
        assert final.loc[name, "steps"] == len(norms)
        assert final.loc[name, "no_gradient"] == none  # .grad None: no gradient, counted
        assert abs(final.loc[name, "largest"] - max(norms)) <= 1e-6 * max(norms)
        assert abs(final.loc[name, "smallest"] - min(norms)) <= 1e-6 * max(norms)
    assert [p["rnn.weight_ih_l0"] is None for p in plain] == [False, True, True, True]  # None where it raised
    text = _text(db, "bptt", tmp_path / "r.html")
    assert "One measured step per parameter: no change to draw." not in text
    assert "parameter-steps not counted" in text and "not_in_view" in text


class _MoE(nn.Module):
    def __init__(self, skip: bool, d=4, experts=4):
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 8), nn.ReLU(), nn.Linear(8, d)) for _ in range(experts))
        self.skip = skip

    def forward(self, x):
        logits = self.router(x).clone()
        logits[:, 3] = -1e4  # expert 3 is never chosen
        w, idx = logits.softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for e, ex in enumerate(self.experts):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if self.skip and tok.numel() == 0:
                continue
            out = out.index_add(0, tok, ex(x.index_select(0, tok)) * w[tok, slot].unsqueeze(-1))
        return out


def _moe_run(db: str, skip: bool) -> list[dict]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), _MoE(skip), nn.Linear(4, 1))
    opt = torch.optim.Adam(m.parameters(), lr=0.01)
    seen = []
    with gradstore.record("moe", db=db, model=m) as rec:
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            m(torch.randn(6, 4)).pow(2).mean().backward()
            seen.append({n: None if p.grad is None else bool(p.grad.any()) for n, p in m.named_parameters()})
            opt.step()
            rec.step()
    return seen


def test_a_dead_expert_is_named(tmp_path):
    for skip in (False, True):
        db = str(tmp_path / f"moe{int(skip)}.db")
        seen = _moe_run(db, skip)
        dead = [n for n in seen[0] if all(s[n] is None or s[n] is False for s in seen)]
        assert dead and all(n.startswith("1.experts.3.") for n in dead)
        assert all(s[n] is None for s in seen for n in dead) == skip  # skipped: no .grad; run empty: all zeros
        st = gradstore.open(db)
        got = story.never_gradient(st, "moe")
        assert got["names"].tolist() == ["1.experts.3.*"] and got["params"].tolist() == [len(dead)]
        assert ("not used" if skip else "all-zero") in got["why"].iloc[0]
        text = _text(db, "moe", tmp_path / f"moe{int(skip)}.html")
        assert f"1.experts.3.* ({len(dead)} parameters)" in text
        out = CliRunner().invoke(main, ["show", db, "moe"], catch_exceptions=False).output
        assert f"1.experts.3.* ({len(dead)} parameters)" in out
        if not skip:  # the step's .grad norms table: an all-zero gradient is not called ok
            out = CliRunner().invoke(main, ["show", db, "moe", "--step", "0", "--limit", "50"]).output
            table = out[out.index("Largest finite parameter .grad norms") :]
            rows = [line.split() for line in table.splitlines() if line.split()[1:2] and line.split()[1] in dead]
            assert len(rows) == len(dead) and all(r[2] == "zero" for r in rows)
