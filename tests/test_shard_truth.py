"""What the readers say about sharded gradients, checked against plain torch in the ranks (gloo on 127.0.0.1,
two forked processes: tests/_procs.py):

- `global_norm` / `global_grads` describe the moment `which=` names: by default the step's final rows (the .grad
  the optimizer read), so the total norm is what `clip_grad_norm_` returned after a division by the number of
  micro-batches (DDP) and after a rank changed its own shard (FSDP2), and each parameter's norm is
  `p.grad.full_tensor().norm()` then; `which="pass"` is the undivided / unchanged gradient of the backward pass;
- `module_gains` under tensor parallelism gives no one-rank ratio for the calls whose gradients are DTensor pieces
  (the ratio of one rank's pieces is not the gain computed from both ranks' pieces, which the test computes);
- `gradstore show`, `gradstore explain` and `gradstore.view.history` name a shard as a shard (placements, global
  shape) and give the whole parameter's norm beside it, equal to `full_tensor().norm()`.
"""

from __future__ import annotations

import contextlib
import math
import re

import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _procs import needs_gloo, run_distributed
from click.testing import CliRunner

import gradstore
from gradstore.cli import main

pytestmark = [needs_gloo(), pytest.mark.usefixtures("imports_before_fork")]

if dist.is_available():  # imported once here: the forked ranks inherit them
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0, self.act, self.l1 = nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)

    def forward(self, x):
        return self.l1(self.act(self.l0(x)))


class TPNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre, self.up, self.act, self.down = nn.Linear(4, 4), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)

    def forward(self, x):
        return self.down(self.act(self.up(self.pre(x))))


def _full_norms(model) -> dict:
    """{name: norm of the whole .grad} (full_tensor(): a collective, the same order on every rank)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        out[name] = float(g.double().norm())
    return out


def _clip(model) -> float:
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)  # clips nothing
    return float(total.full_tensor() if isinstance(total, DTensor) else total)


def _ddp_accum(rank, db):
    """Two micro-batches (the first under no_sync), .grad divided by 2, then clip_grad_norm_: per step its return
    and the whole norms after the pass and after the division."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = Net()
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    clips, passes = [], []
    with gradstore.record("accum", db=db, model=model) as rec:
        for step in range(2):
            for mb in range(2):
                torch.manual_seed(1000 + 100 * step + 10 * rank + mb)
                with model.no_sync() if mb == 0 else contextlib.nullcontext():
                    model(torch.randn(5, 4)).pow(2).mean().backward()
            passes.append(math.sqrt(sum(float(p.grad.double().norm()) ** 2 for p in net.parameters())))
            for p in net.parameters():
                p.grad.div_(2)
            clips.append(_clip(net))
            opt.step()
            opt.zero_grad()
            rec.step()
    return {"clips": clips, "passes": passes}


def _fsdp_scaled(rank, db):
    """FSDP2; after each backward pass rank 1 multiplies its shards by 3, then clip_grad_norm_."""
    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model.l0, mesh=mesh)
    fully_shard(model.l1, mesh=mesh)
    fully_shard(model, mesh=mesh)
    clips, before, after = [], [], []
    with gradstore.record("fsdp", db=db, model=model) as rec:
        for step in range(2):
            torch.manual_seed(100 + step + 10 * rank)
            model(torch.randn(5, 4)).pow(2).mean().backward()
            before.append(_full_norms(model))
            if rank == 1:
                for p in model.parameters():
                    p.grad.to_local().mul_(3.0)
            after.append(_full_norms(model))
            clips.append(_clip(model))
            for p in model.parameters():
                p.grad = None
            rec.step()
    return {"clips": clips, "before": before, "after": after}


