"""record(values=...): the elements of small gradients, stored as little-endian bytes, read back bit for bit, and
compared between runs and steps by Store.diff / first_divergence (values_* computed here with plain PyTorch)."""

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
from sqlalchemy import text

import gradstore
from gradstore.store import database


def sql(db, query: str) -> list[tuple]:
    """Rows of `query` on the database `db` (SQLite path or URL)."""
    engine = database.make_engine(db)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(query))]
    finally:
        engine.dispose()


class Net(nn.Module):
    def __init__(self, seed=0, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.Linear(4, 3).to(dtype)
        self.head = nn.Linear(3, 2).to(dtype)

    def forward(self, x, keep=None):
        h = self.fc(x)
        if keep is not None:
            h.retain_grad()
            keep.append(h)
        return self.head(torch.tanh(h)).pow(2).mean()


def test_stored_elements_are_the_gradients_bit_for_bit(db):
    net = Net()
    x = torch.randn(5, 4)
    with gradstore.record("v", db=db, model=net, values=["fc", "head.bias"]):
        kept = []
        net(x, kept).backward()
    store = gradstore.open(db)
    for name, p in net.named_parameters():
        if name.startswith("fc") or name == "head.bias":
            got = store.tensor("v", param=name)
            assert got.dtype == p.grad.dtype and torch.equal(got, p.grad), name
    with pytest.raises(gradstore.ValuesNotRecorded, match="none are stored for that key"):
        store.tensor("v", param="head.weight")  # not selected
    # fc's AddmmBackward0 grad_output is the gradient w.r.t. fc's output (kept by retain_grad)
    assert torch.equal(store.tensor("v", key="fc/AddmmBackward0#0", role="grad_output"), kept[0].grad)
    # plain bytes, little-endian, C order: no pickle
    ((data, shape),) = sql(
        db,
        "SELECT v.data, v.shape FROM tensor_values v JOIN tensors t ON t.id = v.id JOIN nodes n ON n.id = t.node_id "
        "WHERE n.key = 'param:fc.weight' AND t.role = 2",
    )
    assert shape == "3,4" and bytes(data) == np.ascontiguousarray(net.fc.weight.grad.numpy(), dtype="<f4").tobytes()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_dtypes_round_trip(db, dtype):
    net = Net(dtype=dtype)
    with gradstore.record("v", db=db, model=net, values="*"):
        net(torch.randn(5, 4, dtype=dtype)).backward()
    got = gradstore.open(db).tensor("v", param="fc.weight")
    assert got.dtype == dtype and torch.equal(got, net.fc.weight.grad)


def test_max_numel_and_the_byte_budget_bound_what_is_stored(db):
    net = Net()
    x = torch.randn(5, 4)
    # max_numel=6: only gradients of at most 6 elements; budget: 40 bytes, room for ten float32 elements
    with gradstore.record("v", db=db, model=net, values="*", max_numel=6, values_budget=40):
        net(x).backward()
    store = gradstore.open(db)
    numels = sql(
        db,
        "SELECT t.numel, CASE WHEN v.id IS NULL THEN 0 ELSE 1 END FROM tensors t "
        "LEFT JOIN tensor_values v ON v.id = t.id WHERE t.role IN (0, 1, 2) AND t.status = 0 AND t.final = 0 "
        "ORDER BY t.id",
    )
    stored = [n for n, has in numels if has]
    small = [n for n, _ in numels if n <= 6]
    assert stored and all(n <= 6 for n in stored) and sum(stored) * 4 <= 40
    steps = store.steps("v")
    assert int(steps.values_bytes[0]) == sum(stored) * 4
    assert int(steps.values_left_out[0]) == len(small) - len(stored) > 0
    with pytest.raises(gradstore.ValuesNotRecorded):
        store.tensor("v", param="fc.weight")  # 12 elements: over max_numel


def test_values_options_are_checked():
    with pytest.raises(gradstore.RecordUsageError, match="give values="):
        gradstore.record("v", max_numel=10)
    with pytest.raises(gradstore.RecordUsageError, match="max_numel"):
        gradstore.record("v", values="*", max_numel=0)
    with pytest.raises(gradstore.RecordUsageError, match="values"):
        gradstore.record("v", values=[""])


def _plain_compare(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float]:
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    max_abs = float((a - b).abs().max())
    rel = max_abs / max(float(a.abs().max()), float(b.abs().max()))
    cos = float(torch.dot(a, b) / (a.norm() * b.norm()))
    return max_abs, rel, cos


def test_diff_of_two_runs_and_of_two_steps_compares_the_elements(db):
    nets, grads = {}, {}
    for run, seed in (("a", 0), ("b", 1)):
        net = nets[run] = Net(0)
        torch.manual_seed(seed)
        with gradstore.record(run, db=db, model=net, values="*") as rec:
            for step in range(2):
                net(torch.randn(5, 4)).backward()
                grads[run, step] = net.fc.weight.grad.clone()
                net.zero_grad()
                if step == 0:
                    rec.step()
    store = gradstore.open(db)
    d = store.diff("a", "b", step_a=1)
    row = d[(d.key == "param:fc.weight") & (d.role == "param_grad")].iloc[0]
    max_abs, rel, cos = _plain_compare(grads["a", 1], grads["b", 1])
    assert row.values_compared == "yes" and "values" in row.differs.split(",")
    assert row.values_max_abs == pytest.approx(max_abs, rel=1e-12)
    assert row.values_rel == pytest.approx(rel, rel=1e-12)
    assert row.values_cosine == pytest.approx(cos, rel=1e-12)
    # two steps of one run
    s = store.diff("a", step_a=0, step_b=1)
    row = s[(s.key == "param:fc.weight") & (s.role == "param_grad")].iloc[0]
    assert row.values_max_abs == pytest.approx(_plain_compare(grads["a", 0], grads["a", 1])[0], rel=1e-12)
    # a run against itself: equal elements
    same = store.diff("a", "a")
    # a None slot has no elements, and values= stores no final param_grad row (pass NaN): 'no: no values on
    # either side'
    ok = same[(same.status_a == "ok") & same.pass_a.notna()]
    assert (same[same.pass_a.isna()].values_compared == "no: no values on either side").all()
    assert len(ok) > 10 and (ok.values_compared == "yes").all() and (ok.values_max_abs == 0).all()
    assert (same[same.status_a == "none"].values_compared == "no: no values on either side").all()
    assert not same.differs.str.contains("values").any()
    assert np.allclose(ok.values_cosine.dropna().to_numpy(dtype=float), 1.0, rtol=1e-12, atol=0)


def test_first_divergence_sees_elements_whose_statistics_agree(db):
    """A permuted gradient has the same norm, min, max, mean, std and zeros: the statistics agree, the elements
    do not. The .sql file (statistics only) finds nothing; Store.first_divergence finds the call."""
    for run, c in (("a", [1.0, 2.0, 3.0, 0.0]), ("b", [3.0, 2.0, 1.0, 0.0])):
        w = nn.Parameter(torch.zeros(4))
        with gradstore.record(run, db=db, model=nn.ParameterList([w]), values="*"):
            (w * torch.tensor(c)).sum().backward()
    store = gradstore.open(db)
    assert store.query("first_divergence", run_a="a", run_b="b").empty
    first = store.first_divergence("a", "b")
    # in execution order: MulBackward0's grad_input (c, the gradient of w) comes before AccumulateGrad's call
    assert list(zip(first.key, first.role, first.slot)) == [("MulBackward0#0", "grad_input", 0)]
    row = first.iloc[0]
    assert row.differs == "values" and row.values_max_abs == 2.0 and row.values_rel == pytest.approx(2 / 3)
    assert row.values_cosine == pytest.approx((3 + 4 + 3) / 14)
    # within a tolerance that covers the difference, the sides agree
    assert store.first_divergence("a", "b", atol=2.0).empty
    # the SumBackward0 call before it agrees, and says it was compared
    d = store.diff("a", "b")
    assert d[d.key == "SumBackward0#0"].values_compared.eq("yes").all()
    assert d[d.key == "SumBackward0#0"].differs.eq("").all()


def test_without_values_nothing_is_compared_and_says_so(db):
    for run in ("a", "b"):
        net = Net(0)
        with gradstore.record(run, db=db, model=net):
            net(torch.ones(5, 4)).backward()
    d = gradstore.open(db).diff("a", "b")
    assert (d.values_compared == "no: no values on either side").all()
    assert d.values_max_abs.isna().all() and (d.differs == "").all()


def test_float64_overflow_and_nonfinite_elements_compare_sensibly(db):
    # the same statistics on both sides (min, max, mean, norm, std; SQL's differences of them stay finite: on
    # PostgreSQL a float8 overflow is an error), elements 2e308 apart
    nan = float("nan")
    for run, c in (("a", [1e308, -1e308, 1e308, nan]), ("b", [1e308, 1e308, -1e308, nan])):
        w = nn.Parameter(torch.zeros(4, dtype=torch.float64))
        with gradstore.record(run, db=db, model=nn.ParameterList([w]), values="*"):
            (w * torch.tensor(c, dtype=torch.float64)).sum().backward()
    d = gradstore.open(db).diff("a", "b")
    row = d[d.role == "param_grad"].iloc[0]
    assert row.values_max_abs == math.inf  # 1e308 - (-1e308) overflows: an infinite difference
    assert row.values_rel == math.inf and row.values_compared == "yes"
    assert row.values_cosine is None or math.isnan(row.values_cosine)  # a NaN element: no cosine


@pytest.mark.parametrize("stats", ["health", "shape"])
def test_values_at_the_other_levels(db, stats):
    net = Net()
    with gradstore.record("v", db=db, model=net, values="fc", stats=stats):
        net(torch.randn(5, 4)).backward()
    assert torch.equal(gradstore.open(db).tensor("v", param="fc.bias"), net.fc.bias.grad)


def test_the_command_line_names_elements_that_differ(db):
    from click.testing import CliRunner

    from gradstore.cli import main

    for run, c in (("a", [1.0, 2.0]), ("b", [2.0, 1.0])):
        w = nn.Parameter(torch.zeros(2))
        with gradstore.record(run, db=db, model=nn.ParameterList([w]), values="*"):
            (w * torch.tensor(c)).sum().backward()
    out = CliRunner().invoke(main, ["diff", db, "a", "b"]).output
    assert "first at MulBackward0#0 grad_inputs[0]" in out and "elements differ: max |a - b| 1 (rel 0.5" in out


def test_rows_of_one_side_only_are_not_compared_and_the_rest_are(db):
    """Both sides stored elements and side b's graph has a node side a's has not (a `/ 1.0` at the root): its rows
    are one-sided, their elements 'not compared' with the reason; the shared rows are compared as usual. The
    multiplier differs in order only (same statistics), so the first divergence is MulBackward0's elements."""
    from click.testing import CliRunner

    from gradstore.cli import main

    c = {"a": [1.0, 2.0, 3.0, 0.0], "b": [3.0, 2.0, 1.0, 0.0]}
    for run in ("a", "b"):
        w = nn.Parameter(torch.zeros(4))
        with gradstore.record(run, db=db, model=nn.ParameterList([w]), values="*"):
            loss = (w * torch.tensor(c[run])).sum()
            (loss / 1.0 if run == "b" else loss).backward()
    store = gradstore.open(db)
    d = store.diff("a", "b")
    only_b = d[d.side == "b"]
    assert set(only_b.key) == {"DivBackward0#0"} and len(only_b) == 3  # grad_output, grad_inputs[0] and [1]
    assert (only_b.values_compared == "no: a row of side b only").all() and only_b.values_max_abs.isna().all()
    assert (d.side != "a").all()
    grad = d[(d.side == "both") & (d.role == "param_grad") & d.pass_a.notna()].iloc[0]
    assert grad.values_compared == "yes"  # w's gradient: c, compared element by element
    assert grad.values_max_abs == 2.0 and "values" in grad.differs.split(",")
    first = store.first_divergence("a", "b")
    assert list(zip(first.key, first.role, first.slot, first.differs)) == [
        ("MulBackward0#0", "grad_input", 0, "values")
    ]
    # the command line reads the same rows
    result = CliRunner().invoke(main, ["diff", db, "a", "b"])
    assert result.exit_code == 0, result.output
    assert "3 only in run 'b'" in result.output and "first at MulBackward0#0 grad_inputs[0]" in result.output
