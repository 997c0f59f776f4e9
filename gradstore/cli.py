"""The `gradstore` command line: record the built-in demo, list runs, summarise a run or step, run named
queries, upgrade a database's schema.

    gradstore demo                       record a small GPT's backward passes into ./gradstore.db
    gradstore runs DB                    the runs in a database
    gradstore show DB RUN [--step N]     a run, or one step of it (why parameters lack gradients, gains, ...)
    gradstore query DB NAME [-p k=v]     a named query of queries/ as a table (or --csv)
    gradstore queries                    the named queries, their titles and parameters
    gradstore explain DB RUN KEY         what the record knows about one node (edges, calls, gradients)
    gradstore explain DB RUN --sequence-nr N --step S    the same, for the node with autograd sequence number N
    gradstore db upgrade DB              bring a database to the newest schema revision
    gradstore diff DB RUN_A RUN_B        where two runs (or two steps or ranks of one) first part
    gradstore ranks DB RUN [--step N]    do the ranks' parameter gradients agree at a step
    gradstore merge OUT IN...            join per-rank or per-machine databases into one
    gradstore report DB RUN [-o F]       one self-contained HTML page telling a run's story
    gradstore datasette DB [--port P]    browse DB in Datasette, with queries/ as canned queries

Commands that can take long (merge, db upgrade, report) show a progress bar on stderr when it is a terminal,
and nothing when it is piped or redirected. `gradstore --help` imports neither torch nor the plotting libraries.

Every error gradstore raises on purpose (GradstoreError), a database error, and a malformed option come out
as one line on stderr (`Error: ...`) with exit status 1 (2 for click's own usage errors), never a traceback.
Relies on click >= 8.1 and pandas for the tables.
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
from contextlib import contextmanager

import click
import pandas as pd
from sqlalchemy import and_, func, select
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from .errors import GradstoreError
from .records import HOOK_RAISED
from .store import queries as named_queries
from .store import schema as s
from .store import shards
from .store.database import DEFAULT_DB, damaged
from .store.database import explain as explain_db
from .store.reader import Store, step_span, unwritten_why
from .store.schema import UNWRITTEN
from .store.values import DTENSOR_PIECES
from .store.writer import step_ranges as _step_ranges
from .version import __version__

# ---- errors: one line, non-zero exit ---------------------------------------------------------------------


def _one_line(exc: BaseException) -> str:
    """The error as one line: a GradstoreError's message; for a database error the driver's message and type
    (without SQLAlchemy's statement echo and background link)."""
    if isinstance(exc, GradstoreError):
        return " ".join(str(exc).split()) or type(exc).__name__
    orig = getattr(exc, "orig", None)  # the DBAPI exception under an SQLAlchemy DBAPIError
    cause = orig if orig is not None else exc
    text = " ".join(str(cause).split()) or type(cause).__name__
    return f"database error: {text} ({type(cause).__module__}.{type(cause).__name__})"


class _Command(click.Command):
    """A command whose database errors name its database (the argument DB): a damaged SQLite file, wherever the
    command reads it, gets the message every reader gives (`gradstore.store.database.explain`: the file, SQLite's
    words, `PRAGMA integrity_check` and `.recover`), not the driver's bare one."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except DBAPIError as exc:
            db = ctx.params.get("db") or ctx.params.get("db_path")
            if isinstance(db, str) and damaged(exc):
                raise explain_db(db, exc, writing=False) from None
            raise


class _Group(click.Group):
    """A click group that turns GradstoreError and SQLAlchemyError into a one-line ClickException; its commands
    are `_Command`s."""

    command_class = _Command

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (GradstoreError, SQLAlchemyError) as exc:
            raise click.ClickException(_one_line(exc)) from None


@contextmanager
def _store(db: str):
    """Open `db` for reading (a `Store`) and close it afterwards. Raises DatabaseNotFound (nothing created)."""
    store = Store(db)
    try:
        yield store
    finally:
        store.close()


@contextmanager
def _progress(description: str, total: int | None = None):
    """A rich progress bar on stderr while it is a terminal; yields update(completed=None, total=None,
    description=None). Piped or redirected (or under click's test runner) it draws nothing."""
    if not sys.stderr.isatty():
        yield lambda **_kw: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)

        def update(completed=None, total=None, description=None):
            fields = {
                k: v
                for k, v in (("completed", completed), ("total", total), ("description", description))
                if v is not None
            }
            bar.update(task, **fields)

        yield update


# ---- formatting ------------------------------------------------------------------------------------------


def _table(df: pd.DataFrame, empty: str = "  (none)") -> str:
    """The frame as plain text: every row and column, no index, indented two spaces."""
    if df.empty:
        return empty
    df = df.copy()
    for col in df.columns[df.dtypes == object]:  # noqa: E721 - pandas dtypes compare with ==
        df[col] = df[col].map(lambda v: "-" if v is None or (isinstance(v, float) and pd.isna(v)) else v)
    text = df.to_string(index=False, na_rep="-", float_format=lambda v: f"{v:.6g}")
    return "\n".join("  " + line for line in text.splitlines())


def _when(ts) -> str:
    """Seconds since the epoch as local 'YYYY-MM-DD HH:MM:SS', or '-' for None/NaN."""
    if ts is None or pd.isna(ts):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(ts)))


def _short(text, width: int = 100) -> str:
    """One line of at most `width` characters."""
    line = " ".join(str(text).split())
    return line if len(line) <= width else line[: width - 3] + "..."


def _module_label(module) -> str:
    return module if isinstance(module, str) and module else "(top level: the model itself or no module)"


def _queries_path_hint(name: str) -> str:
    """Path of queries/NAME.sql as it is best typed from the current directory."""
    path = named_queries.queries_dir() / f"{name}.sql"
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return str(path)
    return rel if not rel.startswith("..") else str(path)


def _counts(store: Store, run: str, step: int | None = None, rank: int | None = None) -> dict[str, int]:
    """Row counts of one run (or of one step of it): steps, passes, nodes, edges, calls, tensors.

    Counted with SQL COUNT(*) on the tables, so large runs are not loaded into memory. nodes and edges are
    per run (a graph node is stored once, the first time it is seen); with `step` they are left out.
    """

    def step_filter(q):
        q = q.where(s.steps.c.run_id == s.runs.c.id, s.runs.c.name == run)
        if step is not None:
            q = q.where(s.steps.c.step == step)
        if rank is not None:
            q = q.where(s.steps.c.rank == rank)
        return q

    counts = {}
    with store.engine.connect() as conn:
        # grouped by the status itself: PostgreSQL refuses a GROUP BY of an expression with a bound parameter
        per_status = select(s.steps.c.status, func.count()).select_from(s.steps, s.runs)
        by_status = dict(conn.execute(step_filter(per_status).group_by(s.steps.c.status)).all())
        unwritten = int(by_status.get(UNWRITTEN, 0))
        counts["steps"] = int(sum(by_status.values())) - unwritten
        if unwritten:
            counts["unwritten"] = unwritten
        counts["passes"] = conn.execute(
            step_filter(
                select(func.count()).select_from(s.passes.join(s.steps, s.passes.c.step_id == s.steps.c.id), s.runs)
            )
        ).scalar()
        if step is None:
            for name, table in (("nodes", s.nodes), ("edges", s.edges)):
                counts[name] = conn.execute(
                    select(func.count())
                    .select_from(table, s.runs)
                    .where(table.c.run_id == s.runs.c.id, s.runs.c.name == run)
                ).scalar()
        pass_calls = and_(
            s.calls.c.id.between(s.passes.c.first_call, s.passes.c.last_call),  # an id range
            s.calls.c.pass_id == s.passes.c.id,
        )
        counts["calls"] = conn.execute(
            step_filter(
                select(func.count()).select_from(
                    s.passes.join(s.steps, s.passes.c.step_id == s.steps.c.id).join(s.calls, pass_calls), s.runs
                )
            )
        ).scalar()
        counts["tensors"] = conn.execute(
            step_filter(
                select(func.count()).select_from(s.tensors.join(s.steps, s.tensors.c.step_id == s.steps.c.id), s.runs)
            )
        ).scalar()
    return counts


def _counts_lines(counts: dict[str, int]) -> str:
    what = {
        "steps": "recorded steps (all ranks)",
        "unwritten": "steps the writer could not write (status unwritten: only their steps row is stored)",
        "passes": "backward passes (loss.backward() / torch.autograd.grad calls)",
        "nodes": "distinct autograd nodes (grad_fn and AccumulateGrad), stored once per run",
        "edges": "graph edges (next_functions)",
        "calls": "node executions",
        "tensors": "gradient statistics rows (grad_outputs, grad_inputs, parameter .grad)",
    }
    width = max(8, *(len(name) + 1 for name in counts))
    return "\n".join(f"  {name:<{width}}{n:>9,}  {what[name]}" for name, n in counts.items())


def _slowest_nodes(calls: pd.DataFrame, top: int) -> pd.DataFrame:
    """Nodes by total call duration: key, module, calls, total_ms, mean_ms (top `top`)."""
    if calls.empty:
        return calls
    g = calls.assign(module=calls["module"].map(_module_label)).groupby(["key", "module"], dropna=False)
    out = g["duration"].agg(calls="count", total="sum", mean="mean").reset_index()
    out = out.sort_values("total", ascending=False).head(top)
    return pd.DataFrame(
        {
            "node": out["key"],
            "module": out["module"],
            "calls": out["calls"],
            "total_ms": (out["total"] * 1e3).round(3),
            "mean_ms": (out["mean"] * 1e3).round(3),
        }
    )


def _largest_module_norms(norms: pd.DataFrame, top: int) -> pd.DataFrame:
    """Modules by their largest grad_output_norm over steps: module, step, grad_output_norm, grad_input_norm."""
    if norms.empty:
        return norms
    idx = norms.groupby("module", dropna=False)["grad_output_norm"].idxmax().dropna()
    best = norms.loc[idx].sort_values("grad_output_norm", ascending=False).head(top)
    return pd.DataFrame(
        {
            "module": best["module"].map(_module_label),
            "step": best["step"],
            "grad_output_norm": best["grad_output_norm"],
            "grad_input_norm": best["grad_input_norm"],
            "nonfinite": best["nonfinite"],
        }
    )


def _first_nonfinite_line(store: Store, run: str, step: int | None = None) -> str | None:
    """'First non-finite gradient: ...' for the run's first call with NaN/Inf gradients (per rank; where no call
    held one first, the parameter's `.grad` that did, as at stats='params'), or None.

    With `step`, only when that call (or `.grad`) is in that step.
    """
    bad = store.first_nonfinite(run=run)
    gaps = bad.attrs.get("not_recorded", {})  # the run's first: steps before it that nobody measured
    lost_bad = bad.attrs.get("nonfinite_unwritten", {})  # before it: steps known non-finite, not written
    if step is not None:
        bad = bad[bad["step"] == step]
    if bad.empty:
        if step is None and lost_bad:  # none in the record, yet the recorder saw one: not "all finite"
            return "\n".join(
                f"First non-finite gradient (rank {rank}): not in the record: {lost['note']}"
                for (_, rank), lost in sorted(lost_bad.items())
            )
        return None
    from .view.story import amp_fault_note, amp_skipped_steps  # pandas only, as the CLI

    every = store.steps(run=run)
    lost = every[every["status"] == UNWRITTEN]
    skipped = amp_skipped_steps(store, run)
    lines, notes = [], []
    for (rank, _, _), rows in bad.groupby(["rank", "phase", "seq"], sort=False, dropna=False):
        r = rows.iloc[0]
        gap = gaps.get((run, int(rank)))
        if gap:  # steps before it that nobody measured: the first non-finite gradient may be there
            notes.append(f"(rank {rank}: {gap['note']})")
        gone = lost_bad.get((run, int(rank)))
        if gone and step is None:  # a step before it went non-finite and was not written: the first is there
            notes.append(f"(rank {rank}: {gone['note']}: the first non-finite gradient is there, not in the record)")
        fault = (
            amp_fault_note(store, run, int(rank), int(r["step"])) if (int(rank), int(r["step"])) in skipped else None
        )
        if fault and step is None:  # the scaler handled that one: name the first step that is a fault
            notes.append(f"(rank {rank}: {fault})")
        before_lost = lost[(lost["rank"] == rank) & (lost["step"] < r["step"])]["step"]
        said = (gap["steps"].get("unwritten", []) + gap.get("earlier", {}).get("unwritten", [])) if gap else []
        before_lost = before_lost[~before_lost.isin(said)]  # said above
        if len(before_lost):  # the record cannot say that nothing went non-finite there
            notes.append(
                f"(rank {rank}: steps {_step_ranges(before_lost)} before it were not written: a non-finite gradient "
                "there is not in the record)"
            )
        scaler = (
            "; in this step a torch.amp.GradScaler skipped the optimizer step (grad_scaler.skipped = 1): the "
            "parameters were not updated from these gradients"
            if (int(rank), int(r["step"])) in skipped
            else ""
        )
        if r["role"] in ("loss", "activation"):  # record(forward=True): a value of the forward, not a gradient
            what = (
                f"the loss, root of backward pass {r['pass']} ({r['key']} in {_module_label(r['module'])})"
                if r["role"] == "loss"
                else f"the output of module {_module_label(r['module'])} ({r['key']}, output {r['slot']})"
            )
            lines.append(
                f"First non-finite value (rank {rank}): step {r['step']}, in the forward: {what}: {r['nan']} nan, "
                f"{r['posinf']} +inf, {r['neginf']} -inf of {r['numel']} (a forward value, before any gradient){scaler}"
            )
            continue
        if r["role"] == "param_grad":  # no node call held one first: a parameter's .grad (stats='params')
            where = "the step's final rows" if pd.isna(r["pass"]) else f"pass {r['pass']}"
            level = store.steps(run=run, step=int(r["step"]), rank=int(rank))["level"]
            before = (
                "no node call is measured at stats='params', which records no AccumulateGrad call either: which "
                "parameter's .grad went non-finite first within the pass is not known"
                if (level == "params").any()
                else "no recorded node call before it held one"
            )
            others = bad[(bad["rank"] != rank) & (bad["step"] == r["step"]) & (bad["role"] != "param_grad")]
            if len(others):  # a collective (DDP's all-reduce) carries another rank's gradients into this .grad
                ranks = ", ".join(str(int(x)) for x in sorted(others["rank"].unique()))
                before += (
                    f"; in that step a node call on rank {ranks} held NaN/Inf, and a collective such as DDP's "
                    "all-reduce carries it into every rank's .grad: this parameter is one of those it reached"
                )
            lines.append(
                f"First non-finite gradient (rank {rank}): step {r['step']}, {where}: the .grad of {r['key']} "
                f"({r['nan']} nan, {r['posinf']} +inf, {r['neginf']} -inf of {r['numel']}; {before}){scaler}"
            )
            continue
        slots = "; ".join(
            f"{row.role}[{row.slot}]: {row.nan} nan, {row.posinf} +inf, {row.neginf} -inf" for row in rows.itertuples()
        )
        from .view.story import region_origin_note  # pandas only, as the CLI

        region = region_origin_note(store, run, r["key"])
        lines.append(
            f"First non-finite gradient (rank {rank}): step {r['step']}, pass {r['pass']}, seq {r['seq']}: "
            f"{r['key']} in {_module_label(r['module'])} ({slots}){scaler}" + (f" ({region})" if region else "")
        )
    return "\n".join(lines + notes)


# ---- the commands ------------------------------------------------------------------------------------------

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@click.group(cls=_Group, context_settings=CONTEXT)
@click.version_option(__version__, "-V", "--version", prog_name="gradstore", help="Print the version and exit.")
def main():
    """gradstore: record every autograd backward pass of PyTorch training into a database, and read it back.

    Start with `gradstore demo`, then `gradstore show gradstore.db demo`.
    """