def _tp_gains(rank, db):
    """pre (plain) -> up (ColwiseParallel) -> ReLU -> down (RowwiseParallel), the same batch on both ranks. The
    gradient flowing into and out of each TP module, whole, from plain torch: tensor hooks on the module's input
    and output, their local pieces all-gathered where they are shards."""
    torch.manual_seed(0)
    model = TPNet()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    seen = {}

    def keep(name):
        def hook(g):
            seen[name] = g.detach().clone()

        return hook

    def fwd_hook(name):
        def hook(module, args, out):
            args[0].register_hook(keep(f"{name}.in"))  # the gradient flowing out of the call (w.r.t. its input)
            out.register_hook(keep(f"{name}.out"))  # the gradient flowing into it (w.r.t. its output)

        return hook

    handles = [getattr(model, n).register_forward_hook(fwd_hook(n)) for n in ("down", "act")]
    with gradstore.record("tp", db=db, model=model):
        torch.manual_seed(100)
        model(torch.randn(5, 4)).pow(2).mean().backward()
    for h in handles:
        h.remove()

    def whole(t):
        if isinstance(t, DTensor):
            return float(t.full_tensor().double().norm())
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t.contiguous())  # a rank's local columns: the whole is every rank's columns
        return float(torch.cat(parts, dim=-1).double().norm())

    local = {k: float((v.to_local() if isinstance(v, DTensor) else v).double().norm()) for k, v in seen.items()}
    # down's output gradient is replicated (the same on every rank); its input's and act's are this rank's columns
    gains = {
        "down": whole(seen["down.in"]) / float(seen["down.out"].double().norm()),
        "act": whole(seen["act.in"]) / whole(seen["act.out"]),
    }
    return {"gains": gains, "local": local, "full": _full_norms(model)}


class TPExtra(TPNet):
    """TPNet with `extra` (plain), used on rank 0 only: its .grad is None on rank 1, and the gradient flowing into
    down's replicated output differs between the ranks, so down.bias (RowwiseParallel: Replicate) is a copy each
    rank computed for itself."""

    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(3, 3)

    def forward(self, x, use_extra=False):
        h = super().forward(x)
        return h + self.extra(h) if use_extra else h


def _tp_extra(rank, db):
    """TPExtra, two steps, the same batch on both ranks: per parameter its .grad's layout on this rank ('plain',
    'none', or the DTensor placements), and per step down.bias's .grad norm on this rank (its own copy)."""
    torch.manual_seed(0)
    model = TPExtra()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    layouts, bias = {}, []
    with gradstore.record("tpx", db=db, model=model) as rec:
        for step in range(2):
            torch.manual_seed(200 + step)
            model(torch.randn(5, 4), use_extra=rank == 0).pow(2).mean().backward()
            for name, p in model.named_parameters():
                g = p.grad
                layouts[name] = "none" if g is None else str(tuple(g.placements)) if isinstance(g, DTensor) else "plain"
            bias.append(float(model.down.bias.grad.to_local().double().norm()))
            opt.step()
            opt.zero_grad()
            rec.step()
    return {"layouts": layouts, "bias": bias}


def _scenario(rank, db):
    return {
        "accum": _ddp_accum(rank, db),
        "fsdp": _fsdp_scaled(rank, db),
        "tp": _tp_gains(rank, db),
        "tpx": _tp_extra(rank, db),
    }


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    db = str(tmp_path_factory.mktemp("shards") / "grads.db")
    return db, run_distributed(_scenario, db, timeout=150)


def _invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_global_norm_is_what_clip_grad_norm_returned_after_a_division(record):
    db, ranks = record
    res = ranks[0]["accum"]
    assert res["clips"] == ranks[1]["accum"]["clips"]
    with gradstore.open(db) as store:
        final = store.global_norm("accum")
        passed = store.global_norm("accum", which="pass")
        both = store.global_norm("accum", which="all")
    assert list(final["final"]) == [1, 1] and list(passed["final"]) == [0, 0]
    for step in (0, 1):
        assert final["total_norm"][step] == pytest.approx(res["clips"][step], rel=1e-6)
        # the pass rows are the undivided gradient: twice what the optimizer read
        assert passed["total_norm"][step] == pytest.approx(res["passes"][step], rel=1e-6)
        assert passed["total_norm"][step] == pytest.approx(2 * res["clips"][step], rel=1e-6)
    assert len(both) == 4 and set(both["final"]) == {0, 1}


def test_global_grads_follow_a_rank_that_changed_its_shard(record):
    db, ranks = record
    res = ranks[0]["fsdp"]
    with gradstore.open(db) as store:
        final = store.global_grads("fsdp")
        passed = store.global_grads("fsdp", which="pass")
        norms = store.global_norm("fsdp")
        scope = store.param_grads("fsdp", scope="global", which="pass")
    pd.testing.assert_frame_equal(scope, passed)
    assert set(final["final"]) == {1} and set(passed["final"]) == {0}
    for frame, want in ((final, res["after"]), (passed, res["before"])):
        for _, row in frame.iterrows():
            assert row["status"] == "ok", row["not_derivable"]
            assert row["norm"] == pytest.approx(want[int(row["step"])][row["param"]], rel=1e-6), row["param"]
    for step in (0, 1):
        assert norms["total_norm"][step] == pytest.approx(res["clips"][step], rel=1e-6)
        assert res["after"][step]["l0.bias"] != pytest.approx(res["before"][step]["l0.bias"], rel=1e-3)


