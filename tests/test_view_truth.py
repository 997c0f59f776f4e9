"""What the viewing paths (the HTML report, `gradstore show`, `ranks`, `explain`, the plots) claim, against facts
each test computes itself with plain PyTorch: a filtered recording never reads as the whole model, agreeing ranks
are not called healthy where their gradients are NaN, a NaN loss puts the origin in the forward, the step-values
table says which rows it shows, module gains give the stored reasons, and `explain` prints the creation line."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _procs import needs_gloo, run_distributed
from click.testing import CliRunner

import gradstore
from gradstore.cli import main
from gradstore.view import html_report, story

pytest.importorskip("matplotlib")


def _invoke(*args) -> str:
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


class RMSNoEps(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.g = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x / (x.pow(2).mean(-1, keepdim=True).sqrt() + 1e-6) * self.g  # sqrt(0): a NaN gradient


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8, bias=False)
        self.norm = RMSNoEps(8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.embed(x))))


BAD = 2  # the step whose batch holds an all-zero row


def _batch(step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)
    if step == BAD:
        x[0] = 0.0
    return x, y


def _train(rec, model, steps=4, log=False):
    """The loop; returns {step: {param: NaN count of its .grad}} as plain PyTorch saw it."""
    seen = {}
    for step in range(steps):
        x, y = _batch(step)
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        seen[step] = {n: int(p.grad.isnan().sum()) for n, p in model.named_parameters()}
        if rec is not None:
            if log:
                rec.log(loss=loss)
            rec.step()
        model.zero_grad()
    return seen


@pytest.fixture(scope="module")
def filtered(tmp_path_factory):
    """(db, plain facts) of run 'head' recorded with modules='head' and the same training unrecorded."""
    db = str(tmp_path_factory.mktemp("filtered") / "f.db")
    torch.manual_seed(0)
    truth = _train(None, Net())
    torch.manual_seed(0)
    model = Net()
    with gradstore.record("head", db=db, model=model, modules="head") as rec:
        _train(rec, model)
    return db, truth, [n for n, _ in Net().named_parameters()]


def test_filtered_report_names_what_was_not_measured(filtered, tmp_path):
    db, truth, names = filtered
    outside = [n for n in names if not n.startswith("head.")]
    assert any(truth[BAD][n] for n in outside)  # plain PyTorch: a parameter left out held NaN at the bad step
    assert not any(truth[BAD][n] for n in names if n.startswith("head."))
    with gradstore.open(db) as store:
        page = html_report.report_html(store, "head")
    # no unqualified all-clear over a filtered record
    assert '<p class="calm">Every recorded step has status ok.</p>' not in page
    assert "No recorded gradient held NaN or Inf (exact counts, in every measured gradient)" not in page
    assert 'class="calm"' not in page
    said = f"{len(outside)} of the {len(names)} parameters in the record&#x27;s graph"
    assert said in page
    for n in outside:
        assert n in page
    assert "modules= / params= filter" in page


def test_filtered_show_step_says_not_checked(filtered):
    db, truth, names = filtered
    outside = [n for n in names if not n.startswith("head.")]
    out = _invoke("show", db, "head", "--step", BAD)
    assert f"{len(outside)} more not recorded" in out
    assert f"{len(outside)} of the {len(names)} parameters in the record's graph" in out
    line = next(s for s in out.splitlines() if s.startswith("Non-finite gradients"))
    assert "not measured, so not checked" in line
    run_out = _invoke("show", db, "head")
    assert f"Not measured: {len(outside)} of the {len(names)} parameters" in run_out


def test_unfiltered_record_has_nothing_left_out(tmp_path):
    db = str(tmp_path / "u.db")
    torch.manual_seed(0)
    model = Net()
    with gradstore.record("all", db=db, model=model) as rec:
        _train(rec, model, steps=2)
    with gradstore.open(db) as store:
        assert not story.left_out(store, "all")


def test_a_pass_that_raised_is_named_first_for_its_nodes_without_calls(tmp_path):
    """No filter; a node post-hook returns the wrong number of grad_inputs, so the pass raises and the engine runs
    no node after it: `show --step` names the raise as the reason its other nodes have no call, not a filter.
    Expected: the nodes a plain walk of next_functions reaches, and the RuntimeError PyTorch raises."""
    db = str(tmp_path / "r.db")
    a = torch.ones(3, requires_grad=True)
    b = torch.ones(3, requires_grad=True)
    with gradstore.record("raised", db=db):
        y = (a + b).sum()
        y.grad_fn.next_functions[0][0].register_hook(lambda gi, go: (gi[0],))  # AddBackward0 has two inputs
        with pytest.raises(RuntimeError, match="hook"):
            y.backward()
    out = _invoke("show", db, "raised", "--step", 0)
    note = next(line for line in out.splitlines() if line.startswith("Not measured"))
    assert "backward pass raised before the engine ran them" in note, note
    assert note.index("raised") < note.index("filter"), note


def test_nan_loss_puts_the_origin_in_the_forward(tmp_path):
    db = str(tmp_path / "n.db")
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    losses = []
    with gradstore.record("nanloss", db=db, model=m) as rec:
        for s in range(3):
            x, y = torch.randn(6, 4), torch.randn(6, 1)
            if s == 1:
                x[0, 0] = float("nan")  # bad input data
            loss = (m(x) - y).pow(2).mean()
            losses.append(loss.item())
            loss.backward()
            rec.log(loss=loss)
            m.zero_grad()
            rec.step()
    assert losses[1] != losses[1]  # plain: the loss of step 1 is NaN
    with gradstore.open(db) as store:
        start = story.first_nonfinite(store, "nanloss")
        page = html_report.report_html(store, "nanloss")
    assert start.step == 1 and start.forward_nonfinite
    assert "its backward made them</b>" not in page
    assert "the forward was already non-finite" in page
    assert "<code>loss</code> = NaN" in page


def test_values_table_says_which_rows_and_keeps_the_nan_ones(tmp_path):
    db = str(tmp_path / "v.db")
    steps, nan_step = 14, 1
    m = nn.Linear(2, 1)
    with gradstore.record("vals", db=db, model=m) as rec:
        for s in range(steps):
            m(torch.ones(1, 2)).sum().backward()
            rec.log(loss=float("nan") if s == nan_step else float(s))
            m.zero_grad()
            rec.step()
    with gradstore.open(db) as store:
        page = html_report.report_html(store, "vals")
    table = page[page.index('id="values"') :]
    assert f"The last 10 of {steps} rows" in table
    assert "the 1 that logged NaN or Inf" in table
    assert f'<td class="num">{nan_step}</td><td class="num">0</td><td class="num">NaN</td>' in table


def test_show_step_gives_the_stored_reasons_for_no_ratio(tmp_path):
    db = str(tmp_path / "g.db")
    torch.manual_seed(0)
    model = Net()
    with gradstore.record("g", db=db, model=model) as rec:
        truth = _train(rec, model, steps=BAD + 1)
    assert truth[BAD]["embed.weight"] > 0  # plain: NaN reached embed through norm
    out = _invoke("show", db, "g", "--step", BAD)
    line = next(s for s in out.splitlines() if s.startswith("Module gains"))
    assert "NaN or Inf in a boundary tensor" in line
    assert "no gradient flowed out (inputs that need none) or in, or a side was not measured" not in line


def test_explain_prints_the_creation_line(tmp_path):
    db = str(tmp_path / "e.db")
    torch.manual_seed(0)
    model = Net()
    with gradstore.record("e", db=db, model=model, frames=True) as rec:
        _train(rec, model, steps=1)
    source, first = inspect.getsourcelines(RMSNoEps.forward)
    line = first + next(i for i, s in enumerate(source) if "sqrt()" in s)
    out = _invoke("explain", db, "e", "norm/SqrtBackward0#0")
    assert f"created at {__file__}:{line} in forward" in out.splitlines()[1]


def test_values_plot_has_a_legend_per_rank_and_integer_steps(tmp_path, monkeypatch):
    db = str(tmp_path / "p.db")
    m = nn.Linear(2, 1)
    for rank in (0, 1):  # two ranks' files of one run, one after the other (the same as two processes)
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        with gradstore.record("two", db=db, model=m) as rec:
            for s in range(3):
                m(torch.ones(1, 2)).sum().backward()
                rec.log(loss=float(s + rank))
                m.zero_grad()
                rec.step()
    figs = []
    real = html_report._png
    monkeypatch.setattr(html_report, "_png", lambda fig, alt: (figs.append((alt, fig)), real(fig, alt))[1])
    with gradstore.open(db) as store:
        assert sorted(store.steps(run="two")["rank"].unique()) == [0, 1]
        html_report.report_html(store, "two")
    fig = next(f for alt, f in figs if alt == "step values over steps")
    ax = fig.axes[0]
    legend = ax.get_legend()
    assert legend is not None
    assert [t.get_text() for t in legend.get_texts()] == ["rank 0", "rank 1"]
    assert all(float(t).is_integer() for t in ax.xaxis.get_major_locator()())


def test_history_marks_sit_on_their_step(tmp_path):
    from gradstore.view import history

    db = str(tmp_path / "h.db")
    for run in ("a", "b"):  # two runs NaN at the same step: two marks there
        torch.manual_seed(0)
        model = Net()
        with gradstore.record(run, db=db, model=model) as rec:
            _train(rec, model, steps=BAD + 1)
    with gradstore.open(db) as store:
        fig = history(store, ["a", "b"], param="embed.weight")
    marks = [c for c in fig.axes[0].collections if c.get_offsets().shape[0]]
    xs = sorted({float(x) for c in marks for x in c.get_offsets()[:, 0]})
    assert xs == [float(BAD)]


def test_shape_heatmap_draws_no_colour_bar(tmp_path):
    from gradstore.view import heatmap

    db = str(tmp_path / "s.db")
    torch.manual_seed(0)
    model = Net()
    with gradstore.record("shape", db=db, model=model, stats="shape") as rec:
        _train(rec, model, steps=2)
    with gradstore.open(db) as store:
        fig = heatmap(store, "shape")
    assert len(fig.axes) == 1  # the map only: a colour bar would map no measured value


def _ddp_nan(rank, db):
    """DDP, 2 steps; at step 0 rank 1's batch has an all-zero row: after the all-reduce both ranks' embed.weight
    .grad is NaN. Returns {step: NaN count of embed.weight.grad} as plain PyTorch saw it on this rank."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(Net())
    seen = {}
    with gradstore.record("ddp", db=f"{db}.{rank}", model=model) as rec:
        for step in range(2):
            g = torch.Generator().manual_seed(10 * step + rank)
            x, y = torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)
            if step == 0 and rank == 1:
                x[0] = 0.0
            (model(x) - y).pow(2).mean().backward()
            seen[step] = int(model.module.embed.weight.grad.isnan().sum())
            model.zero_grad()
            rec.step()
    return seen


@needs_gloo()
@pytest.mark.usefixtures("imports_before_fork")
def test_agreeing_ranks_with_nan_are_not_called_healthy(tmp_path):
    assert dist.is_available()
    db = str(tmp_path / "d.db")
    seen = run_distributed(_ddp_nan, db)
    assert seen[0][0] > 0 and seen[1][0] > 0 and seen[0][1] == 0  # plain: both ranks NaN at step 0 only
    _invoke("merge", db, f"{db}.0", f"{db}.1")
    with gradstore.open(db) as store:
        page = html_report.report_html(store, "ddp")
    ranks = page[page.index('id="ranks"') : page.index('id="values"')]
    assert 'class="calm"' not in ranks
    assert "Agreeing is not healthy" in ranks and "(step 0)" in ranks
    assert "bitwise (checksums)" not in ranks
    out = _invoke("ranks", db, "ddp")  # the last step (1) is clean; step 0 is not
    assert "ranks agree at step 1" in out
    assert "NaN or Inf at step 0" in out