@main.command(short_help="Record a small built-in GPT's backward passes (a few seconds).")
@click.option("--db", default=DEFAULT_DB, show_default=True, help="SQLite file (created if missing) or SQLAlchemy URL.")
@click.option(
    "--run",
    "run_name",
    default="demo",
    show_default=True,
    help="Run name; recording into an existing run continues its step numbering.",
)
@click.option("--steps", default=3, show_default=True, type=click.IntRange(min=1), help="Training steps to record.")
@click.option("--seed", default=0, show_default=True, help="Seed of the weights and the synthetic tokens.")
@click.option(
    "--nan-step",
    type=click.IntRange(min=0),
    default=None,
    help="Inject a NaN into the gradient at transformer.h.0.mlp.c_fc in this step (0-based) "
    "so that first_nonfinite has something to find.",
)
@click.option(
    "--top",
    default=5,
    show_default=True,
    type=click.IntRange(min=1),
    help="Rows in the slowest-node and gradient-norm tables.",
)
def demo(db, run_name, steps, seed, nan_step, top):
    """Train a small built-in GPT (2 layers, 64 wide) a few steps on random tokens and record every backward pass.

    Prints what was recorded: row counts, the slowest autograd nodes, the modules with the largest gradient
    norms, and how to look further. Takes a few seconds on a CPU.
    """
    from .demo import run_demo  # imported here: the other commands do not need the model code

    summary = run_demo(db=db, run=run_name, steps=steps, seed=seed, nan_step=nan_step)
    cfg = summary["config"]
    losses = summary["losses"]
    first = summary["first_step"]
    last = first + steps - 1
    click.echo(
        f"Recorded run {run_name!r} into {db}: steps {first}-{last} of a GPT ({cfg['n_layer']} layers, "
        f"{cfg['n_head']} heads, {cfg['n_embd']} wide, vocab {cfg['vocab_size']}, seq {cfg['block_size']}, "
        f"{summary['parameters']:,} parameters) in {summary['seconds']:.2f} s; "
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"
    )
    with _store(db) as store:
        click.echo(f"\nRows in run {run_name!r}" + (" (all its steps, not only these)" if first else "") + ":")
        click.echo(_counts_lines(_counts(store, run_name)))
        calls = store.calls(run=run_name)
        click.echo(
            f"\nSlowest nodes (total backward time over steps {first}-{last}):"
            if not first
            else "\nSlowest nodes (total backward time over all steps of the run):"
        )
        click.echo(_table(_slowest_nodes(calls, top)))
        norms = store.grad_norms(run=run_name, by="module")
        click.echo(
            "\nLargest gradient norms by module (at the step where it peaked; the L2 norm over every grad_output "
            "of every node the module owns, so a gradient counts again at each node it enters: not one gradient's "
            "norm; Store.module_gains has the gradient crossing a module's boundary):"
        )
        click.echo(_table(_largest_module_norms(norms, top)))
        bad = _first_nonfinite_line(store, run_name)
        if bad:
            click.echo("\n" + bad)
    hints = [
        (f"gradstore show {db} {run_name}", "summary of the run, step by step"),
        (f"gradstore show {db} {run_name} --step {last}", "passes, slowest calls and gradients of one step"),
        (f"gradstore query {db} grad_norms -p run={run_name} -p by=module", "gradient norms per module and step"),
        ("gradstore queries -v", "every named query: what it returns, its parameters"),
        (f"sqlite3 {db} < {_queries_path_hint('first_nonfinite')}", "the same SQL without gradstore"),
    ]
    width = max(len(cmd) for cmd, _ in hints)
    click.echo("\nLook further:")
    for cmd, what in hints:
        click.echo(f"  {cmd:<{width}}   # {what}")


@main.command(short_help="List the runs in a database.")
@click.argument("db")
def runs(db):
    """List the runs in database DB (a SQLite file or SQLAlchemy URL): status, steps, last step, times, versions.

    The status is the aggregate over the run's ranks: `running` while any rank's writer is live, `interrupted`
    where a rank's process died with its scope open (at once where it ran on this host: its pid is gone; else
    once its last heartbeat is older than its lease), `error` where a rank raised, `finished` when every rank that
    recorded ended cleanly. A run of several ranks gets a line saying how each rank's recording stands."""
    with _store(db) as store:
        df = store.runs()
        lost = {run: _unwritten_line(store, run) for run, n in zip(df["run"], df["unwritten"]) if n}
        several = _several_ranks(store, df)
    if df.empty:
        click.echo(f"no runs in {db}")
        return
    out = pd.DataFrame(
        {
            "run": df["run"],
            "status": [_status_with_unwritten(st, n) for st, n in zip(df["status"], df["unwritten"])],
            "steps": df["steps"],
            "last_step": df["last_step"].map(lambda v: "-" if pd.isna(v) else str(int(v))),
            "last_step_at": df["last_step_at"].map(_when),
            "world_size": df["world_size"],
            "created": df["created_at"].map(_when),
            "finished": df["finished_at"].map(_when),
            "torch": df["torch_version"],
            "gradstore": df["gradstore_version"],
            "host": df["host"],
        }
    )
    click.echo(_table(out))
    for run, line in lost.items():
        click.echo(f"run {run!r}: {line}")
    for run, line in zip(df["run"], df["ranks"]):
        if run in several:
            click.echo(f"run {run!r}: {line}")
    resumed = store.run_ranks()
    for h in resumed[(resumed["history"] != "") & ~resumed["run"].isin(several)].itertuples():
        click.echo(f"run {h.run!r}: rank {int(h.rank)} {h.history}")  # one rank: its earlier processes


def _several_ranks(store: Store, runs: pd.DataFrame) -> set[str]:
    """The runs of `runs` (a Store.runs frame) recorded by, or for, more than one rank: a world size above 1, or
    several ranks in this database."""
    counts = store.run_ranks().groupby("run")["rank"].nunique()
    return {r for r, w in zip(runs["run"], runs["world_size"]) if w > 1 or counts.get(r, 0) > 1}


def _status_with_unwritten(status: str, unwritten) -> str:
    """A run's status, with the count of steps the writer could not write when there are some."""
    n = 0 if unwritten is None or pd.isna(unwritten) else int(unwritten)
    return f"{status}, {n:,} step{'s' if n != 1 else ''} not written" if n else status


def _unwritten_why(error) -> str:
    """The writer's error from an unwritten step's error text ('not written to the database: E; the step's ...')."""
    text = "" if error is None or pd.isna(error) else str(error)
    head = "not written to the database: "
    if text.startswith(head):
        text = text[len(head) :].split("; the step's status was", 1)[0]
    return _short(text, 160)


def _unwritten_line(store: Store, run: str, rank: int | None = None) -> str | None:
    """'N steps not written (steps 6-29): <the writer's error>' for the steps of `run` the writer could not
    write (status unwritten), None when there are none."""
    steps = store.steps(run=run, rank=rank)
    lost = steps[steps["status"] == UNWRITTEN]
    if lost.empty:
        return None
    ranks = sorted(int(r) for r in lost["rank"].unique())
    on = f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if steps["rank"].nunique() > 1 else ""
    why = "; ".join(dict.fromkeys(_unwritten_why(e) for e in lost["error"]))
    return (
        f"{len(lost):,} step{'s' if len(lost) != 1 else ''} not written (steps {_step_ranges(lost['step'])}{on}): "
        f"the writer could not write them ({why}); nothing of them is in the database but their steps rows, "
        "status unwritten"
    )


FSDP_HELD = (
    "gradient accumulating inside FSDP2 (set_requires_gradient_sync(False)): not yet reduce-scattered into .grad"
)


def _fsdp_held(status: pd.DataFrame, passes: pd.DataFrame) -> int:
    """How many rows of `status` (Store.param_status of a step) got a gradient (status ok) that FSDP2 holds, not
    yet reduce-scattered into `.grad` (has_grad 0) because its rank's last top-level backward pass of the step ran
    with FSDP2's gradient sync off (`passes` of the step: fsdp_sync 0, or 2 where off for some modules)."""
    if status.empty or passes.empty or "fsdp_sync" not in passes or "has_grad" not in status:
        return 0
    top = passes[passes["parent_pass"].isna() & (passes["kind"] == "backward")]
    last = top.sort_values("pass").groupby("rank")["fsdp_sync"].last()
    off = {int(r) for r, v in last.items() if v in (0, 2)}
    if not off:
        return 0
    rows = status[(status["status"] == "ok") & (status["has_grad"] == 0) & status["rank"].isin(off)]
    return len(rows)


def _status_why(
    row,
    skipped: dict | None = None,
    raised: str | None = None,
    where: tuple = (False, None),
    fault: str = "",
    last_bad: str | None = None,
) -> str:
    """One line of README's param_status table for a row of Store.param_status (its status and the facts).

    skipped: parameter name -> the reason its gradient rows were stored as skipped in the step (a parameter with
    status 'received' whose gradient could not be measured: meta device, complex dtype, ...); raised: what a
    top-level backward pass of the step raised ('backward pass 0 raised RuntimeError: ... in BadBackward#0'),
    None when none did; where: `_raise_where` of the step's passes (a node's call left open; the parameter whose own
    gradient hook raised); fault: the step's recorder faults ('' for none: `story.recorder_faults`); last_bad: where
    no call was left open, the last call that returned in a pass that raised, where its grad_inputs held NaN/Inf
    ('SqrtBackward0#0 (pass 0, seq 7)': `_last_call_nonfinite`), else None."""
    status, reached = row.status, row.reached
    if status == "unreachable":
        calls = getattr(row, "calls", None)
        if calls is not None and calls == calls and calls > 0:
            return (
                "its AccumulateGrad ran with no gradient: the backward of the op that uses it returned None for it "
                "(an undefined grad_output)"
            )
        if reached == 1 and (calls is None or calls != calls) and fault:
            return (
                "a pass reached its AccumulateGrad and its .grad did not change; whether the pass ran it is not known: "
                f"a recorder fault in the step may have lost its call ({_short(fault, 160)})"
            )
        open_call, hook_param = where
        if reached == 1 and raised and hook_param is not None and hook_param in (row.param, row.node_param):
            return (
                "the pass raised in a hook on this parameter's own gradient (Tensor.register_hook on it): the engine "
                f"got to its AccumulateGrad and the hook's error stopped the pass before it accumulated ({raised})"
            )
        if reached == 1 and raised and (open_call or hook_param is not None):
            return f"a pass reached its AccumulateGrad and did not run it: {raised}, before the engine got to it"
        anomaly = _anomaly_node(raised)
        if reached == 1 and raised and anomaly:
            return (
                f"a pass reached its AccumulateGrad and did not run it: {raised}: anomaly mode's NaN check raised "
                f"right after a call of {anomaly} returned NaN (that call is not in the record), before the engine "
                "got to it"
            )
        if reached == 1 and raised:
            return (
                f"a pass reached its AccumulateGrad and did not run it: {raised}; where the pass raised is not known "
                "(no node's call was left open: the engine raised outside a node's backward, e.g. in a tensor hook, "
                "perhaps on this parameter's gradient"
                + (
                    f"; the last call that returned, {last_bad}, held NaN/Inf in its grad_inputs: a check on them "
                    "after it (a hook of your own, or anomaly mode) may have raised"
                    if last_bad
                    else ""
                )
                + ")"
            )
        if raised and (reached is None or reached != reached):  # stats='params': no graph walked, and a pass raised
            return (
                f"its module ran and got no gradient: {raised}"
                + (f" (anomaly mode's NaN check, right after a call of {anomaly} returned NaN)" if anomaly else "")
                + "; the engine stopped the pass there, before the nodes "
                "after it ran, which may be why; whether a pass's roots reach it is not known (stats='params' walks "
                "no graph: else detached, a branch the loss does not use, or backward(inputs=...))"
            )
        if reached == 1:
            return "a pass reached its AccumulateGrad and did not run it: torch.autograd.grad or backward(inputs=...)"
        if reached is None or reached != reached:  # NULL: no graph was walked (stats='params')
            return (
                "its module ran and got no gradient; whether a pass's roots reach it is not known (stats='params' "
                "walks no graph: detached, a branch the loss does not use, or backward(inputs=...))"
            )
        return "its module ran, but no pass's roots reach it (detached, or a branch the loss does not use)"
    if status == "received" and skipped and row.param in skipped:
        return f"received a gradient that could not be measured: {skipped[row.param]}"
    if status == "frozen" and row.has_grad == 1 and row.calls == 0:  # calls NULL: whether it got one is not known
        return (
            "requires_grad=False; received nothing this step, and .grad still holds a tensor from before (an earlier "
            "gradient, or zeros from zero_grad(set_to_none=False)), which an optimizer still applies: with "
            "momentum or weight decay the parameter still moves"
        )
    return {
        "frozen": "requires_grad=False",
        "zero": "received gradients, all exactly 0",
        "received": "received a gradient whose values were not measured at this stats level",
        "stale": "received nothing this step; .grad still holds a tensor from before (an earlier gradient, or "
        "zeros from zero_grad(set_to_none=False))",
        "not used": _not_used_why(row),
    }.get(status, "")


def _not_used_why(row) -> str:
    """Why a 'not used' parameter got nothing: its module's forward did not run, or (module_ran NULL) no call of it
    was seen inside a torch.compile region, where module calls run in compiled code."""
    ran, reached = getattr(row, "module_ran", None), getattr(row, "reached", None)
    if ran is None or ran != ran:
        why = (
            "no call of its module's forward was seen: the module is inside a torch.compile region, where module "
            "calls run in compiled code, so whether it ran is not known"
        )
        return why + ("; no pass reached its AccumulateGrad" if reached == 0 else "")
    return "its module's forward did not run in the step"


def _skipped_what(rows: pd.DataFrame) -> str:
    """'Gradients', or 'Gradients and forward rows' where Store.not_measured `rows` hold activation or loss rows
    (record(forward=True): a module output that could not be measured, the calls inside a torch.compile region)."""
    forward = rows["role"].isin(["activation", "loss"]) if len(rows) else rows["role"]
    if not forward.any():
        return "Gradients"
    return "Forward rows" if forward.all() else "Gradients and forward rows"


def _reasons(rows: pd.DataFrame, limit: int = 3) -> str:
    """'reason (n rows); ...' from Store.not_measured rows, the most frequent reasons first."""
    if rows.empty:
        return ""
    counts = rows.assign(reason=rows["reason"].fillna("no reason recorded")).groupby("reason")["tensors"].sum()
    counts = counts.sort_values(ascending=False, kind="stable")
    parts = [f"{reason} ({int(n):,})" for reason, n in counts.head(limit).items()]
    if len(counts) > limit:
        parts.append(f"{len(counts) - limit:,} more reasons")
    return "; ".join(parts)


def _raise_where(passes: pd.DataFrame) -> tuple[bool, str | None]:
    """Where the step's top-level passes that raised raised (rows of Store.passes): (a node's call was left open in
    one, raised_at; the parameter one of whose own gradient hooks raised, from passes.error's note, or None)."""
    if "error" not in passes.columns:
        return False, None
    bad = passes[passes["error"].notna() & passes["parent_pass"].isna()]
    open_call = bool(bad["raised_at"].map(lambda v: isinstance(v, str)).any()) if len(bad) else False
    for error in bad["error"]:
        at = str(error).rfind(HOOK_RAISED)
        if at >= 0 and str(error).endswith("]"):
            return open_call, str(error)[at + len(HOOK_RAISED) : -1]
    return open_call, None


_ANOMALY = re.compile(r"Function '([^']+)' returned nan values in its \d+\w* output")


def _anomaly_node(error: str | None) -> str | None:
    """The node name in anomaly mode's error ("Function 'SqrtBackward0' returned nan values in its 0th output.",
    raised by the engine under torch.autograd.detect_anomaly(check_nan=True) right after that node's call returned
    NaN in its grad_inputs), else None."""
    m = _ANOMALY.search(error) if isinstance(error, str) else None
    return m.group(1) if m else None


