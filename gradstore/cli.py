"""The `gradstore` command line: record the built-in demo, list runs, summarise a run or step, run named
queries, upgrade a database's schema.

    gradstore demo                       record a small GPT's backward passes into ./gradstore.db
    gradstore runs DB                    the runs in a database
    gradstore show DB RUN [--step N]     a run, or one step of it
    gradstore query DB NAME [-p k=v]     a named query of queries/ as a table (or --csv)
    gradstore queries                    the named queries, their titles and parameters
    gradstore db upgrade DB              bring a database to the newest schema revision

Every error gradstore raises on purpose (GradstoreError), a database error, and a malformed option come out
as one line on stderr (`Error: ...`) with exit status 1 (2 for click's own usage errors), never a traceback.
Relies on click >= 8.1 and pandas for the tables.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager

import click
import pandas as pd
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError

from . import __version__
from . import queries as named_queries
from . import schema as s
from .errors import GradstoreError
from .recorder import DEFAULT_DB
from .store import Store

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


class _Group(click.Group):
    """A click group that turns GradstoreError and SQLAlchemyError into a one-line ClickException."""

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


# ---- formatting ------------------------------------------------------------------------------------------


def _table(df: pd.DataFrame, empty: str = "  (none)") -> str:
    """The frame as plain text: every row and column, no index, indented two spaces."""
    if df.empty:
        return empty
    df = df.copy()
    for col in df.columns[df.dtypes == object]:
        df[col] = df[col].map(lambda v: "-" if v is None or (isinstance(v, float) and pd.isna(v)) else v)
    text = df.to_string(index=False, na_rep="-", float_format=lambda v: f"{v:.6g}")
    return "\n".join("  " + line for line in text.splitlines())


def _when(ts) -> str:
    """Seconds since the epoch as local 'YYYY-MM-DD HH:MM:SS', or '-' for None/NaN."""
    if ts is None or pd.isna(ts):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(ts)))


def _module_label(module) -> str:
    return module if isinstance(module, str) and module else "(outside any module)"


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
        counts["steps"] = conn.execute(step_filter(select(func.count()).select_from(s.steps, s.runs))).scalar()
        counts["passes"] = conn.execute(step_filter(select(func.count()).select_from(
            s.passes.join(s.steps, s.passes.c.step_id == s.steps.c.id), s.runs))).scalar()
        if step is None:
            for name, table in (("nodes", s.nodes), ("edges", s.edges)):
                counts[name] = conn.execute(select(func.count()).select_from(table, s.runs).where(
                    table.c.run_id == s.runs.c.id, s.runs.c.name == run)).scalar()
        for name, table in (("calls", s.calls), ("tensors", s.tensors)):
            counts[name] = conn.execute(step_filter(select(func.count()).select_from(
                table.join(s.steps, table.c.step_id == s.steps.c.id), s.runs))).scalar()
    return counts


def _counts_lines(counts: dict[str, int]) -> str:
    what = {
        "steps": "recorded steps (all ranks)",
        "passes": "backward passes (loss.backward() / torch.autograd.grad calls)",
        "nodes": "distinct autograd nodes (grad_fn and AccumulateGrad), stored once per run",
        "edges": "graph edges (next_functions)",
        "calls": "node executions",
        "tensors": "gradient statistics rows (grad_outputs, grad_inputs, parameter .grad)",
    }
    return "\n".join(f"  {name:<8}{n:>9,}  {what[name]}" for name, n in counts.items())


def _slowest_nodes(calls: pd.DataFrame, top: int) -> pd.DataFrame:
    """Nodes by total call duration: key, module, calls, total_ms, mean_ms (top `top`)."""
    if calls.empty:
        return calls
    g = calls.assign(module=calls["module"].map(_module_label)).groupby(["key", "module"], dropna=False)
    out = g["duration"].agg(calls="count", total="sum", mean="mean").reset_index()
    out = out.sort_values("total", ascending=False).head(top)
    return pd.DataFrame({
        "node": out["key"], "module": out["module"], "calls": out["calls"],
        "total_ms": (out["total"] * 1e3).round(3), "mean_ms": (out["mean"] * 1e3).round(3),
    })


def _largest_module_norms(norms: pd.DataFrame, top: int) -> pd.DataFrame:
    """Modules by their largest grad_output_norm over steps: module, step, grad_output_norm, grad_input_norm."""
    if norms.empty:
        return norms
    idx = norms.groupby("module", dropna=False)["grad_output_norm"].idxmax().dropna()
    best = norms.loc[idx].sort_values("grad_output_norm", ascending=False).head(top)
    return pd.DataFrame({
        "module": best["module"].map(_module_label), "step": best["step"],
        "grad_output_norm": best["grad_output_norm"], "grad_input_norm": best["grad_input_norm"],
        "nonfinite": best["nonfinite"],
    })


def _first_nonfinite_line(store: Store, run: str, step: int | None = None) -> str | None:
    """'First non-finite gradient: ...' for the run's first call with NaN/Inf gradients (per rank), or None.

    With `step`, only when that call is in that step.
    """
    bad = store.first_nonfinite(run=run)
    if step is not None:
        bad = bad[bad["step"] == step]
    if bad.empty:
        return None
    lines = []
    for (rank, _), rows in bad.groupby(["rank", "seq"], sort=True):
        r = rows.iloc[0]
        slots = "; ".join(f"{row.role}[{row.slot}]: {row.nan} nan, {row.posinf} +inf, {row.neginf} -inf"
                          for row in rows.itertuples())
        lines.append(f"First non-finite gradient (rank {rank}): step {r['step']}, pass {r['pass']}, seq {r['seq']}: "
                     f"{r['key']} in {_module_label(r['module'])} ({slots})")
    return "\n".join(lines)


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
@click.option("--run", "run_name", default="demo", show_default=True,
              help="Run name; recording into an existing run continues its step numbering.")
@click.option("--steps", default=3, show_default=True, type=click.IntRange(min=1), help="Training steps to record.")
@click.option("--seed", default=0, show_default=True, help="Seed of the weights and the synthetic tokens.")
@click.option("--nan-step", type=click.IntRange(min=0), default=None,
              help="Inject a NaN into the gradient at transformer.h.0.mlp.c_fc in this step (0-based) "
                   "so that first_nonfinite has something to find.")
@click.option("--top", default=5, show_default=True, type=click.IntRange(min=1),
              help="Rows in the slowest-node and gradient-norm tables.")
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
    click.echo(f"Recorded run {run_name!r} into {db}: steps {first}-{last} of a GPT ({cfg['n_layer']} layers, "
               f"{cfg['n_head']} heads, {cfg['n_embd']} wide, vocab {cfg['vocab_size']}, seq {cfg['block_size']}, "
               f"{summary['parameters']:,} parameters) in {summary['seconds']:.2f} s; "
               f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    with _store(db) as store:
        click.echo(f"\nRows in run {run_name!r}" + (" (all its steps, not only these)" if first else "") + ":")
        click.echo(_counts_lines(_counts(store, run_name)))
        calls = store.calls(run=run_name)
        click.echo(f"\nSlowest nodes (total backward time over steps {first}-{last}):" if not first else
                   "\nSlowest nodes (total backward time over all steps of the run):")
        click.echo(_table(_slowest_nodes(calls, top)))
        norms = store.grad_norms(run=run_name, by="module")
        click.echo("\nLargest gradient norms by module (L2 norm of the grad_outputs flowing into the module's "
                   "nodes, at the step where it peaked):")
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
    """List the runs in database DB (a SQLite file or SQLAlchemy URL): status, steps, times, versions."""
    with _store(db) as store:
        df = store.runs()
    if df.empty:
        click.echo(f"no runs in {db}")
        return
    out = pd.DataFrame({
        "run": df["run"], "status": df["status"], "steps": df["steps"], "world_size": df["world_size"],
        "created": df["created_at"].map(_when), "finished": df["finished_at"].map(_when),
        "torch": df["torch_version"], "gradstore": df["gradstore_version"], "host": df["host"],
    })
    click.echo(_table(out))


def _limited(df: pd.DataFrame, limit: int) -> tuple[pd.DataFrame, str]:
    if len(df) <= limit:
        return df, ""
    half = max(limit // 2, 1)
    shown = pd.concat([df.head(half), df.tail(limit - half)]) if limit > 1 else df.head(1)
    return shown, f"  ... {len(df) - len(shown):,} more rows not shown (--limit, or `gradstore query`)"


def _show_run(store: Store, db: str, run: str, rank: int | None, limit: int) -> None:
    r = store.query("runs", run=run).iloc[0]
    click.echo(f"Run {run!r} in {db}: {r['status']}, world size {r['world_size']}, created {_when(r['created_at'])}, "
               f"finished {_when(r['finished_at'])}; torch {r['torch_version']}, gradstore {r['gradstore_version']}, "
               f"host {r['host']}")
    click.echo(_counts_lines(_counts(store, run, rank=rank)))
    steps = store.steps(run=run, rank=rank)
    if steps.empty:
        click.echo("\nNo steps recorded yet.")
        return
    passes = store.passes(run=run, rank=rank)
    per_step = passes.groupby(["rank", "step"]).agg(calls=("calls", "sum"), backward_s=("duration", "sum"))
    table = steps.join(per_step, on=["rank", "step"])
    out = pd.DataFrame({
        "step": table["step"], "rank": table["rank"], "status": table["status"], "passes": table["passes"],
        "calls": table["calls"].fillna(0).astype(int), "step_s": table["duration"].round(4),
        "backward_s": table["backward_s"].round(4),
        "error": table["error"].map(lambda e: "" if e is None or pd.isna(e) else " ".join(str(e).split())[:80]),
    })
    counts = steps["status"].value_counts()
    click.echo("\nSteps (" + ", ".join(f"{n} {status}" for status, n in counts.items()) + "); times in seconds:")
    shown, more = _limited(out, limit)
    click.echo(_table(shown))
    if more:
        click.echo(more)
    bad = _first_nonfinite_line(store, run)
    detail = int(steps["step"].iloc[-1])
    if bad:
        click.echo("\n" + bad)
        nonfinite = steps[steps["status"] == "nonfinite"]
        detail = int(nonfinite["step"].iloc[0]) if len(nonfinite) else detail
    click.echo(f"\nOne step in detail: gradstore show {db} {run} --step {detail}")


def _show_step(store: Store, db: str, run: str, step: int, rank: int | None, limit: int) -> None:
    steps = store.steps(run=run, rank=rank, step=step)
    if steps.empty:
        known = store.steps(run=run, rank=rank)["step"]
        have = f"steps {known.min()}-{known.max()}" if len(known) else "no steps yet"
        raise click.ClickException(f"run {run!r} has no step {step}" + (f" on rank {rank}" if rank is not None else "")
                                   + f"; it has {have}")
    click.echo(f"Step {step} of run {run!r} in {db}")
    click.echo(_counts_lines(_counts(store, run, step=step, rank=rank)))
    out = pd.DataFrame({
        "rank": steps["rank"], "status": steps["status"], "passes": steps["passes"],
        "duration_s": steps["duration"].round(4),
        "error": steps["error"].map(lambda e: "" if e is None or pd.isna(e) else " ".join(str(e).split())[:100]),
    })
    click.echo("\nStep:")
    click.echo(_table(out))

    passes = store.passes(run=run, rank=rank, step=step)
    click.echo("\nBackward passes (duration in seconds):")
    click.echo(_table(passes[["rank", "pass", "kind", "parent_pass", "create_graph", "retain_graph", "roots",
                              "nodes", "calls", "duration"]]))

    calls = store.calls(run=run, rank=rank, step=step)
    click.echo(f"\nSlowest calls of {len(calls):,} (seq = execution order in the step):")
    slow = calls.sort_values("duration", ascending=False).head(limit)
    click.echo(_table(pd.DataFrame({
        "rank": slow["rank"], "pass": slow["pass"], "seq": slow["seq"], "node": slow["key"],
        "module": slow["module"].map(_module_label), "duration_ms": (slow["duration"] * 1e3).round(3),
    })))

    tensors = store.tensors(run=run, rank=rank, step=step)
    click.echo(f"\nGradient statistics rows ({len(tensors):,}) by role and status:")
    if not tensors.empty:
        nonfinite = tensors["nan"].fillna(0) + tensors["posinf"].fillna(0) + tensors["neginf"].fillna(0)
        by = tensors.assign(nonfinite=nonfinite).groupby(["role", "status"]).agg(
            rows=("slot", "size"), elements=("numel", "sum"), nonfinite=("nonfinite", "sum"),
            max_norm=("norm", "max")).reset_index()
        by["elements"] = by["elements"].fillna(0).astype("int64")
        by["nonfinite"] = by["nonfinite"].astype("int64")
        click.echo(_table(by))
    else:
        click.echo("  (none)")

    grads = store.param_grads(run=run, rank=rank, step=step)
    click.echo("\nLargest parameter .grad norms (after the step's last backward pass):")
    top = grads.sort_values("norm", ascending=False).head(limit)
    click.echo(_table(top[["rank", "param", "status", "shape", "norm", "min", "max", "nan", "posinf", "neginf"]]))

    bad = _first_nonfinite_line(store, run, step=step)
    if bad:
        click.echo("\n" + bad)
    click.echo(f"\nEvery row: gradstore query {db} tensors -p run={run} -p step={step}   (or calls, passes)")


@main.command(short_help="Summarise a run, or one step of it (--step).")
@click.argument("db")
@click.argument("run")
@click.option("--step", type=int, default=None,
              help="Show this step (its passes, slowest calls and gradients) instead of the whole run.")
@click.option("--rank", type=int, default=None, help="Only this rank (default: every rank).")
@click.option("--limit", default=20, show_default=True, type=click.IntRange(min=1),
              help="Most rows printed per table.")
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


def _list_queries() -> None:
    for q in named_queries.available().values():
        click.echo(f"{q.name:<16}{q.title}")
        if q.params:
            click.echo(f"{'':<16}-p " + "  -p ".join(f"{p}=..." for p in q.params))


@main.command(short_help="Run a named query; print a table or CSV.")
@click.argument("db", required=False)
@click.argument("name", required=False)
@click.option("-p", "--param", "params", multiple=True, metavar="NAME=VALUE",
              help="A query parameter, e.g. -p run=demo -p step=0; repeat for several. Left out means all.")
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
    if as_csv:
        click.echo(df.to_csv(index=False), nl=False)
    elif df.empty:
        click.echo("(no rows)")
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


@main.group(cls=_Group, short_help="Manage a database's schema revision (upgrade).")
def db():
    """Manage a database's schema (Alembic revisions shipped with gradstore)."""


@db.command(short_help="Upgrade (or create) a database to the newest schema revision.")
@click.argument("db_path", metavar="DB")
def upgrade(db_path):
    """Upgrade database DB to the newest schema revision, creating it (and its file) when new."""
    from .database import upgrade as upgrade_db

    before, after = upgrade_db(db_path)
    if before == after:
        click.echo(f"{db_path}: already at schema revision {after}")
    else:
        click.echo(f"{db_path}: schema revision {before or '(none, new database)'} -> {after}")


if __name__ == "__main__":  # pragma: no cover
    main()