def test_a_bad_which_is_refused(record):
    db, _ = record
    with gradstore.open(db) as store, pytest.raises(gradstore.QueryParameterError):
        store.global_norm("fsdp", which="later")


def test_module_gains_under_tensor_parallelism_give_no_one_rank_ratio(record):
    db, ranks = record
    with gradstore.open(db) as store:
        gains = store.module_gains("tp", step=0)
    for module in ("up", "act", "down"):
        rows = gains[gains["module"] == module]
        assert len(rows) == 2
        assert rows["ratio"].isna().all(), rows
        assert rows["no_ratio"].str.startswith("not compared").all()
    # what a one-rank ratio would have said is not the gain of the whole gradients (computed in the ranks)
    for module in ("down", "act"):
        true = ranks[0]["tp"]["gains"][module]
        assert true == pytest.approx(ranks[1]["tp"]["gains"][module], rel=1e-9)
        one_rank = gains[gains["module"] == module].eval("out_norm / in_norm")
        assert all(abs(r - true) > 1e-3 for r in one_rank), (module, true, list(one_rank))
    pre = gains[gains["module"] == "pre"]
    assert set(pre["no_ratio"]) == {"nothing flowed out (no input of the call needs a gradient)"}
    shown = _invoke("show", db, "tp", "--step", 0).output
    assert "not compared" in shown and "tensor parallelism" in shown


def test_show_names_each_shard_and_gives_the_parameters_norm(record):
    db, ranks = record
    out = _invoke("show", db, "fsdp", "--step", 0).output
    table = out.split("Largest finite parameter .grad norms")[1]
    assert "this rank's shard, (Shard(dim=0),) of (3,6)" in table
    assert "param_norm" in table and "norm_of" in table
    full = ranks[0]["fsdp"]["after"][0]["l1.weight"]
    lines = [line for line in table.splitlines() if " l1.weight " in line]
    assert len(lines) == 2 and all(f"{full:.6g}" in line for line in lines)


def test_explain_names_the_shard(record):
    db, _ = record
    out = _invoke("explain", db, "tp", "down/AddmmBackward0#0").output
    assert "grad_input[1]  (5,4) float32 [this rank's shard, (Shard(dim=1),) of (5,8)" in out


def test_history_labels_each_rank_as_its_shard_and_draws_the_whole_parameter(record):
    pytest.importorskip("matplotlib")
    from gradstore.view import cells, history

    db, ranks = record
    with gradstore.open(db) as store:
        data = cells.series(store, "fsdp", param="l1.weight")
        fig = history(store, "fsdp", param="l1.weight")
    pieces = data[data["part"] == "piece"]
    assert set(pieces["rank"]) == {0, 1}
    assert all("shard, (Shard(dim=0),) of (3,6)" in label for label in pieces["label"])
    whole = data[data["rank"].isna()].sort_values("step")
    want = [ranks[0]["fsdp"]["before"][s]["l1.weight"] for s in (0, 1)]  # the pass rows: before rank 1's change
    assert list(whole["value"]) == pytest.approx(want, rel=1e-6)
    ax = fig.axes[0]
    assert "local shard" in ax.get_title(loc="left")
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("whole parameter" in t for t in labels) and any("rank 1: this rank's shard" in t for t in labels)