def _last_call_nonfinite(store: Store, run: str, step: int, rank: int | None, passes: pd.DataFrame) -> str | None:
    """'KEY (pass P, seq S)' of the last call that returned in a top-level pass of the step that raised (rows of
    Store.passes), where that call's grad_inputs were measured holding NaN/Inf; None where no such call (none
    recorded, or its grad_inputs measured finite or not measured)."""
    bad = passes[passes["error"].notna() & passes["parent_pass"].isna()]
    if bad.empty:
        return None
    tensors = store.tensors(run=run, step=step, rank=rank)
    calls = store.calls(run=run, step=step, rank=rank)
    for p in bad.to_dict("records"):
        done = calls[(calls["rank"] == p["rank"]) & (calls["pass"] == p["pass"]) & calls["duration"].notna()]
        if done.empty:
            continue
        last = done.sort_values("seq").iloc[-1]
        rows = tensors[
            (tensors["rank"] == p["rank"])
            & (tensors["seq"] == last["seq"])
            & (tensors["role"] == "grad_input")
            & (tensors["status"] == "ok")
        ]
        held = rows[["nan", "posinf", "neginf"]].apply(pd.to_numeric).fillna(0).to_numpy().sum()
        if held > 0:
            return f"{last['key']} (pass {last['pass']}, seq {last['seq']})"
    return None


def _raised_text(passes: pd.DataFrame) -> str | None:
    """What the top-level passes that raised raised: 'backward pass 0 raised RuntimeError: ... in BadBackward#0'
    (rows of Store.passes; the node is the call left open, where one was, or the call after which anomaly mode's
    NaN check raised: 'right after SqrtBackward0#0's call returned NaN ...'); None when none raised."""
    if "error" not in passes.columns:
        return None
    bad = passes[passes["error"].notna() & passes["parent_pass"].isna()]
    if bad.empty:
        return None
    parts = []
    for p in bad.to_dict("records"):
        where = f" in {p['raised_at']}" if isinstance(p["raised_at"], str) else ""
        if where and _anomaly_node(p["error"]):  # the call returned; anomaly mode checked its grad_inputs after it
            where = (
                f" right after {p['raised_at']}'s call returned NaN in its grad_inputs (anomaly mode's check, "
                "torch.autograd.detect_anomaly(check_nan=True))"
            )
        parts.append(f"backward pass {p['pass']} raised {_short(p['error'], 120)}{where}")
    return "; ".join(parts)


def _limited(df: pd.DataFrame, limit: int) -> tuple[pd.DataFrame, str]:
    """The first and last rows of `df`, `limit` in all, and a line saying how many were left out ('' for none)."""
    if len(df) <= limit:
        return df, ""
    half = max(limit // 2, 1)
    shown = pd.concat([df.head(half), df.tail(limit - half)]) if limit > 1 else df.head(1)
    return shown, f"  ... {len(df) - len(shown):,} more rows not shown (--limit, or `gradstore query`)"


def _table_keeping(df: pd.DataFrame, keep: list[int], gap: callable) -> str:
    """`df` as `_table` prints it, but only the rows at positions `keep`; where rows are left out, a line at that
    place says which ('  ... N rows not shown: <gap(rows left out)>')."""
    keep = sorted(set(keep))
    if len(keep) == len(df):
        return _table(df)
    lines = _table(df.iloc[keep]).splitlines()
    out = [lines[0]]
    prev = -1
    for line, pos in zip(lines[1:], keep):
        if pos > prev + 1:
            hidden = df.iloc[prev + 1 : pos]
            out.append(f"  ... {len(hidden):,} rows not shown: {gap(hidden)}")
        out.append(line)
        prev = pos
    if prev < len(df) - 1:
        hidden = df.iloc[prev + 1 :]
        out.append(f"  ... {len(hidden):,} rows not shown: {gap(hidden)}")
    return "\n".join(out)


def _shown(db: str) -> str:
    """A database path as given, or a URL with its password hidden ('***'), for printing."""
    if "://" not in str(db):
        return str(db)
    from sqlalchemy.engine import make_url

    try:
        return make_url(str(db)).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy reads: print nothing of it but its scheme
        return str(db).split("://", 1)[0] + "://..."


def _steps_gap(hidden: pd.DataFrame) -> str:
    statuses = ", ".join(f"{n:,} {s}" for s, n in hidden["status"].value_counts().items())
    lost = hidden[hidden["status"] == UNWRITTEN]
    if len(lost) and len(lost) < len(hidden):  # named apart: a range must not read as steps all written
        statuses += f"; not written: steps {_step_ranges(lost['step'])}"
    return f"steps {_step_ranges(hidden['step'])} ({statuses})"


def _show_run(store: Store, db: str, run: str, rank: int | None, limit: int) -> None:
    frame = store.runs(run=run)
    r = frame.iloc[0]
    several = run in _several_ranks(store, frame)
    status = r["status"]
    if status == "interrupted":
        last = "no step written" if pd.isna(r["last_step"]) else f"last step {int(r['last_step'])}"
        whose = "its writer died with its scope open"
        if several:
            whose = "a rank's writer died with its scope open: see Ranks"
        status = f"interrupted ({last}, ended {_when(r['last_step_at'])}; {whose})"
    status = _status_with_unwritten(status, r["unwritten"])
    click.echo(
        f"Run {run!r} in {db}: {status}, world size {r['world_size']}, created {_when(r['created_at'])}, "
        f"finished {_when(r['finished_at'])}; torch {r['torch_version']}, gradstore {r['gradstore_version']}, "
        f"host {r['host']}"
    )
    if several:
        click.echo(f"Ranks: {r['ranks']}")
    else:  # one rank: its earlier processes (a resumed run), which the status above does not tell
        for h in store.run_ranks(run=run).itertuples():
            if h.history:
                click.echo(f"Rank {int(h.rank)}: {h.history}")
    click.echo(_counts_lines(_counts(store, run, rank=rank)))
    steps = store.steps(run=run, rank=rank)
    if steps.empty:
        click.echo("\nNo steps recorded yet.")
        return
    summaries = steps[steps["level"] == "summary"]
    if len(summaries):  # their passes, calls and gradient rows are not kept: the counts above leave them out
        click.echo(
            f"  ({len(summaries):,} of the {len(steps):,} step records are flight-recorder summaries, with "
            f"{int(summaries['passes'].fillna(0).sum()):,} backward passes: only the parameters' final norms are "
            "kept of them, so the passes, calls and tensors above are of the other steps)"
        )
    passes = store.passes(run=run, rank=rank)
    per_step = passes.groupby(["rank", "step"]).agg(calls=("calls", "sum"), backward_s=("duration", "sum"))
    table = steps.join(per_step, on=["rank", "step"])
    said = store.warnings(run=run, rank=rank)
    if not said.empty:
        table = table.join(said.groupby(["rank", "step"])["count"].sum().rename("warnings"), on=["rank", "step"])
    else:
        table = table.assign(warnings=0)
    out = pd.DataFrame(
        {
            "step": table["step"],
            "rank": table["rank"],
            "status": table["status"],
            "passes": table["passes"],
            # '-' for a step not written: its calls are not stored (0 would say no node ran)
            # and for a flight-recorder summary step, which keeps no call
            "calls": [
                "-" if st == UNWRITTEN or lv == "summary" else int(n)
                for st, lv, n in zip(table["status"], table["level"], table["calls"].fillna(0))
            ],
            "step_s": table["duration"].round(4),
            "backward_s": table["backward_s"].round(4),
            # '-' for a step not written: the warnings it counted were lost with it (0 would say none)
            "warnings": [
                "-" if st == UNWRITTEN else int(n) for st, n in zip(table["status"], table["warnings"].fillna(0))
            ],
            "error": table["error"].map(lambda e: "" if e is None or pd.isna(e) else " ".join(str(e).split())[:80]),
        }
    )
    skipped = steps["not_measured"].fillna(0).astype(int)
    if skipped.any():  # gradient rows that could not be measured: no statistics, no NaN/Inf check
        # '-' for a step not written: its rows are not stored, so how many were measured is not known
        shown = ["-" if st == UNWRITTEN else int(n) for st, n in zip(steps["status"], skipped)]
        out.insert(4, "not_measured", shown)
    counts = steps["status"].value_counts()
    click.echo("\nSteps (" + ", ".join(f"{n} {status}" for status, n in counts.items()) + "); times in seconds:")
    from .view.story import left_out, nonfinite_outputs, nonfinite_values  # pandas only, as the CLI

    for said_here in (nonfinite_values(store, run, rank=rank, steps=steps), nonfinite_outputs(store, run, rank=rank)):
        if said_here:  # a NaN loss with finite gradients, a -inf mask: no step status says them
            click.echo(f"  {said_here}.")
    left = left_out(store, run, rank=rank)
    if left:  # a status speaks of what was measured only
        click.echo(f"  {left.sentence()} A step's status speaks of the rest only.")
    lost = _unwritten_line(store, run, rank=rank)
    if lost:
        click.echo(f"  {lost}")
    # the steps that raised or held NaN / Inf first (up to the limit), then the first and last steps around them;
    # the first and last of each run of unwritten steps (the lines between them say which were left out)
    positions = list(range(len(out)))
    keep = [i for i in positions if out["status"].iloc[i] not in ("ok", "unmeasured", UNWRITTEN)][:limit]
    unwritten = out["status"].to_numpy() == UNWRITTEN
    edges = [
        i
        for i in positions
        if unwritten[i] and (i == 0 or not unwritten[i - 1] or i == len(out) - 1 or not unwritten[i + 1])
    ]
    keep += edges[: max(limit - len(keep), 0)]
    rest = [i for i in positions if i not in set(keep)]
    room = max(limit - len(keep), 0)
    keep += rest[: (room + 1) // 2] + (rest[-(room // 2) :] if room // 2 else [])
    click.echo(_table_keeping(out, keep, _steps_gap))
    if len(keep) < len(out):
        click.echo("  (every row: --limit N, or gradstore query DB steps -p run=RUN)")
    if skipped.any():
        partly = int(((skipped > 0) & (steps["status"] != "unmeasured")).sum())
        rows = store.not_measured(run=run, rank=rank)
        click.echo(
            f"{_skipped_what(rows)} not measured (stored as skipped: no statistics, not checked for NaN/Inf): "
            f"{int(skipped.sum()):,} rows in {int((skipped > 0).sum()):,} of "
            f"{int((steps['status'] != UNWRITTEN).sum()):,} step records written"
            + (f" ({partly:,} of them measured the rest: their status speaks of those only)" if partly else "")
            + f"; why: {_reasons(rows)}"
        )
    raised = _raised_text(passes)
    if raised:
        bad_steps = passes[passes["error"].notna() & passes["parent_pass"].isna()]
        click.echo(
            f"Backward passes that raised: {len(bad_steps):,}, in step(s) {_step_ranges(bad_steps['step'])} "
            f"(status error; the first: {_raised_text(bad_steps.head(1))})"
        )
    traced = int(steps["tracing_passes"].sum())
    if traced:
        click.echo(f"torch.compile's tracing ran {traced} backward pass(es) in these steps: not recorded")
    if not said.empty:
        distinct = said.drop_duplicates(["category", "message", "location"])
        click.echo(
            f"\nWarnings raised inside steps: {len(distinct)} distinct, {int(said['count'].sum())} shown in all "
            f"(gradstore query {db} warnings -p run={run}); first:"
        )
        first = distinct.iloc[0]
        click.echo(f"  step {first['step']}: {first['category']}: {_short(first['message'])} ({first['location']})")
    bad = _first_nonfinite_line(store, run)
    written = steps[steps["status"] != UNWRITTEN]
    detail = int((written if len(written) else steps)["step"].iloc[-1])
    if bad:
        click.echo("\n" + bad)
        nonfinite = steps[steps["status"] == "nonfinite"]
        detail = int(nonfinite["step"].iloc[0]) if len(nonfinite) else detail
    elif (steps["status"] == "error").any():  # the first step that raised, or whose backward pass raised
        detail = int(steps.loc[steps["status"] == "error", "step"].iloc[0])
    from .view.story import never_gradient, never_gradient_words  # pandas only, as the CLI

    dead = never_gradient_words(never_gradient(store, run, rank=rank))
    if dead:  # a step status speaks of errors and NaN/Inf: a dead expert or layer leaves every step ok
        click.echo(f"\nNo gradient, or an all-zero one, in any recorded step (param_status): {dead}")
    click.echo(f"\nOne step in detail: gradstore show {db} {run} --step {detail}")


def _nonfinite_mask(df: pd.DataFrame) -> pd.Series:
    """True for rows whose exact NaN / +Inf / -Inf counts are not all zero."""
    if df.empty:
        return pd.Series([], dtype=bool)
    return (df["nan"].fillna(0) + df["posinf"].fillna(0) + df["neginf"].fillna(0)).astype("int64") > 0


def _show_nonfinite(
    tensors: pd.DataFrame,
    grads: pd.DataFrame,
    limit: int,
    levels: set | None = None,
    skipped: pd.DataFrame | None = None,
    left=None,
    unstepped: set | None = None,
) -> None:
    """The step's non-finite parameter .grad and node gradients, before any list sorted by norm (a norm is over
    the finite elements: an all-NaN gradient has norm 0 and would sort last). `grads`: param_grads(which='all'),
    the .grad after the step's last backward pass and as the optimizer saw it: a parameter counts when either
    held NaN or Inf (a loop that sets .grad to None before the step ends leaves only the first). `left`
    (story.LeftOut): what the step reached and did not measure, said with any "none". `unstepped`: the ranks on
    which no optimizer stepped in the step (their final rows are the .grad the step ended with)."""
    bad_rows = grads[_nonfinite_mask(grads)]
    bad_params = bad_rows.drop_duplicates(["rank", "param"])
    grads = grads.drop_duplicates(["rank", "param"])
    node_rows = tensors[tensors["role"].isin(["grad_output", "grad_input"])]
    bad_nodes = node_rows[_nonfinite_mask(node_rows)]
    if bad_params.empty and bad_nodes.empty and tensors.empty:  # nothing to say "none" about
        summary = levels is not None and "summary" in levels
        click.echo(
            "\nNon-finite gradients: no gradient rows in this step"
            + (
                " (a flight-recorder summary step keeps each parameter's final norm and NaN/Inf count only: the "
                "step's status and the parameters' norms above say whether one held NaN/Inf)"
                if summary
                else ""
            )
        )
        return
    if bad_params.empty and bad_nodes.empty:
        measured = int(tensors["nan"].notna().sum()) if not tensors.empty else 0
        # why the rows that hold no count hold none: a skipped row's stored reason, a None slot, the shape level
        why = []
        if skipped is not None and not skipped.empty:
            why.append(f"{int(skipped['tensors'].sum()):,} skipped: {_reasons(skipped)}")
        nones = int((tensors["status"] == "none").sum()) if not tensors.empty else 0
        if nones:
            why.append(f"{nones:,} None slot{'s' if nones > 1 else ''} (no gradient)")
        if levels and "shape" in levels:
            why.append("stats='shape' measures no value")
        why_text = "; ".join(why) if why else "None slots, skipped, or shape level"
        if measured == 0 and len(tensors):  # nothing counted: no "none" about what was not measured
            click.echo(
                f"\nNon-finite gradients: not measured (none of the {len(tensors):,} gradient rows holds NaN/Inf "
                f"counts: {why_text})"
            )
            return
        click.echo(
            f"\nNon-finite gradients: none in the {measured:,} measured of {len(tensors):,} gradient rows (exact "
            "NaN/Inf counts"
            + ("" if measured == len(tensors) else f"; {len(tensors) - measured:,} not measured: {why_text}")
            + (
                "; the nodes' gradients were not measured: stats='params' reads the parameters' .grad only"
                if levels and "params" in levels
                else ""
            )
            + ")"
            + (f"; not measured, so not checked: {left.words()} (above)" if left else "")
        )
        return
    click.echo(
        f"\nNon-finite parameter .grad (after the step's last backward pass, or as the optimizer saw it): "
        f"{len(bad_params):,} of {len(grads):,}" + (":" if len(bad_params) else "")
    )
    if len(bad_params):
        # both moments where their counts differ (GradScaler.unscale_ or clipping between them), else one row
        shown = bad_rows.drop_duplicates(["rank", "param", "nan", "posinf", "neginf", "norm"]).copy()
        shown["moment"] = [
            ("at the step's end (no optimizer step seen)" if rk in (unstepped or ()) else "as the optimizer read it")
            if f == 1
            else "after the last pass"
            for f, rk in zip(shown["final"].fillna(0), shown["rank"])
        ]
        cols = ["rank", "param", "moment", "shape", "numel", "nan", "posinf", "neginf", "norm"]
        click.echo(
            _table_keeping(
                shown[cols],
                list(range(min(limit, len(shown)))),
                lambda h: ", ".join(h["param"].head(5)) + (", ..." if len(h) > 5 else ""),
            )
        )
    click.echo(
        f"\nNon-finite node gradients, in execution order: {len(bad_nodes):,} of {len(node_rows):,} rows"
        + (":" if len(bad_nodes) else "")
    )
    if len(bad_nodes):
        out = pd.DataFrame(
            {
                "rank": bad_nodes["rank"],
                "pass": bad_nodes["pass"],
                "seq": bad_nodes["seq"],
                "node": bad_nodes["key"],
                "slot": [_slot_label(r, s) for r, s in zip(bad_nodes["role"], bad_nodes["slot"])],
                "numel": bad_nodes["numel"],
                "nan": bad_nodes["nan"],
                "posinf": bad_nodes["posinf"],
                "neginf": bad_nodes["neginf"],
            }
        )
        click.echo(
            _table_keeping(out, list(range(min(limit, len(out)))), lambda h: f"seq {h['seq'].min()}-{h['seq'].max()}")
        )


def _show_step(store: Store, db: str, run: str, step: int, rank: int | None, limit: int) -> None:
    steps = store.steps(run=run, rank=rank, step=step)
    if steps.empty:
        known = store.steps(run=run, rank=rank)["step"]
        have = step_span(known) if len(known) else "no steps yet"
        raise click.ClickException(
            f"run {run!r} has no step {step}" + (f" on rank {rank}" if rank is not None else "") + f"; it has {have}"
        )
    click.echo(f"Step {step} of run {run!r} in {db}")
    click.echo(_counts_lines(_counts(store, run, step=step, rank=rank)))
    out = pd.DataFrame(
        {
            "rank": steps["rank"],
            "status": steps["status"],
            "passes": steps["passes"],
            "optimizer_steps": steps["optimizer_steps"].map(lambda n: "-" if pd.isna(n) else int(n)),
            "duration_s": steps["duration"].round(4),
            "error": steps["error"].map(lambda e: "" if e is None or pd.isna(e) else " ".join(str(e).split())[:100]),
        }
    )
    click.echo("\nStep:")
    click.echo(_table(out))
    from .view.story import NO_OPTIMIZER_STEP, no_optimizer_steps  # pandas only, as the CLI

    unstepped = no_optimizer_steps(steps[steps["status"] != UNWRITTEN])
    if unstepped:
        click.echo(
            f"\nNo optimizer step seen in this step (optimizer_steps 0, rank(s) "
            f"{', '.join(str(r) for r, _ in sorted(unstepped))}; one inside a torch.compile region is not recorded): "
            "its final parameter rows are the .grad the step ended with, or that zero_grad cleared, not known to be "
            "one an optimizer read"
        )
    if steps["optimizer_steps"].isna().any():
        click.echo("(optimizer_steps '-': recorded before schema revision 0014_optimizer_steps, not known)")
    lost = steps[steps["status"] == UNWRITTEN]
    if len(lost):
        ranks_lost = ", ".join(str(int(r)) for r in lost["rank"])
        click.echo(
            f"\nNot written on rank(s) {ranks_lost}: the writer could not write this step "
            f"({_unwritten_why(lost['error'].iloc[0])}); its passes, calls, gradients and step values are not in the "
            "record (the passes column counts the passes it ran), and nothing is claimed about them."
        )
        if len(lost) == len(steps):
            return
        steps = steps[steps["status"] != UNWRITTEN]
    passes = store.passes(run=run, rank=rank, step=step)
    raised = _raised_text(passes)
    if raised:
        click.echo(
            f"\nA backward pass raised: {raised} (the engine stopped the pass there: the nodes after it did not "
            "run, and the parameters they lead to got no gradient from it)"
        )
    skipped = store.not_measured(run=run, rank=rank, step=step)
    if not skipped.empty:
        click.echo(
            f"\n{_skipped_what(skipped)} not measured (stored as skipped: no statistics, not checked for NaN/Inf): "
            f"{int(skipped['tensors'].sum()):,} rows:"
        )
        click.echo(_table(skipped[["rank", "role", "tensors", "params", "reason"]]))
    held = steps[steps["level"] == "summary"]
    if len(held):  # a flight-recorder summary: no passes, calls or gradient rows were kept
        ranks_held = ", ".join(str(int(r)) for r in held["rank"])
        click.echo(
            f"\nA flight-recorder summary on rank(s) {ranks_held}: the step's gradients were not kept (its passes, "
            "calls and gradient rows are not in the record; the passes column counts the passes it ran), only each "
            f"parameter's final norm (gradstore query {db} param_norms -p run={run} -p step={step}):"
        )
        norms = store.param_norms(run=run, step=step, rank=rank)
        shown, more = _limited(norms[["rank", "param", "norm", "nonfinite"]], limit)
        click.echo(_table(shown))
        if more:
            click.echo(more)
    traced = int(steps["tracing_passes"].sum())
    if traced:
        click.echo(f"(and {traced} backward pass(es) torch.compile ran while tracing: not recorded)")

    said = store.warnings(run=run, rank=rank, step=step)
    if not said.empty:
        click.echo("\nWarnings raised inside the step (as Python showed them; count = times shown):")
        click.echo(
            _table(
                pd.DataFrame(
                    {
                        "rank": said["rank"],
                        "category": said["category"],
                        "count": said["count"],
                        "message": said["message"].map(_short),
                        "where": said["location"],
                    }
                )
            )
        )

    from .view.story import left_out, recorder_faults  # pandas only, as the CLI

    unhooked = left_out(store, run, step=step, rank=rank)
    if unhooked:  # the step's status and every "none" below speak of what was measured only
        click.echo(f"\n{unhooked.sentence()}")
    status = store.param_status(run=run, rank=rank, step=step)
    if not status.empty:
        odd = status[status["status"] != "ok"]
        ok = int((status["status"] == "ok").sum())
        per = " (a row per name and rank)" if status["rank"].nunique() > 1 else ""
        click.echo(
            f"\nParameters whose status is not ok: without a gradient, with an all-zero one, or with one not measured "
            f"({len(odd)} of {len(status)} names{per}; {ok} ok"
            + (f"; {len(unhooked.params):,} more not recorded, above" if unhooked.params else "")
            + "): status says why (README: param_status; ok says nothing of NaN/Inf, listed below)"
        )
        shown_odd, more = _limited(odd, limit)
        reasons = {}
        if not skipped.empty and (skipped["role"] == "param_grad").any():
            rows = store.tensors(run=run, rank=rank, step=step)
            rows = rows[(rows["role"] == "param_grad") & (rows["status"] == "skipped")]
            reasons = dict(zip(rows["param"], rows["reason"].fillna("no reason recorded")))
        where, fault = _raise_where(passes), recorder_faults(store, run, step, rank)
        last_bad = None
        if raised and not where[0] and where[1] is None and (shown_odd["status"] == "unreachable").any():
            last_bad = _last_call_nonfinite(store, run, step, rank, passes)  # the rare case only: reads the step
        shown_odd = shown_odd.assign(
            why=[_status_why(r, reasons, raised, where, fault, last_bad) for r in shown_odd.itertuples()]
        )
        in_fsdp = _fsdp_held(status, passes)
        click.echo(
            _table(
                shown_odd[["rank", "param", "status", "why", "module_ran", "reached", "calls", "has_grad"]],
                empty="  (none: every parameter got a gradient that is not all zero"
                + (f"; {in_fsdp:,} of them hold it inside FSDP2, not in .grad: below)" if in_fsdp else ")"),
            )
        )
        if more:
            click.echo(more)
        if in_fsdp:
            click.echo(
                f"  {in_fsdp:,} with status ok have .grad None (has_grad 0): {FSDP_HELD} (it is, in the step whose "
                "backward pass runs with the sync on)"
            )

    gains = store.module_gains(run=run, rank=rank, step=step)
    measured = gains.dropna(subset=["ratio"])
    local_calls = int(gains["no_ratio"].fillna("").str.startswith("not compared").sum()) if len(gains) else 0
    if measured.empty and local_calls:
        click.echo(
            f"\nModule gains: {local_calls:,} of {len(gains):,} module calls not compared: tensor parallelism, "
            "their gradients on a rank include DTensor shards, so one rank's out_norm / in_norm is not the call's "
            f"gain; the others have no ratio. Why, per call: gradstore query {db} module_gains -p run={run} "
            f"-p step={step} (no_ratio)"
        )
    if not measured.empty:
        spread = measured.assign(
            away=measured["ratio"].map(lambda r: abs(math.log(r)) if r > 0 else math.inf)
        ).sort_values("away", ascending=False)
        top = spread.head(limit)
        left = len(measured) - len(top)
        unmeasured = len(gains) - len(measured)
        notes = [f"{left:,} closer to 1 not shown: --limit N"] if left else []
        local = local_calls
        if unmeasured - local:
            # why, from module_gains' no_ratio (NaN/Inf in a boundary tensor, a side not measured, ...), most first
            why = gains["no_ratio"].dropna()
            why = why[~why.str.startswith("not compared")].value_counts()
            reasons = "; ".join(f"{int(n):,} {reason}" for reason, n in why.items())
            notes.append(f"{unmeasured - local:,} with no ratio: {reasons}")
        if local:
            notes.append(
                f"{local:,} not compared: tensor parallelism, the call's gradients on a rank include DTensor shards, "
                "so one rank's out_norm / in_norm is not the call's gain (module_gains' no_ratio)"
            )
        click.echo(
            f"\nModule gains, the {len(top):,} furthest from 1 of the {len(measured):,} module calls with a ratio "
            f"({len(gains):,} calls in all)"
            + (f" ({'; '.join(notes)})" if notes else "")
            + ":\n  ratio = out_norm / in_norm of the gradient crossing the call (its own parameters' gradients not "
            "included); ordinal = the module's how-manieth call in the step;\n"
            f"  every row: gradstore query {db} module_gains -p run={run} -p step={step}"
        )
        click.echo(
            _table(
                pd.DataFrame(
                    {
                        "rank": top["rank"],
                        "module": top["module"].map(_module_label),
                        "ordinal": top["ordinal"],
                        "in_norm": top["in_norm"],
                        "out_norm": top["out_norm"],
                        "ratio": top["ratio"],
                    }
                )
            )
        )
    never = store.never_ran(run=run, rank=rank, step=step)
    births = store.node_births(run=run, rank=rank, step=step)
    recomputed = store.recomputations(run=run, rank=rank, step=step)
    if not births.empty:
        # born_step NULL: an earlier step, not known which (unrecorded, or an AccumulateGrad an earlier node uses)
        earlier = births[births["born_step"].isna() | (births["born_step"] != step)]
        click.echo(
            f"\nNodes reached in this step but born elsewhere: {len(earlier)} in an earlier step, "
            f"{len(births) - len(earlier)} in a backward pass (gradstore query {db} node_births -p run={run} "
            f"-p step={step}):"
        )
        shown_b, more = _limited(
            births[["rank", "pass", "key", "module", "born_step", "born_pass", "recomputed", "ran"]], limit
        )
        click.echo(_table(shown_b))
        if more:
            click.echo(more)
    if not recomputed.empty:
        click.echo("\nModule forwards re-run inside a backward pass (activation checkpointing):")
        click.echo(
            _table(
                recomputed[["rank", "module", "ordinal", "during_pass", "running", "original_ordinal", "nodes", "ran"]]
            )
        )
    if not never.empty:
        click.echo(
            f"\nNodes created in the step that never ran, found as module outputs or by a pass's walk ({len(never)}; "
            "nodes inside a module that no pass reached are not listed: module_gains' nodes - ran counts them):"
        )
        shown_n, more = _limited(never[["rank", "key", "module", "why"]], limit)
        click.echo(_table(shown_n))
        if more:
            click.echo(more)

    click.echo("\nBackward passes (duration in seconds):")
    shown_cols = ["rank", "pass", "kind", "parent_pass", "create_graph", "retain_graph", "roots", "nodes", "calls"]
    shown_cols.append("duration")
    if raised or passes["error"].notna().any():
        shown_cols += ["raised_at", "error"]
    click.echo(_table(passes[shown_cols]))

    tensors = store.tensors(run=run, rank=rank, step=step)
    grads = store.param_grads(run=run, rank=rank, step=step)
    levels = set(store.steps(run=run, rank=rank, step=step)["level"])
    _show_nonfinite(
        tensors,
        store.param_grads(run=run, rank=rank, step=step, which="all"),
        limit,
        levels,
        skipped,
        left=unhooked,
        unstepped={r for r, _ in unstepped},
    )

    calls = store.calls(run=run, rank=rank, step=step)
    slow = calls.sort_values("duration", ascending=False).head(limit)
    left = f"; the other {len(calls) - len(slow):,} were faster" if len(calls) > len(slow) else ""
    click.echo(
        f"\nSlowest calls: the {len(slow):,} slowest of {len(calls):,}{left} (seq = execution order in the step):"
    )
    click.echo(
        _table(
            pd.DataFrame(
                {
                    "rank": slow["rank"],
                    "pass": slow["pass"],
                    "seq": slow["seq"],
                    "node": slow["key"],
                    "module": slow["module"].map(_module_label),
                    "duration_ms": (slow["duration"] * 1e3).round(3),
                }
            )
        )
    )

    click.echo(f"\nGradient statistics rows ({len(tensors):,}) by role and status:")
    if not tensors.empty:
        # NaN (shown '-') where no row of the group was counted: stats='shape' measures no value
        nonfinite = tensors[["nan", "posinf", "neginf"]].astype("float64").sum(axis=1, min_count=1)
        by = (
            tensors.assign(nonfinite=nonfinite)
            .groupby(["role", "status"])
            .agg(
                rows=("slot", "size"),
                elements=("numel", "sum"),
                nonfinite=("nonfinite", lambda x: x.sum(min_count=1)),
                max_norm=("norm", "max"),
            )
            .reset_index()
        )
        by["elements"] = by["elements"].fillna(0).astype("int64")
        by["nonfinite"] = [None if pd.isna(v) else int(v) for v in by["nonfinite"]]
        click.echo(_table(by))
    else:
        click.echo("  (none)")

    bad = _nonfinite_mask(grads)
    # no backward pass of the step gave it a gradient (frozen, not used, unreachable, stale): its .grad, left from
    # before (an earlier gradient, the zeros zero_grad(set_to_none=False) writes), is no gradient of this step
    nograd = grads["no_gradient"].notna() & ~bad
    # FSDP2 with its gradient sync off: a gradient the step gave, held inside FSDP2 (.grad None: not measured)
    in_fsdp = grads["no_gradient"].fillna("").str.startswith(FSDP_HELD.split(" (")[0])
    nograd &= ~in_fsdp
    finite = grads[~bad & ~nograd & (grads["status"] == "ok") & grads["norm"].notna()]
    top = finite.sort_values("norm", ascending=False).head(limit)
    others = []
    if len(finite) > len(top):
        others.append(f"{len(finite) - len(top):,} smaller not shown")
    if bad.any():
        others.append(f"{int(bad.sum()):,} non-finite listed above")
    if nograd.any():
        kinds = ", ".join(sorted(set(grads.loc[nograd, "param_status"].dropna())))
        others.append(
            f"{int(nograd.sum()):,} that no backward pass of the step gave a gradient ({kinds}, above; their .grad "
            "is left from before: param_grads' no_gradient)"
        )
    if in_fsdp.any():
        others.append(f"{int(in_fsdp.sum()):,} with .grad None: {FSDP_HELD}")
    unmeasured = len(grads) - len(finite) - int(bad.sum()) - int(nograd.sum()) - int(in_fsdp.sum())
    if unmeasured:
        others.append(f"{unmeasured:,} with no .grad or not measured (status none / skipped, or stats='shape')")
    pieces = grads["placements"].map(shards.is_piece) if "placements" in grads else pd.Series(False, grads.index)
    # every row here was measured (status ok): param_status says whether a gradient came (zero: an all-zero one)
    columns = ["rank", "param", "param_status", "shape", "norm", "min", "max", "nan", "posinf", "neginf"]
    left_for = "as the step left them for the optimizer"
    if unstepped:  # no optimizer read them on some rank
        every = {int(r) for r in steps["rank"]} <= {r for r, _ in unstepped}
        left_for = (
            NO_OPTIMIZER_STEP
            if every
            else "as the step left them for the optimizer; on rank(s) "
            + (", ".join(str(r) for r, _ in sorted(unstepped)) + f" {NO_OPTIMIZER_STEP}")
        )
    heading = (
        f"Largest finite parameter .grad norms ({left_for}; see param_grads; "
        "param_status zero: every gradient it received was all zeros)"
    )
    if pieces.any():
        # a DTensor .grad: each row is this rank's shard; the parameter's norm is combined from every rank's rows
        whole = store.global_grads(run=run, step=step, which="final")
        whole = whole.assign(
            param_norm=whole["norm"].where(whole["status"] == "ok"),
            param_rows=whole["final"].map(lambda f: "final" if f == 1 else "pass"),
        )
        top = finite.merge(whole[["param", "param_norm", "param_rows"]], on="param", how="left")
        top = top.assign(
            norm_of=[
                shards.piece_label(pl, gs) or "the whole .grad"
                for pl, gs in zip(top["placements"], top["global_shape"])
            ],
            _by=top["param_norm"].fillna(top["norm"]),
        )
        top = top.sort_values(["_by", "norm"], ascending=False).head(limit)
        columns = [*columns[:5], "norm_of", "param_norm", *columns[5:]]
        heading = (
            f"Largest finite parameter .grad norms ({left_for}; see param_grads), by the "
            "parameter's norm. A DTensor .grad's row is this rank's shard: its norm (norm_of says which piece) is "
            "not the parameter's; param_norm is the whole parameter's, what p.grad.full_tensor().norm() returns, "
            "combined exactly from every rank's shards (sqrt of the sum of the shards' squared norms, a replicated "
            f"copy once: gradstore query {db} global_grads -p run={run} -p step={step} -p which=final; '-' where "
            "not every rank's row is in this database or the copies differ)"
        )
    click.echo(
        f"\n{heading}: the {len(top):,} largest of {len(grads):,}" + (f"; {', '.join(others)}" if others else "") + ":"
    )
    click.echo(_table(top[columns]))

    bad = _first_nonfinite_line(store, run, step=step)
    if bad:
        click.echo("\n" + bad)
    click.echo(f"\nEvery row: gradstore query {db} tensors -p run={run} -p step={step}   (or calls, passes)")


@main.command(short_help="Summarise a run, or one step of it (--step).")
@click.argument("db")
@click.argument("run")
@click.option(
    "--step",
    type=int,
    default=None,
    help="Show this step (its passes, slowest calls and gradients) instead of the whole run.",
)
@click.option("--rank", type=int, default=None, help="Only this rank (default: every rank).")
@click.option("--limit", default=20, show_default=True, type=click.IntRange(min=1), help="Most rows printed per table.")
def show(db, run, step, rank, limit):
    """Summarise run RUN of database DB: its steps, or with --step one step's passes, slowest calls and gradients."""
    with _store(db) as store:
        if step is None:
            _show_run(store, db, run, rank, limit)
        else:
            store.query("runs", run=run)  # UnknownRun, naming the runs there are
            _show_step(store, db, run, step, rank, limit)


def _parse_params(pairs: tuple[str, ...]) -> dict[str, str]:
    params: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise click.ClickException(f"bad parameter {pair!r}: write -p NAME=VALUE (e.g. -p run=demo -p step=0)")
        if key in params:
            raise click.ClickException(f"parameter {key!r} given twice")
        params[key] = value
    return params


def _unwritten_note(store: Store, bound: dict) -> str | None:
    """Where `-p step=N` names a step the writer could not write (status unwritten, on every rank asked for), why:
    its rows are not in the database, so an empty table says nothing about it. None otherwise."""
    step, rank = bound.get("step"), bound.get("rank")
    if not step or not str(step).strip().lstrip("-").isdigit():
        return None
    rank = int(rank) if rank and str(rank).strip().isdigit() else None
    rows = store.steps(run=bound.get("run") or None, step=int(step), rank=rank)
    if rows.empty or (rows["status"] != UNWRITTEN).any():
        return None
    why = "; ".join(
        f"run {r.run!r} rank {r.rank}: {unwritten_why(r.error) or 'no reason stored'}" for r in rows.itertuples()
    )
    return f"step {int(step)} was not written ({why}); only its steps row is in the database"


def _list_queries() -> None:
    for q in named_queries.available().values():
        click.echo(f"{q.name:<20} {q.title}")
        if q.params:
            click.echo(f"{'':<16}-p " + "  -p ".join(f"{p}=..." for p in q.params))


@main.command(short_help="Run a named query; print a table or CSV.")
@click.argument("db", required=False)
@click.argument("name", required=False)
@click.option(
    "-p",
    "--param",
    "params",
    multiple=True,
    metavar="NAME=VALUE",
    help="A query parameter, e.g. -p run=demo -p step=0; repeat for several. Left out means all.",
)
@click.option("--csv", "as_csv", is_flag=True, help="Print CSV (header, no index) instead of a table.")
@click.option("--list", "list_only", is_flag=True, help="List the named queries and exit (DB and NAME not needed).")
def query(db, name, params, as_csv, list_only):
    """Run the named query NAME (queries/NAME.sql) on database DB and print its rows.

    The same SQL runs unchanged in sqlite3, where parameters left unbound are NULL (= all).
    See `gradstore queries` for the names, parameters and what each returns.
    """
    if list_only:
        _list_queries()
        return
    if db is None or name is None:
        raise click.UsageError("query needs DB and NAME (or --list)")
    bound = _parse_params(params)
    named_queries.get(name)  # UnknownQuery before the database is opened
    with _store(db) as store:
        df = store.query(name, **bound)
        lost = _unwritten_note(store, bound) if df.empty and not as_csv else None
    if as_csv:
        click.echo(df.to_csv(index=False), nl=False)
    elif df.empty:
        click.echo(f"(no rows: {lost})" if lost else "(no rows)")
    else:
        click.echo(df.to_string(index=False))


@main.command("queries", short_help="List the named queries and their parameters.")
@click.option("-v", "--verbose", is_flag=True, help="Also print each query's description and parameter notes.")
def list_queries(verbose):
    """List the named queries that `gradstore query` and Store.query run, with their titles and parameters."""
    if not verbose:
        _list_queries()
        return
    for q in named_queries.available().values():
        click.echo(f"{q.name}: {q.title}\n  {q.description}")
        for p, note in q.params.items():
            click.echo(f"    -p {p}=...  {note}")
        click.echo(f"  file: {q.path}\n")


@main.command(short_help="Explain one recorded node: its edges, calls and gradients at a step.")
@click.argument("db")
@click.argument("run")
@click.argument("key", required=False)
@click.option("--step", type=int, default=None, help="The step to show (default: the last step the node ran in).")
@click.option("--rank", type=int, default=None, help="The rank to show (default: the lowest rank with a call).")
@click.option(
    "--sequence-nr",
    "sequence_nr",
    type=int,
    default=None,
    help="Find the node by its autograd sequence number (grad_fn._sequence_nr(), torch.profiler's 'Sequence number') "
    "in place of KEY: the node whose call at --step (and --rank) has it.",
)
def explain(db, run, key, step, rank, sequence_nr):
    """Explain node KEY of run RUN in database DB: its name, kind and module, where its grad_outputs come from
    and its grad_inputs go (the edges that held in that step), and its calls' grad_output / grad_input
    statistics at a step.

    KEY is a node key as `gradstore query DB nodes -p run=RUN` lists it, e.g. 'fc/AddmmBackward0#0' or
    'param:fc.weight' (any name of a tied parameter: the output says which names it is tied to). Or leave KEY out
    and give --sequence-nr N --step S: the node numbered N in step S (a process numbers its nodes from its start, so
    name the step; each rank counts on its own: --rank). A --step the run did not record is an error that lists
    the steps it recorded.
    """
    from .inspect.explain import explain_recorded

    if key is None and sequence_nr is None:
        raise click.UsageError("explain needs KEY, or --sequence-nr N (with --step S)")
    with _store(db) as store:
        click.echo(str(explain_recorded(store, run, key, step=step, rank=rank, sequence_nr=sequence_nr)))


@main.group(cls=_Group, short_help="Manage a database's schema revision (upgrade).")
def db():
    """Manage a database's schema (Alembic revisions shipped with gradstore)."""


@db.command(short_help="Upgrade (or create) a database to the newest schema revision.")
@click.argument("db_path", metavar="DB")
@click.option(
    "--create", is_flag=True, help="Create DB (an empty database at the newest revision) when no file is there."
)
def upgrade(db_path, create):
    """Upgrade database DB to the newest schema revision. A SQLite path with no file is refused (a typo would
    otherwise leave a new, empty database behind) unless --create is given."""
    from .store.database import check_db, is_url
    from .store.database import upgrade as upgrade_db

    check_db(db_path, "gradstore db upgrade DB")
    if not is_url(db_path) and not os.path.lexists(db_path) and not create:
        raise click.ClickException(
            f"no database at {db_path}: nothing to upgrade (check the path); to create an empty database there, "
            f"run `gradstore db upgrade --create {db_path}` (gradstore.record creates one by itself)"
        )

    with _progress(f"upgrading {db_path}") as update:

        def progress(applied: int, total: int, revision: str) -> None:
            verb = "applying" if applied == 0 else "applied"
            update(completed=applied, total=total, description=f"{db_path}: {verb} schema revision {revision}")

        before, after = upgrade_db(db_path, progress=progress)
    if before == after:
        click.echo(f"{db_path}: already at schema revision {after}")
    else:
        click.echo(f"{db_path}: schema revision {before or '(none, new database)'} -> {after}")


# ---- comparing runs, steps and ranks; merging ----------------------------------------------------------------

_STATS = ("norm", "min", "max", "mean", "std")
_COUNTS = ("nan", "posinf", "neginf", "zeros")


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and pd.isna(v)) or v is pd.NA


def _num_pair(a, b) -> tuple[str, str]:
    """Two floats with the fewest significant digits (5 or more) that tell them apart."""
    if _missing(a) or _missing(b):
        return ("NULL" if _missing(a) else f"{a:.5g}"), ("NULL" if _missing(b) else f"{b:.5g}")
    for digits in range(5, 18):
        sa, sb = f"{a:.{digits}g}", f"{b:.{digits}g}"
        if sa != sb:
            return sa, sb
    return repr(float(a)), repr(float(b))


def _slot_label(role: str, slot) -> str:
    """'grad_outputs[0]' / 'grad_inputs[1]' (PyTorch's names for a node's hook arguments) / '.grad'; with
    record(forward=True), 'outputs[0]' (a module call's output) / 'roots[0] (the loss)' (a pass's root)."""
    if role == "param_grad":
        return ".grad"
    if role == "activation":
        return f"outputs[{int(slot)}]"
    if role == "loss":
        return f"roots[{int(slot)}] (the loss)"
    return f"{role}s[{int(slot)}]"


def _plain(v, field: str) -> str:
    if _missing(v):
        return "NULL"
    if field == "shape":
        return f"[{v}]"
    if field in _COUNTS or field == "checksum":
        return str(int(v))
    return str(v)


def _difference_words(row, label_a: str, label_b: str) -> str:
    """What differs in one row of diff / first_divergence / rank_divergence, in words: the first differing
    field with both values, each named by its side ('norm 1.2345 in rank 0 vs 1.2346 in rank 1 (rel 8.1e-05)'),
    then the names of the others."""
    fields = [f for f in str(row["differs"]).split(",") if f]
    if "missing" in fields:
        return f"only in {label_a if row['side'] == 'a' else label_b}"
    if not fields:
        return "no difference"
    if fields[0] == "checksum" and len(fields) > 1:  # show a statistic's values; the checksum confirms it
        fields = fields[1:] + fields[:1]
    if fields[0] == "values" and len(fields) > 1:  # a statistic's values first; the elements confirm them
        fields = fields[1:] + fields[:1]
    first, rest = fields[0], fields[1:]
    if first == "values":  # record(values=...): the stored elements differ while the statistics agree
        cos = row.get("values_cosine")
        return f"elements differ: max |a - b| {row['values_max_abs']:.4g} (rel {row['values_rel']:.2g}" + (
            ")" if _missing(cos) else f", cosine {cos:.6g})"
        )
    a, b = row[f"{first}_a"], row[f"{first}_b"]
    if first in _STATS:
        sa, sb = _num_pair(a, b)
        rel = row[f"{first}_rel"]
        text = f"{first} {sa} in {label_a} vs {sb} in {label_b}" + ("" if _missing(rel) else f" (rel {rel:.2g})")
    else:
        text = f"{first} {_plain(a, first)} in {label_a} vs {_plain(b, first)} in {label_b}"
    if first == "checksum" and not rest:
        text += " (every statistic equal)"
    if rest:
        text += f"; {', '.join(rest)} differ{'s' if len(rest) == 1 else ''} too"
    return text


def _side_labels(run_a, run_b, step_a, step_b, rank_a, rank_b) -> tuple[str, str, set[str]]:
    """How to name side a and side b in a sentence ('rank 0' / 'rank 1'), and which of run/step/rank the
    labels carry."""
    run_b = run_b if run_b is not None else run_a
    step_a, step_b = (step_a if step_a is not None else step_b), (step_b if step_b is not None else step_a)
    rank_a, rank_b = (rank_a if rank_a is not None else rank_b), (rank_b if rank_b is not None else rank_a)
    a, b, carried = [], [], set()
    if run_a != run_b:
        a.append(f"run {run_a!r}"), b.append(f"run {run_b!r}"), carried.add("run")
    if step_a != step_b:
        a.append(f"step {step_a}"), b.append(f"step {step_b}"), carried.add("step")
    if rank_a != rank_b:
        a.append(f"rank {rank_a}"), b.append(f"rank {rank_b}"), carried.add("rank")
    if not a:
        a = b = [f"run {run_a!r}"]
    return " ".join(a), " ".join(b), carried


def _where(row, carried: set[str], several_ranks: bool, unstepped=frozenset()) -> str:
    """'step 3, pass 0' (and the rank where runs have several ranks) of a first_divergence row. `unstepped`: (run,
    rank, step) of the steps in which no optimizer stepped (steps.optimizer_steps 0): a final row there is the .grad
    the step ended with, not one an optimizer read."""
    side = "b" if row["side"] == "b" else "a"
    parts = []
    if "step" not in carried:
        parts.append(f"step {int(row[f'step_{side}'])}")
    if "rank" not in carried and several_ranks:
        parts.append(f"rank {int(row[f'rank_{side}'])}")
    p = row[f"pass_{side}"]
    if row["role"] == "activation":  # record(forward=True): a module call of the forward, in no pass
        parts.append(f"module {_module_label(row['module'])} ({row['name']})")
    elif row["role"] == "loss":  # a pass's root, measured as the pass started
        parts.append(f"measured as pass {int(p)} started" if not _missing(p) else "measured as its pass started")
    elif not _missing(p):
        parts.append(f"pass {int(p)}")
    elif row["role"] == "param_grad":  # the step's final row: .grad as the optimizer read it
        read = (row.get(f"run_{side}"), row.get(f"rank_{side}"), row.get(f"step_{side}"))
        if not any(_missing(v) for v in read[1:]) and (read[0], int(read[1]), int(read[2])) in unstepped:
            parts.append("the step's final .grad, as the step ended (no optimizer step in it)")
        else:
            parts.append("the step's final .grad, as the optimizer read it")
    return ", ".join(parts)


@main.command(short_help="Where two runs (or two steps or two ranks of one run) first part.")
@click.argument("db")
@click.argument("run_a")
@click.argument("run_b", required=False)
@click.option("--step-a", type=int, default=None, help="Side a's step (default: --step-b; neither: every step).")
@click.option("--step-b", type=int, default=None, help="Side b's step (default: --step-a).")
@click.option("--rank-a", type=int, default=None, help="Side a's rank (default: --rank-b; neither: every rank).")
@click.option("--rank-b", type=int, default=None, help="Side b's rank (default: --rank-a).")
@click.option(
    "--rtol",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Relative tolerance: a statistic differs when |a - b| > atol + rtol * max(|a|, |b|).",
)
@click.option(
    "--atol",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Absolute tolerance (0 and 0: any difference, bitwise).",
)
def diff(db, run_a, run_b, step_a, step_b, rank_a, rank_b, rtol, atol):
    """Compare run RUN_A with run RUN_B of database DB node by node (key, role, slot and occurrence) and print,
    in execution order, the first node whose gradients differ. Where both sides recorded the forward
    (record(forward=True)), the module outputs and losses are compared too, and a difference there comes first
    (it is earlier in time); where only one side did, the forward is said to be not compared.

    RUN_B left out is RUN_A. Two steps of one run: `gradstore diff DB RUN --step-a 3 --step-b 4`; two ranks:
    `gradstore diff DB RUN --rank-a 0 --rank-b 1 --step-a 3`. Every aligned row: `gradstore query DB diff
    -p run_a=... -p run_b=...`, or Store.diff in Python.
    """
    run_b = run_a if run_b is None else run_b
    sides = dict(run_a=run_a, run_b=run_b, step_a=step_a, step_b=step_b, rank_a=rank_a, rank_b=rank_b)
    label_a, label_b, carried = _side_labels(**sides)
    with _store(db) as store:
        table = store.diff(**sides)
        try:
            first = store.first_divergence(**sides, rtol=rtol, atol=atol)
        except ValueError as exc:  # a tolerance of inf or nan
            raise click.BadParameter(str(exc)) from None
        # steps a side could not write (status unwritten) before any divergence found: said apart, never a divergence
        unwritten = first[first["key"].isna() & (first["differs"] == "not compared")]
        first = first.drop(index=unwritten.index)
        steps_ab = pd.concat([store.steps(run=run_a), store.steps(run=run_b)], ignore_index=True)
        ranks = set(steps_ab["rank"])
        # steps in which no optimizer stepped: their final rows are not what an optimizer read
        idle = steps_ab[steps_ab["optimizer_steps"].eq(0)]
        unstepped = {(r, int(k), int(x)) for r, k, x in zip(idle["run"], idle["rank"], idle["step"])}
        own_note = ""
        if rank_a is not None and rank_b is not None and rank_a != rank_b:
            own_note = _own_accumulation_words(store, run_a, step_a if step_a is not None else step_b, rank_a, rank_b)
        held_a, held_b, summaries = _summary_steps(store, **sides, label_a=label_a, label_b=label_b)
        store_levels = (
            (_side_levels(store, run_a, step_a, step_b, rank_a, rank_b), label_a),
            (
                _side_levels(store, run_b, step_b, step_a, rank_b, rank_a),
                label_b,
            ),
        )
    if len(first) and (held_a or held_b):  # a row only on one side, whose other side kept a summary: not a divergence
        eff_a, eff_b = (step_a if step_a is not None else step_b), (step_b if step_b is not None else step_a)

        def unseen(r) -> bool:
            if r["side"] == "b":
                return int(eff_a if eff_a is not None else r["step_b"]) in held_a
            if r["side"] == "a":
                return int(eff_b if eff_b is not None else r["step_a"]) in held_b
            return False

        first = first[~first.apply(unseen, axis=1)]
    unhealthy_piece = _nonfinite_piece_words(table, carried, len(ranks) > 1, label_a, label_b)
    forward = table["phase"] == "forward"  # record(forward=True)'s rows: module outputs and losses
    fwd, table = table[forward], table[~forward]
    fwd_line, fwd_compared, fwd_missing = _forward_words(fwd, label_a, label_b)
    both = table[table["side"] == "both"]
    unmeasured = table["differs"] == "not compared"
    n_diff = int(((both["differs"] != "") & (both["differs"] != "not compared")).sum())
    # rows whose layouts say the two sides hold different pieces (shards, Partial terms) of one DTensor, or each
    # rank's own local piece of one (a plain tensor between DTensor ops)
    pieces = unmeasured & table["reason"].fillna("").str.startswith(DTENSOR_PIECES)
    local_pieces = bool(table["reason"].fillna("").str.startswith(DTENSOR_PIECES[-1]).any())
    n_pieces = int(pieces.sum())
    n_unmeasured = int(unmeasured.sum()) - n_pieces
    missing = table["differs"] == "missing"
    only_a, only_b = int((missing & (table["side"] == "a")).sum()), int((missing & (table["side"] == "b")).sum())
    # a gradient whose values were measured on both sides (a None slot matched on both is no gradient compared)
    valued = both[(both["differs"] != "not compared") & (both["status_a"] == "ok") & (both["status_b"] == "ok")]
    click.echo(
        f"Compared {label_a} with {label_b}: {len(table):,} gradients aligned by node key, role, slot and "
        f"occurrence; {n_diff:,} differ bitwise, {only_a:,} only in {label_a}, {only_b:,} only in {label_b}, "
        f"{n_unmeasured:,} not compared (not measured on a side: skipped, recorded without statistics, or a step, "
        "level or filter of one side that records no such row)"
        + (
            f"; {n_pieces:,} not compared because the sides hold different shards or Partial terms of one DTensor"
            + (
                ", or each rank's own local piece of one (a plain tensor between DTensor ops under tensor parallelism)"
                if local_pieces
                else ""
            )
            + " (their values differ by design)"
            if n_pieces
            else ""
        )
        + "."
    )
    if fwd_line:
        click.echo(fwd_line)
    levels = _levels(store_levels)
    if levels:
        click.echo(levels)
    tolerance = f"rtol={rtol:g}, atol={atol:g}" if rtol or atol else ""
    unmeasured = unmeasured & ~pieces
    lost_line = ""
    if len(unwritten):
        lost_a = sorted({int(r.step_a) for r in unwritten.itertuples() if r.side in ("a", "both")})
        lost_b = sorted({int(r.step_b) for r in unwritten.itertuples() if r.side in ("b", "both")})
        where = [f"step(s) {_step_ranges(st)} of {label}" for st, label in ((lost_a, label_a), (lost_b, label_b)) if st]
        lost_line = (
            f"not compared: {' and '.join(where)}, which the writer could not write (status unwritten; "
            "`gradstore show` says why): a divergence there would not be seen"
            + (", so an earlier one may hide there" if len(first) else "")
        )
    if first.empty and valued.empty and not fwd_compared:  # nothing measured on both sides: no verdict at all
        click.echo(
            f"nothing compared: no gradient was measured on both {label_a} and {label_b}, so no agreement or "
            "divergence can be told" + (f"; {summaries}" if summaries else "")
        )
        if n_unmeasured:
            click.echo(f"  e.g. {_not_compared_example(table[unmeasured])}")
        if lost_line:
            click.echo(f"  {lost_line}")
        return
    if first.empty:
        scope = "every compared gradient" if n_unmeasured or n_pieces or summaries else "every gradient"
        elements = bool(table["values_a"].notna().any() and table["values_b"].notna().any())
        notes = [f"{n_unmeasured:,} not compared"] if n_unmeasured else []
        if n_pieces:
            notes.append(
                f"{n_pieces:,} different shards or Partial terms of one DTensor"
                + (" or ranks' own local pieces" if local_pieces else "")
                + ", not compared"
            )
        if not elements:
            notes.append("the elements were not compared: record(values=...) stores small gradients' elements")
        if fwd_missing:
            notes.append(fwd_missing)
        if fwd_compared:
            scope += " and every compared forward row (module outputs and losses)"
        click.echo(
            f"no divergence: {label_b} agrees with {label_a} on the statistics"
            + (" and stored elements" if elements else "")
            + f" of {scope}, "
            + (f"within {tolerance}" if tolerance else "bitwise")
            + (f" ({'; '.join(notes)})" if notes else "")
        )
        if n_unmeasured:
            click.echo(f"  e.g. {_not_compared_example(table[unmeasured])}")
        if unhealthy_piece:
            click.echo(unhealthy_piece)
        if summaries:
            click.echo(f"  {summaries}")
        if lost_line:
            click.echo(f"  {lost_line}")
        return
    tolerance = f" beyond {tolerance}" if tolerance else ""
    several = len(ranks) > 1
    for _, rows in first.groupby([first["rank_a"].fillna(-1), first["rank_b"].fillna(-1)], sort=True):
        r = rows.iloc[0]
        click.echo(
            f"{label_b} differs from {label_a}{tolerance} first "
            + ("in the forward, " if r["phase"] == "forward" else "")
            + f"at {r['key']} "
            f"{_slot_label(r['role'], r['slot'])} ({_where(r, carried, several, unstepped)}): "
            f"{_difference_words(r, label_a, label_b)}"
        )
        for _, other in rows.iloc[1:].iterrows():
            click.echo(
                f"  also {_slot_label(other['role'], other['slot'])}: {_difference_words(other, label_a, label_b)}"
            )
    if own_note:
        click.echo(own_note)
    if unhealthy_piece:
        click.echo(unhealthy_piece)
    if summaries:  # an earlier step kept only its summary: the sides may have parted there, unseen
        click.echo(summaries)
    if lost_line:  # an earlier step was not written on a side: the sides may have parted there, unseen
        click.echo(lost_line)


def _own_accumulation_words(store, run: str, step: int | None, rank_a: int, rank_b: int) -> str:
    """For `diff` across two ranks of one run: a line naming the compared steps whose parameter .grads were each
    rank's own accumulation (rank_divergence's accumulation 1: no optimizer step on either rank, DDP no_sync), where
    their param_grad rows differ by design; '' where none."""
    if run is None:
        return ""
    rows = store.rank_divergence(run, step)
    rows = rows[_accumulation(rows) & rows["rank_a"].isin([rank_a, rank_b]) & rows["rank_b"].isin([rank_a, rank_b])]
    if rows.empty:
        return ""
    steps = sorted({int(v) for v in rows["step"]})
    return (
        f"  note: at step{'s' if len(steps) > 1 else ''} {_step_ranges(steps)} each rank's parameter .grad was its own "
        "accumulation (DDP no_sync / no optimizer step on either rank): their param_grad rows differ by design, not "
        f"a divergence ({rows.iloc[0]['reason']})"
    )


def _nonfinite_piece_words(table: pd.DataFrame, carried: set[str], several_ranks: bool, label_a: str, label_b: str):
    """For `diff`: a line naming the first row (in execution order) not compared because the sides hold different
    pieces of one DTensor whose NaN / Inf counts differ, '' where none does. Their values differ by design; where one
    side's piece holds a NaN or Inf that the other's does not, something went wrong on one rank (its input, its
    shard of the weights), which first_nonfinite per rank follows."""
    if table.empty:
        return ""
    pieces = (table["differs"] == "not compared") & table["reason"].fillna("").str.startswith(DTENSOR_PIECES)
    rows = table[pieces]
    if rows.empty:
        return ""
    counts = [
        (pd.to_numeric(rows[f"{f}_a"], errors="coerce"), pd.to_numeric(rows[f"{f}_b"], errors="coerce"))
        for f in ("nan", "posinf", "neginf")
    ]
    apart = pd.Series(False, index=rows.index)
    for a, b in counts:
        apart |= a.notna() & b.notna() & (a != b)
    if not apart.any():
        return ""
    r = rows[apart].iloc[0]
    field = next(f for f in ("nan", "posinf", "neginf") if int(r[f"{f}_a"]) != int(r[f"{f}_b"]))
    return (
        f"  not compared, but not healthy: the pieces' non-finite counts differ, first at {r['key']} "
        f"{_slot_label(r['role'], r['slot'])} ({_where(r, carried, several_ranks)}): {field} {int(r[f'{field}_a'])} "
        f"in {label_a} vs {int(r[f'{field}_b'])} in {label_b} (where it entered: first_nonfinite per rank, "
        "`gradstore query DB first_nonfinite -p run=RUN -p rank=R`)"
    )


def _forward_words(rows: pd.DataFrame, label_a: str, label_b: str) -> tuple[str, int, str]:
    """For `diff`: (a line on the forward's rows (record(forward=True): module outputs and losses), '' where neither
    side recorded any; how many were compared (measured on both sides); a note, '' or 'the forward was not compared
    ...', where a side recorded no forward in a step the other side recorded one in)."""
    if rows.empty:
        return "", 0, ""
    both = rows[rows["side"] == "both"]
    compared = both[(both["differs"] != "not compared") & (both["status_a"] == "ok") & (both["status_b"] == "ok")]
    n_diff = int(((both["differs"] != "") & (both["differs"] != "not compared")).sum())
    missing = rows["differs"] == "missing"
    only_a, only_b = int((missing & (rows["side"] == "a")).sum()), int((missing & (rows["side"] == "b")).sum())
    unrecorded = (rows["differs"] == "not compared") & rows["reason"].fillna("").str.contains("recorded no forward")
    n_unmeasured = int((rows["differs"] == "not compared").sum()) - int(unrecorded.sum())
    # module outputs that are different pieces of one DTensor (a shard; each rank's own local piece)
    unmeasured = rows["differs"] == "not compared"
    n_pieces = int((unmeasured & rows["reason"].fillna("").str.startswith(DTENSOR_PIECES)).sum())
    note = ""
    if unrecorded.any():  # one side recorded the forward of a step, the other side did not: no claim about it
        holders = [
            label_a if side == "a" else label_b for side in ("a", "b") if (unrecorded & (rows["side"] == side)).any()
        ]
        silent = [label_b if h == label_a else label_a for h in holders]
        note = (
            f"the forward was not compared: {' and '.join(silent)} recorded no forward (record(forward=True)) where "
            f"{' and '.join(holders)} did ({int(unrecorded.sum()):,} module outputs and losses of one side only)"
        )
    if both.empty and not (only_a or only_b or n_unmeasured):
        return f"Forward: {note}.", 0, note
    line = (
        f"Forward (record(forward=True)): {len(both):,} module outputs and losses aligned; {n_diff:,} differ bitwise, "
        f"{only_a:,} only in {label_a}, {only_b:,} only in {label_b}, {n_unmeasured:,} not compared"
        + (
            f" ({n_pieces:,} of them different pieces of one DTensor: shards, or each rank's own local piece between "
            "DTensor ops, whose values differ by design)"
            if n_pieces
            else ""
        )
        + (f"; {note}" if note else "")
        + "."
    )
    return line, len(compared), note


def _side_levels(store, run, step, other_step, rank, other_rank) -> set[str]:
    """The stats levels of one side's compared steps (a flight-recorder summary left out)."""
    rows = store.steps(
        run=run, step=step if step is not None else other_step, rank=rank if rank is not None else other_rank
    )
    return set(rows["level"]) - {"summary"}


def _levels(sides) -> str:
    """A sentence for `diff` where the two sides were recorded at different stats levels, '' where not."""
    (a, label_a), (b, label_b) = sides
    if not a or not b or a == b:
        return ""
    words = [f"{label_a} was recorded at stats={', '.join(sorted(a))} and {label_b} at stats={', '.join(sorted(b))}"]
    if "health" in a | b:
        words.append(
            "mean, std and zeros are not compared where a side is at 'health', which does not measure them, and its "
            "norms are summed in float32 blocks: they may differ from a 'full' norm in the last bits (--rtol 1e-6 "
            "allows that)"
        )
    return "Levels differ: " + "; ".join(words) + "."


def _not_compared_example(rows: pd.DataFrame) -> str:
    """'KEY slot: why' of the first row not compared."""
    r = rows.iloc[0]
    return f"{r['key']} {_slot_label(r['role'], r['slot'])}: {r['reason']}"


def _summary_steps(
    store, run_a, run_b, step_a, step_b, rank_a, rank_b, label_a: str, label_b: str
) -> tuple[set[int], set[int], str]:
    """(side a's, side b's steps that hold a flight-recorder summary only: `Store.steps` level 'summary', no
    gradient rows, only each parameter's final norm; a sentence naming them for `diff`, '' for none)."""
    step_a, step_b = (step_a if step_a is not None else step_b), (step_b if step_b is not None else step_a)
    rank_a, rank_b = (rank_a if rank_a is not None else rank_b), (rank_b if rank_b is not None else rank_a)
    held, parts = [], []
    for label, run, step, rank in ((label_a, run_a, step_a, rank_a), (label_b, run_b, step_b, rank_b)):
        rows = store.steps(run=run, step=step, rank=rank)
        steps = {int(x) for x in rows.loc[rows["level"] == "summary", "step"]}
        held.append(steps)
        if not steps:
            continue
        if "step" in label:  # the label names the step already
            part = label
        else:
            part = f"step {_step_ranges(steps)}" if len(steps) == 1 else f"steps {_step_ranges(steps)}"
            if label_a != label_b:
                part = f"{part} of {label}"
        if part not in parts:
            parts.append(part)
    text = (
        f"not compared: {'; '.join(parts)} (flight-recorder summaries: their gradients were not kept, only each "
        "parameter's final norm, Store.param_norms)"
        if parts
        else ""
    )
    return held[0], held[1], text


_RULE_WORDS = {
    "summary": "flight-recorder summary (each rank's final norm only: a norm that differs is a difference)",
    "replicated": "replicated (the ranks' values must agree)",
    "sharded": "sharded (different shards: layout compared; values differ by design)",
    "partial": "partial (different Partial terms: layout compared; values differ by design)",
    "missing": "missing on some rank",
    "none": ".grad None on both ranks (no values, and no placement to read: replicated or sharded not known; nothing "
    "compared)",
}

# rank_divergence's stage, after a parameter's name
_STAGE_WORDS = {"backward": " (after the backward pass)", "final": " (as the optimizer saw it: the final row)"}


def _names(names: list[str], verbose: bool, limit: int = 8) -> str:
    if verbose or len(names) <= limit:
        return ", ".join(names)
    return ", ".join(names[:limit]) + f", and {len(names) - limit} more (--verbose lists them)"


def _absent_words(absent: list[int], steps: pd.DataFrame, step: int, world: int, ranks: pd.DataFrame) -> str:
    """Why ranks `absent` have no step `step` in this database, and what to do: from each rank's claims row
    (`ranks`: Store.run_ranks of the run) how its recording stands (still running, interrupted after its last step
    written, ended with an error, finished earlier); merge their files only where the database holds no trace of
    that rank (no claim, no step)."""
    wrote = {int(r) for r in steps["rank"]}
    lost = {int(r) for r in steps.loc[(steps["status"] == UNWRITTEN) & (steps["step"] == step), "rank"]}
    claimed = {int(r.rank): r for r in ranks.itertuples() if not pd.isna(r.status)}
    parts = []
    if lost & set(absent):
        named = sorted(lost & set(absent))
        parts.append(
            f"step {step} was not written on rank{'s' if len(named) > 1 else ''} {', '.join(map(str, named))}: the "
            "writer could not write it, its error is in the steps row"
        )
        absent = [r for r in absent if r not in lost]
    benign = []
    for rank in [r for r in absent if r in claimed]:
        row = claimed[rank]
        last = None if pd.isna(row.last_step) else int(row.last_step)
        if last is not None and last >= step:  # it wrote later steps: how its recording ended is not why
            benign.append(rank)
            continue
        who = (
            f"rank {rank} recorded into this database (claimed {_when(row.claimed_at)} by pid {int(row.pid)} on "
            f"{row.host})"
        )
        after = f"after step {last}" if last is not None else "before any step of it was written"
        if row.status == "running":
            parts.append(
                f"{who} and is still recording (last heartbeat {_when(row.heartbeat_at)}): step {step} may not be "
                "written yet"
            )
        elif row.status == "interrupted":
            parts.append(
                f"{who} and was interrupted {after}: its process died with its scope open (last heartbeat "
                f"{_when(row.heartbeat_at)}), and the steps it had not yet written were lost"
            )
        elif row.status == "error":
            where = "" if pd.isna(row.ended_step) else f" at step {int(row.ended_step)}"
            error = "" if pd.isna(row.error) else f" ({_short(str(row.error).strip().splitlines()[0], 200)})"
            parts.append(f"{who} and its recording ended with an error{where}{error}, {after}")
        elif row.status == "finished":
            parts.append(f"{who} and its recording finished {after}")
    elsewhere = [r for r in absent if (r in wrote and r not in claimed) or r in benign]
    nowhere = [r for r in absent if r not in wrote and r not in claimed]
    if elsewhere:
        parts.append(
            f"rank{'s' if len(elsewhere) > 1 else ''} {', '.join(map(str, elsewhere))} recorded no step {step} but "
            "wrote other steps of this run to this database: a rank writes no step in which it ran no backward pass, "
            "nor one that every= or steps= leave out"
        )
    if nowhere:
        parts.append(
            f"rank{'s' if len(nowhere) > 1 else ''} {', '.join(map(str, nowhere))} of world size {world} wrote no "
            "step of this run to this database, nor claimed it here; merge their databases with `gradstore merge`"
        )
    return "; ".join(parts)


def _consistent_words(rules: dict, bitwise: bool) -> str:
    """'1 replicated, values bitwise equal; 3 sharded, layouts equal (their values not compared across ranks)':
    what `gradstore ranks` compared, with counts, where its parameters agree under more than one rule."""
    replicated = sum("replicated" in r.split("+") for r in rules.values())
    sharded = sum(bool({"sharded", "partial"} & set(r.split("+"))) for r in rules.values())
    parts = []
    if replicated:
        parts.append(f"{replicated} replicated, values {'bitwise equal' if bitwise else 'with equal statistics'}")
    if sharded:
        parts.append(
            f"{sharded} sharded, layouts equal (their shards' values not compared across ranks"
            + (
                ": copies of one shard compared by value"
                if replicated and any("replicated" in r and "sharded" in r for r in rules.values())
                else ""
            )
            + ")"
        )
    return "; ".join(parts) or "no values compared"


def _no_checksum_words(rows: pd.DataFrame) -> str:
    """Why rank_divergence rows compared by statistics had no checksum, from their `reason`: 'no checksum recorded
    (sparse gradients recorded by a gradstore that took no checksum of sparse tensors)' and the like."""
    reasons = rows["reason"].fillna("").astype(str)
    sparse = reasons.str.contains("a sparse gradient", regex=False)
    if len(rows) and sparse.all():
        why = "sparse gradients recorded by a gradstore that took no checksum of sparse tensors"
    elif sparse.any():
        why = (
            "record(checksum=True) takes them; the sparse ones were recorded by a gradstore that took none of sparse "
            "tensors"
        )
    else:
        why = "not taken: record(checksum=False), or a process of one rank without record(checksum=True)"
    return f"no checksum recorded: {why}"


def _nonfinite_words(rows: pd.DataFrame) -> str:
    """'; but not healthy: 4 of the 4 parameter gradients compared hold NaN or Inf (106 NaN in the ranks' rows
    together: 53 on rank 0, 53 on rank 1; after the backward pass)' for the compared rows that agree while holding NaN
    or Inf, '' when none does. Counted per rank (each rank's row of each parameter once: a shard, or a rank's copy),
    at the first stage that holds some."""
    if rows.empty:
        return ""
    counts = {f: pd.to_numeric(rows[f"{f}_a"], errors="coerce").fillna(0) for f in ("nan", "posinf", "neginf")}
    counts_b = {f: pd.to_numeric(rows[f"{f}_b"], errors="coerce").fillna(0) for f in ("nan", "posinf", "neginf")}
    bad = (sum(counts.values()) + sum(counts_b.values())) > 0
    if not bad.any():
        return ""
    mine = rows[bad]
    stage_of = mine.iloc[0]["stage"]
    at = rows[rows["stage"] == stage_of]
    per_rank: dict[int, dict] = {}  # rank -> param -> (nan, +inf, -inf) of its row
    for side in ("a", "b"):
        for r in at.itertuples():
            rank = int(getattr(r, f"rank_{side}"))
            per_rank.setdefault(rank, {}).setdefault(
                r.param, tuple(int(_count(getattr(r, f"{f}_{side}"))) for f in ("nan", "posinf", "neginf"))
            )
    parts = []
    for i, word in enumerate(("NaN", "+Inf", "-Inf")):
        by_rank = {rank: sum(v[i] for v in params.values()) for rank, params in sorted(per_rank.items())}
        total = sum(by_rank.values())
        if total:
            ranks = ", ".join(f"{n:,} on rank {rank}" for rank, n in by_rank.items() if n)
            parts.append(f"{total:,} {word} in the ranks' rows together: {ranks}")
    n_all = rows["param"].nunique()
    stage = {"backward": "after the backward pass", "final": "as the optimizer saw it"}.get(stage_of, "")
    return (
        f"; but not healthy: {mine['param'].nunique()} of the {n_all} parameter gradients compared hold NaN or Inf "
        f"({'; '.join(parts)}{'; ' + stage if stage else ''})"
    )


def _count(v) -> float:
    """A stored count as a number, 0 where NULL."""
    v = pd.to_numeric(v, errors="coerce")
    return 0.0 if pd.isna(v) else float(v)


_STAGE_SAW = {"backward": "after the backward pass", "final": "as the optimizer read it", None: ""}


def _accumulation(rows: pd.DataFrame) -> pd.Series:
    """rank_divergence rows not compared because each rank's .grad was its own accumulation (column accumulation 1:
    no optimizer step on the ranks, DDP no_sync)."""
    if "accumulation" not in rows:
        return pd.Series(False, index=rows.index)
    return pd.to_numeric(rows["accumulation"], errors="coerce").fillna(0).eq(1)


def _unstepped(row) -> list[int]:
    """The ranks of a rank_divergence row (rank_a, rank_b) on which no optimizer stepped in its step
    (optimizer_steps 0): its final row there is the .grad the step ended with, not one an optimizer read."""
    out = []
    for side in ("a", "b"):
        n = row.get(f"optimizer_steps_{side}") if hasattr(row, "get") else None
        if n is not None and not _missing(n) and int(n) == 0:
            out.append(int(row[f"rank_{side}"]))
    return out


def _stage_saw(row) -> str:
    """How a rank_divergence row's stage saw the .grad: `_STAGE_SAW`, but a final row of a step in which no
    optimizer stepped on a rank it compares is 'at the step's end (no optimizer step on rank R)'."""
    if row["stage"] == "final":
        none = _unstepped(row)
        if none:
            ranks = " or ".join(f"rank {r}" for r in none)
            return f"at the step's end (no optimizer step on {ranks})"
    return _STAGE_SAW.get(row["stage"], "")


def _stage_words(row) -> str:
    """`_STAGE_WORDS` of a rank_divergence row, with `_stage_saw`'s words for a final row no optimizer read."""
    if row["stage"] == "final" and _unstepped(row):
        return f" ({_stage_saw(row)}: the final row)"
    return _STAGE_WORDS.get(row["stage"], "")


def _first_difference(rows: pd.DataFrame) -> str:
    """'fc2.weight on rank 1 vs rank 0, as the optimizer read it' (', and 2 more parameters'): the first of
    rank_divergence's 'differs' rows of one step, by what the optimizer read (stage final) where it differs, and
    whether the same pair differed after the backward pass too."""
    rows = rows.assign(_final=(rows["stage"] != "final").astype(int)).sort_values(
        ["step", "_final", "rank_b", "rank_a"], kind="stable"
    )
    r = rows.iloc[0]
    if r["rule"] == "summary":
        stage = "by the final norms of a flight-recorder summary"
    else:
        same = rows[(rows["param"] == r["param"]) & (rows["rank_a"] == r["rank_a"]) & (rows["rank_b"] == r["rank_b"])]
        stage = " and ".join(
            _stage_saw(same[same["stage"] == st].iloc[0]) for st in ("final", "backward") if st in set(same["stage"])
        )
    more = rows["param"].nunique() - 1
    return (
        f"{r['param']} on rank {int(r['rank_b'])} vs rank {int(r['rank_a'])}"
        + (f", {stage}" if stage else "")
        + (f", and {more} more parameter{'s' if more > 1 else ''}" if more else "")
    )


@main.command(short_help="Do the ranks' parameter gradients agree at a step?")
@click.argument("db")
@click.argument("run")
@click.option("--step", type=int, default=None, help="The step to check (default: the last step the run recorded).")
@click.option("--verbose", "-v", is_flag=True, help="One line per parameter: its rule and the result.")
def ranks(db, run, step, verbose):
    """Compare every parameter's gradient at a step of run RUN (database DB) across ranks, at two stages: the
    .grad each rank held when the step's last backward pass returned (after DDP's all-reduce or FSDP2's
    reduce-scatter), and the .grad the optimizer saw (the step's final rows, where recorded: after
    GradScaler.unscale_ or clipping), by the rule its layout calls for. Replicated gradients (plain tensors,
    DTensor copies along Replicate mesh dimensions) must agree: bitwise where the record holds checksums (a sparse
    gradient's too), else statistic by statistic, which the first line calls no bitwise comparison, naming the
    parameters compared so. Sharded ones (different DTensor shards or Partial terms) differ by design: only their layout
    is compared. Where the gradients are reduced after the backward pass (a hand-written all-reduce), each rank's
    .grad after the pass is its own: the gradients the optimizer read decide, and the others are said to be local.
    A row missing, skipped or recorded without statistics on either rank, a .grad None on both, or
    a rank that recorded no such step is not compared, and counted as such. Needs every rank in DB (see
    `gradstore merge`).
    """
    with _store(db) as store:
        world = int(store.query("runs", run=run)["world_size"].iloc[0])  # UnknownRun first
        steps = store.steps(run=run)
        if steps.empty:
            raise click.ClickException(f"run {run!r} has no steps yet")
        step_given = step
        if step is None:
            step = int(steps["step"].max())
        store._check_step(run, step, None)
        ranks_at = sorted(int(r) for r in steps[steps["step"] == step]["rank"])
        every_rank = sorted(set(range(world)) | {int(r) for r in steps["rank"]})
        absent = [r for r in every_rank if r not in ranks_at]
        ranks_of = store.run_ranks(run=run)
        note = f" ({_absent_words(absent, steps, step, world, ranks_of)})" if absent else ""
        if len(ranks_at) < 2:
            click.echo(f"only rank {ranks_at[0]} recorded step {step} of run {run!r}: nothing to compare{note}")
            return
        table = store.rank_divergence(run, step, all=True)
        params = list(dict.fromkeys(store.param_grads(run=run, step=step)["param"]))
        if not params:  # a flight-recorder summary step: compared by each rank's final norm
            params = list(dict.fromkeys(table.loc[table["rule"] == "summary", "param"]))
        earlier, earlier_what = None, ""
        unseen = {}  # without --step: the other steps some rank of the run did not record, {step: [ranks]}
        if step_given is None:
            for st, at in steps[steps["status"] != UNWRITTEN].groupby("step"):  # a step not written: not there
                missing_here = [r for r in every_rank if r not in set(int(x) for x in at["rank"])]
                if missing_here and int(st) != step:
                    unseen[int(st)] = missing_here
        sick_steps: list[int] = []
        own_steps: list[int] = []
        if step_given is None:  # the last step only: say where the ranks first differed, if earlier
            every = store.rank_divergence(run)
            bad = every[every["result"] == "differs"]
            # the steps whose .grads were each rank's own accumulation (no optimizer step, DDP no_sync): not compared
            own_steps = sorted({int(v) for v in every.loc[_accumulation(every), "step"]} - {step})
            earlier = int(bad["step"].min()) if len(bad) and int(bad["step"].min()) < step else None
            earlier_what = _first_difference(bad[bad["step"] == earlier]) if earlier is not None else ""
            # and where a .grad held NaN/Inf on some rank: agreeing there is no health
            grads_all = store.param_grads(run=run, which="all")
            sick = grads_all[_nonfinite_mask(grads_all)] if len(grads_all) else grads_all
            sick_steps = sorted({int(v) for v in sick["step"]} - {step}) if len(sick) else []
        from .view.story import BOTH_RULES_WORDS, left_out  # pandas only, as the CLI

        unhooked = left_out(store, run)
    rank_list = ", ".join(map(str, ranks_at))
    by_param = {p: table[table["param"] == p] for p in params}
    verdict, rules = {}, {}
    for p, rows in by_param.items():
        placed = rows[rows["rule"] != "none"]  # .grad None on both ranks: no value and no placement to judge by
        results = set(placed["result"])
        # no comparison at all is no agreement either
        verdict[p] = next(
            (v for v in ("differs", "not compared", "equal", "sharded", "local") if v in results), "not compared"
        )
        rules[p] = "+".join(sorted(set(placed["rule"]) - {"missing"})) or (
            "none" if len(placed) < len(rows) else "missing"
        )
    # the parameters and stages whose .grad was None on both ranks: nothing compared there
    grad_none = table[table["rule"] == "none"]
    # of those, the ones FSDP2 holds: its gradient sync was off (set_requires_gradient_sync(False)) on both ranks
    fsdp_none = grad_none[grad_none["reason"].fillna("").str.startswith(FSDP_HELD.split(" (")[0])]
    if not params:
        click.echo(
            f"nothing compared at step {step}: no rank recorded a parameter gradient in it (ranks {rank_list}){note}"
        )
        return
    differ = [p for p in params if verdict[p] == "differs"]
    unchecked = [p for p in params if verdict[p] == "not compared"]
    # not compared because each rank's .grad is its own accumulation (no optimizer step, DDP no_sync): by design
    own_rows = table[_accumulation(table)]
    own = [p for p in unchecked if p in set(own_rows["param"])]
    fine = [p for p in params if verdict[p] in ("equal", "sharded", "local")]
    # gradients reduced after the pass (a hand-written all-reduce): after it each rank's own, different by design
    local = list(dict.fromkeys(table.loc[table["result"] == "local", "param"]))
    bitwise = not (table[table["result"] == "equal"]["compared"] == "statistics").any()
    # the parameters some pair of ranks agreed on by statistics only (no checksum on a side): not bitwise, said by name
    by_stats = table[(table["result"] == "equal") & (table["compared"] == "statistics")]
    stats_only = [p for p in params if p in set(by_stats["param"]) and verdict[p] != "differs"]
    stats_note = (
        f"; {len(stats_only)} of them compared by statistics only, not bitwise ({_no_checksum_words(by_stats)}): "
        f"{_names(stats_only, verbose)}"
        if stats_only
        else ""
    )
    n = len(params)
    # equal is not healthy: values that agree bitwise may all be NaN or Inf
    bad_note = _nonfinite_words(table[table["result"].isin(["equal", "sharded"])])
    none_note = (
        f"; not compared: {grad_none['param'].nunique()} parameter"
        f"{'s' if grad_none['param'].nunique() != 1 else ''}' .grad "
        + " and ".join(
            {"backward": "after the backward pass", "final": "as the optimizer saw it (the final rows)"}[s]
            for s in dict.fromkeys(grad_none["stage"])
        )
        + " was None on both ranks: no values, and no placement to read"
        if len(grad_none) and not differ
        else ""
    )
    if differ:
        head = f"ranks differ at step {step}: {len(differ)} of {n} parameter gradients differ (ranks {rank_list}){note}"
        head += f": {_first_difference(table[table['result'] == 'differs'])}"
    elif own and len(own) == len(unchecked) and not fine:
        head = (
            f"not compared at step {step}: {len(own)} of {n} parameter gradients (ranks {rank_list}){note}: "
            f"{own_rows.iloc[0]['reason']}"
        )
    elif len(fsdp_none) and set(unchecked) <= set(fsdp_none["param"]) and not fine:
        head = (
            f"not compared at step {step}: {len(unchecked)} of {n} parameter gradients (ranks {rank_list}){note}: "
            f".grad None on every rank: {FSDP_HELD}; the step whose backward pass runs with the sync on is compared"
        )
    elif unchecked:
        head = (
            f"no difference at step {step} among the {len(fine)} of {n} parameter gradients compared; "
            f"{len(unchecked)} not compared (ranks {rank_list}){note}"
        )
        head += stats_note + bad_note
    elif set(rules.values()) == {"replicated"}:
        read = " as the optimizer read them" if local else ""
        if bitwise:
            head = (
                f"ranks agree at step {step}: all {n} parameter gradients bitwise equal{read} (ranks {rank_list}){note}"
            )
        elif len(stats_only) == n:
            head = (
                f"ranks agree at step {step} by statistics only, not bitwise: all {n} parameter gradients have equal "
                f"statistics{read} (ranks {rank_list}; {_no_checksum_words(by_stats)}){note}"
            )
        else:
            head = (
                f"ranks agree at step {step}, not all bitwise: {n - len(stats_only)} of {n} parameter gradients "
                f"bitwise equal{read}, {len(stats_only)} with equal statistics only, not a bitwise comparison "
                f"({_no_checksum_words(by_stats)}): {_names(stats_only, verbose)} (ranks {rank_list}){note}"
            )
        head += bad_note + none_note
    else:
        head = (
            f"ranks agree at step {step}{'' if bitwise else ', not all bitwise'}: all {n} parameter gradients "
            f"consistent (ranks {rank_list}): {_consistent_words(rules, bitwise)}{note}"
        )
        head += stats_note + bad_note + none_note
    click.echo(head)
    if local:
        click.echo(
            f"  after the backward pass the gradients of {len(local)} of {n} parameters differ across ranks: each "
            "rank's own gradient, reduced after the pass (as by a hand-written all-reduce: in this step, rows that "
            "differ after the pass agree as the optimizer read them); expected where the ranks see different data, "
            "not a divergence: "
            f"{_names(local, verbose)}"
        )
    if earlier is not None:
        click.echo(
            f"  the ranks differed earlier, first at step {earlier} ({earlier_what}): gradstore ranks {db} {run} "
            f"--step {earlier} (without --step, only the last recorded step is checked)"
        )
    if own_steps:
        click.echo(
            f"  not compared: {len(own_steps)} step{'s' if len(own_steps) > 1 else ''} ({_step_ranges(own_steps)}) "
            "where no optimizer stepped on the ranks and each rank's .grad was its own accumulation (DDP no_sync / no "
            f"optimizer step), expected to differ: gradstore ranks {db} {run} --step {own_steps[0]}"
        )
    if sick_steps:
        click.echo(
            f"  not healthy elsewhere: a parameter .grad held NaN or Inf at step{'s' if len(sick_steps) > 1 else ''} "
            f"{_step_ranges(sick_steps)} (whether or not the ranks agree there): gradstore ranks {db} {run} --step "
            f"{sick_steps[0]}"
        )
    if unhooked.params:
        click.echo(
            f"  not compared: {len(unhooked.params)} of the {unhooked.params_total} parameters in the record's graph "
            f"were not recorded (a modules= / params= filter): {_names(unhooked.params, verbose)}"
        )
    if unseen:
        click.echo(
            f"  not compared: step{'s' if len(unseen) > 1 else ''} {_step_ranges(set(unseen))}, which not every rank "
            "recorded ("
            + "; ".join(_absent_words(r, steps, st, world, ranks_of) for st, r in list(unseen.items())[:3])
            + ("; ..." if len(unseen) > 3 else "")
            + f"): gradstore ranks {db} {run} --step N"
        )
    if differ or unchecked:
        click.echo(f"  not compared: {len(unchecked)}")
    for rule in ("replicated", "summary", "sharded", "partial", "missing", "none"):
        members = [p for p in params if rule in rules[p].split("+")]
        words = _RULE_WORDS[rule]
        if rule == "none":  # a stage whose .grad was None on both ranks, whatever the other stage's rule
            members = [p for p in params if p in set(grad_none["param"])]
            if members and set(members) <= set(fsdp_none["param"]):
                words = f".grad None on both ranks: {FSDP_HELD} (nothing compared)"
        if members:
            click.echo(f"  {words}: {len(members)}: {_names(members, verbose)}")
    both = [
        p for p in params if "replicated" in rules[p].split("+") and {"sharded", "partial"} & set(rules[p].split("+"))
    ]
    if both:  # the lists are no partition of the parameters: say which are in two and why
        click.echo(f"  in both lists: {len(both)}: {_names(both, verbose)} ({BOTH_RULES_WORDS})")
    # one line per parameter and pair of ranks: its first stage that differs (or was not compared); a later stage
    # of the same pair is listed by --verbose, or where the first one agreed
    said: set = set()
    for result in ("differs", "not compared"):
        rows = []
        listed = table[table["result"] == result]
        if result == "not compared" and not verbose and len(own) == len(unchecked) and not fine and own:
            listed = listed[~_accumulation(listed)]  # the head says why, once
        if result == "not compared" and not verbose and head.startswith("not compared") and len(fsdp_none):
            listed = listed[~listed.index.isin(fsdp_none.index)]  # FSDP2 holds the gradients: the head says so, once
        for _, r in listed.iterrows():
            pair = (r["param"], r["rank_a"], r["rank_b"])
            if pair in said and not verbose:
                continue
            said.add(pair)
            rows.append(r)
        if result == "differs":
            for r in rows:
                a, b = f"rank {int(r['rank_a'])}", f"rank {int(r['rank_b'])}"
                how = {"replicated": "", "summary": " (flight-recorder summary: final norms)"}.get(
                    r["rule"], f" ({r['rule']}: layouts differ)"
                )
                click.echo(
                    f"  {r['param']}{_stage_words(r)}: {b} differs from {a}{how}: {_difference_words(r, a, b)}"
                    + (f" ({r['reason']})" if isinstance(r.get("reason"), str) and r["rule"] == "replicated" else "")
                )
        else:
            shown = rows
            for r in shown[: None if verbose else 20]:
                click.echo(
                    f"  {r['param']}{_stage_words(r)}: rank {int(r['rank_b'])} vs rank "
                    f"{int(r['rank_a'])} not compared: {r['reason']}"
                )
    if not verbose and len(shown) > 20:
        click.echo(f"  ... and {len(shown) - 20} more not compared (--verbose lists them)")
    if verbose:
        for p in params:
            click.echo(
                f"  {p}: {rules[p]}: {verdict[p]}" + (" (by statistics only, not bitwise)" if p in stats_only else "")
            )
    replicated_differ = table[(table["result"] == "differs") & (table["rule"] == "replicated")]
    stage = table["stage"]
    # parameters whose final rows differ while their rows after the backward pass agree on every pair of ranks
    late = []
    for p in dict.fromkeys(replicated_differ["param"]):
        mine = table[table["param"] == p]
        after_pass = mine[stage[mine.index] == "backward"]
        if not after_pass.empty and set(after_pass["result"]) == {"equal"}:
            late.append(p)
    if late:
        click.echo(
            f"After the backward pass the gradients of {_names(late, verbose)} agree across ranks: they came apart "
            "between the pass and the optimizer (GradScaler.unscale_ with a different scale, clipping, or code that "
            "changes .grad)."
        )
    if local and len(replicated_differ):  # reduced after the pass: the difference came in between, not in the pass
        parted = list(dict.fromkeys(replicated_differ["param"]))
        click.echo(
            f"The gradients of {_names(parted, verbose)} differ as the optimizer read them while, in this step, the "
            "ranks' gradients were reduced after the backward pass: look at the code between backward() and the "
            "optimizer (the all-reduce and what it writes back into .grad); a node-by-node diff compares each rank's "
            "own gradients, which differ by design here."
        )
        return
    replicated_differ = replicated_differ[stage[replicated_differ.index] == "backward"]
    if not replicated_differ.empty:
        r = replicated_differ.iloc[0]
        click.echo(
            f"Node by node (each rank's local gradients, before any all-reduce): gradstore diff {db} {run} {run} "
            f"--step-a {step} --rank-a {int(r['rank_a'])} --rank-b {int(r['rank_b'])}"
        )


@main.command(short_help="Join per-rank or per-machine databases into one.")
@click.argument("out")
@click.argument("inputs", nargs=-1, required=True, metavar="IN...")
@click.option(
    "--skip-existing",
    is_flag=True,
    help="Leave out input steps (run, rank, step) that OUT already holds, instead of failing.",
)
def merge(out, inputs, skip_existing):
    """Merge the gradstore databases IN... into OUT (created if missing): runs matched by name, steps appended
    per (run, rank, step), nodes matched by key, edges de-duplicated, passes, calls and tensors copied. One
    transaction: on an error (a step OUT already holds, without --skip-existing) OUT is left as it was.
    """
    from .store.merge import merge as merge_databases

    with _progress(f"merging into {out} (rows)") as update:
        reports = merge_databases(
            out,
            list(inputs),
            skip_existing=skip_existing,
            progress=lambda done, total: update(completed=done, total=total),
        )
    for r in reports:
        runs = ", ".join([f"{n!r} (new)" for n in r.runs_created] + [repr(n) for n in r.runs_matched]) or "none"
        ranks_txt = f" of rank{'s' if len(r.ranks) > 1 else ''} {', '.join(map(str, r.ranks))}" if r.ranks else ""
        line = (
            f"{r.source}: run {runs}: {r.steps:,} steps{ranks_txt}"
            + (f" ({r.unwritten:,} of them not written: status unwritten)" if r.unwritten else "")
            + f", {r.passes:,} passes, {r.calls:,} calls, "
            f"{r.tensors:,} tensors; {r.nodes:,} new nodes, {r.edges:,} new edges"
        )
        if r.skipped:
            line += f"; {len(r.skipped):,} steps already in {out} skipped"
        click.echo(line)
    click.echo(f"merged {len(reports)} database{'s' if len(reports) > 1 else ''} into {_shown(out)}")


# ---- pictures: the HTML report, Datasette -------------------------------------------------------------------


@main.command(short_help="Write one self-contained HTML page telling a run's story.")
@click.argument("db")
@click.argument("run")
@click.option(
    "-o",
    "--output",
    "out",
    default=None,
    metavar="FILE",
    help="The HTML file to write (default: RUN.html in the current directory).",
)
def report(db, run, out):
    """Write the report of run RUN of database DB: its steps and statuses, the first non-finite gradient (node,
    module, frame, the path that carried it, a drawing of its neighbourhood), the heatmap of gradient norms by
    module, the parameters whose gradients changed most, rank agreement and step values where recorded.

    One HTML file with everything inline (no network, no script): open it in any browser, attach it, keep it as a
    CI artifact. Needs the view extra: pip install 'gradstore[view]' (and Graphviz's dot for the graph).
    """
    from .view.html_report import SECTIONS, write_report

    with _progress(f"report of {run!r}", total=len(SECTIONS)) as update:
        done = iter(range(len(SECTIONS)))
        path = write_report(
            db, run, out=out, progress=lambda name: update(completed=next(done), description=f"report: {name}")
        )
    click.echo(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB): open it in a browser")


@main.command("datasette", short_help="Browse a database in Datasette, with queries/ as canned queries.")
@click.argument("db")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8001, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
@click.option(
    "--max-rows", default=10_000, show_default=True, type=click.IntRange(min=1), help="Most rows a query returns."
)
@click.option(
    "--time-limit", default=30.0, show_default=True, type=click.FloatRange(min=0.1), help="Seconds a query may run."
)
@click.option(
    "--metadata",
    "print_metadata",
    is_flag=True,
    help="Print the Datasette metadata (JSON) and exit, for `datasette DB -m FILE` of your own.",
)
def datasette_command(db, host, port, max_rows, time_limit, print_metadata):
    """Serve SQLite database DB with Datasette: every file of queries/ as a canned query named q_NAME (q_steps,
    q_first_nonfinite, ...: never the name of a table or view), with its title, description and parameters;
    a parameter left empty means all. Tables and views show role, status, dtype and kind codes as names.

    Needs the datasette extra: pip install 'gradstore[datasette]'. Stop it with Ctrl-C.
    """
    from .view import browse

    if print_metadata:
        import json

        click.echo(json.dumps(browse.metadata(db), indent=2))
        return
    name = browse.database_name(db)
    click.echo(
        f"Datasette on http://{host}:{port}/{name} (canned queries: http://{host}:{port}/{name}#queries)", err=True
    )
    browse.serve(db, host=host, port=port, max_rows=max_rows, time_limit_ms=int(time_limit * 1000))


if __name__ == "__main__":  # pragma: no cover
    main()