def _title_fits(fig) -> None:
    """The left title of the figure's first axes, drawn, lies inside the figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    ax = fig.axes[0]
    (title,) = [t for t in ax.get_children() if getattr(t, "get_text", None) and t.get_text() == ax.get_title("left")]
    box = title.get_window_extent(canvas.get_renderer())
    assert box.x0 >= 0 and box.x1 <= fig.bbox.x1, (box, fig.bbox)


def test_history_title_of_a_sharded_parameter_fits_the_figure(record):
    pytest.importorskip("matplotlib")
    from gradstore.view import history

    db, _ = record
    with gradstore.open(db) as store:
        fig = history(store, "fsdp", param="l1.weight")
    _title_fits(fig)
    words = fig.axes[0].get_title(loc="left").replace("\n", " ")
    assert "each rank's local shard (DTensor piece, named in the legend), not the whole gradient" in words


def _rule_sets(ranks, run) -> tuple[set, set]:
    """(replicated, sharded) from the ranks' own .grad layouts: a parameter is replicated where some rank holds a
    plain .grad or a DTensor Replicate on every mesh dimension (copies whose values must agree), sharded where some
    rank holds a Shard or Partial piece."""
    replicated, sharded = set(), set()
    for res in ranks:
        for name, layout in res[run]["layouts"].items():
            if layout == "plain" or (layout != "none" and "Shard" not in layout and "Partial" not in layout):
                replicated.add(name)
            if "Shard" in layout or "Partial" in layout:
                sharded.add(name)
    return replicated, sharded


def test_ranks_and_the_report_count_replicated_and_sharded_parameters_alike(record, tmp_path):
    pytest.importorskip("matplotlib")
    from gradstore.view import story

    db, ranks = record
    replicated, sharded = _rule_sets(ranks, "tpx")
    assert replicated == {"pre.weight", "pre.bias", "down.bias", "extra.weight", "extra.bias"}
    assert sharded == {"up.weight", "up.bias", "down.weight"}
    assert ranks[1]["tpx"]["layouts"]["extra.weight"] == "none"  # not used on rank 1: in no column but differing
    out = _invoke("ranks", db, "tpx", "--step", 0).output
    lists = [re.match(r"  (replicated|sharded) \(.*?\): (\d+): (.*)$", line) for line in out.splitlines()]
    listed = {m.group(1): (int(m.group(2)), set(m.group(3).split(", "))) for m in lists if m}
    assert listed == {"replicated": (5, replicated), "sharded": (3, sharded)}, out
    assert "in both lists" not in out
    with gradstore.open(db) as store:
        agree = story.rank_agreement(store, "tpx")
    assert list(agree["replicated"]) == [len(replicated)] * 2 and list(agree["sharded"]) == [len(sharded)] * 2
    assert list(agree["both"]) == [0, 0]
    page = tmp_path / "tpx.html"
    assert _invoke("report", db, "tpx", "-o", page).exit_code == 0
    html = page.read_text()
    table = html[html.index('id="ranks"') :]
    table = table[table.index("<table>") : table.index("</table>")]
    head = [re.sub("<[^>]+>", "", c) for c in re.findall(r"<th[^>]*>(.*?)</th>", table)]
    first = [re.sub("<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", table.split("</tr>")[1])]
    row = dict(zip(head, first))
    assert (row["replicated"], row["sharded"]) == (str(len(replicated)), str(len(sharded))), row
    assert "both" not in head  # no parameter is both: no column for it


def test_changed_most_names_a_replicate_copy_whose_ranks_differ(record):
    from gradstore.view import story

    db, ranks = record
    mine, theirs = ranks[0]["tpx"]["bias"], ranks[1]["tpx"]["bias"]
    assert all(abs(a - b) > 1e-3 * a for a, b in zip(mine, theirs))  # each rank's own copy
    assert ranks[0]["tpx"]["layouts"]["down.bias"] == "(Replicate(),)"
    with gradstore.open(db) as store:
        top = story.changed_most(store, "tpx", top=None).set_index("param")
        other = story.changed_most(store, "tpx", rank=1, top=None).set_index("param")
    row = top.loc["down.bias"]
    assert (row["first"], row["last"]) == (pytest.approx(mine[0], rel=1e-6), pytest.approx(mine[1], rel=1e-6))
    assert row["norm_of"] == (
        "rank 0: this rank's copy, (Replicate(),) of (3): the ranks' copies differ (ranks 0 to 1, in 1 region(s)) "
        "at steps 0-1"
    )
    assert other.loc["down.bias", "first"] == pytest.approx(theirs[0], rel=1e-6)
    assert other.loc["down.bias", "norm_of"].startswith("rank 1: this rank's copy, (Replicate(),) of (3): ")
    assert top.loc["pre.weight", "norm_of"] == ""  # a plain .grad whose ranks agree
    assert top.loc["up.weight", "norm_of"] == "the whole parameter (every rank's shards combined)"
