"""`gradstore merge OUT IN...`: join per-rank or per-machine databases into one.

Each rank (or machine) of a job can record into its own file; `merge` copies them into one database so that
the comparisons across ranks (`Store.rank_divergence`, `Store.diff(rank_a=, rank_b=)`) see every rank:

- runs are matched by name (created in OUT when missing; world_size becomes the largest of the two, status
  the worst of error / running / finished, created_at the earliest, finished_at the latest), and each rank's
  claims row (its writer's pid and host, and how its recording ended) copied where OUT has none for that rank, so
  that the merged run's status is the aggregate over its ranks (a rank still recording when its file was merged
  reads running in OUT until its lease runs out, then interrupted: OUT never hears of its end);
- steps are appended per (run, rank, step); one that OUT already holds is an error (`MergeConflict`, naming
  it), or is skipped with its passes, calls and tensors when `skip_existing=True`;
- nodes are matched by key within the run (new ones added; ids remapped), edges de-duplicated, and the graphs
  each pass walked (revision 0012_edge_steps) matched by digest, with their edges;
- passes, calls and tensors are copied with remapped ids (each pass's calls stay an id range), with their
  reasons, checksums, sparse layouts and DTensor layouts (shardings matched by key), and with each tensor the
  rows keyed by its id (tensor_notes, tensor_shardings, and revision 0008_inside's tensor_slices,
  tensor_values, saved_versions, forward_seqs);
- the step findings (param_status, module_calls, step_nodes, step_warnings) are copied with their steps, and
  param_names (every name of a parameter) added per run where OUT lacks the name;
- step values, flight-recorder summaries (param_norms) and dumps go with their steps and runs.

Everything goes through SQLAlchemy Core on the `gradstore.store.schema` tables, so OUT and the inputs may be
SQLite files or database URLs. The whole merge is one transaction on OUT: an error leaves OUT as it was (a
SQLite file that the merge itself created is removed again).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy import bindparam, func, insert, select, update

from ..errors import GradstoreError
from . import schema as s
from .database import ensure_schema, is_url, make_engine, open_existing
from .writer import flush_pending

_CHUNK = 5_000  # rows read, mapped and inserted at a time
_IN = 500  # values per IN (...) list

_STATUS_RANK = {"finished": 0, "running": 1, "error": 2}  # the merged run keeps the worst
# the tables keyed by a tensor's id, copied with it under its new id
_SIDE_TABLES = (s.tensor_notes, s.tensor_shardings, s.tensor_slices, s.tensor_values, s.saved_versions, s.forward_seqs)


class MergeConflict(GradstoreError):
    """A (run, rank, step) of an input database is already in the output database."""


@dataclass
class MergeReport:
    """What one input contributed to the merged database.

    source: the input (path or URL); runs_created / runs_matched: run names; steps, passes, calls, tensors:
    rows copied; nodes, edges: rows added (the others matched rows already there); skipped: (run, rank,
    step) left out because OUT had them (skip_existing=True); unwritten: of the steps, those the writer could not
    write (only their steps row exists, status unwritten).
    """

    source: str
    runs_created: list[str] = field(default_factory=list)
    runs_matched: list[str] = field(default_factory=list)
    steps: int = 0
    passes: int = 0
    calls: int = 0
    tensors: int = 0
    nodes: int = 0
    edges: int = 0
    values: int = 0  # step_values rows copied
    skipped: list[tuple[str, int, int]] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    unwritten: int = 0  # of `steps`, the rows of steps the writer could not write (status unwritten)


def _identity(db) -> str:
    return str(db) if is_url(db) else str(Path(db).resolve())


def count_rows(engine) -> int:
    """Rows `merge` copies from a database: steps, passes, calls and tensors (for a progress bar's total)."""
    with engine.connect() as conn:
        return sum(
            conn.execute(select(func.count()).select_from(t)).scalar() or 0
            for t in (s.steps, s.passes, s.call_data, s.tensor_data)
        )


def merge(
    out: str | Path,
    inputs: list,
    *,
    skip_existing: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> list[MergeReport]:
    """Merge the gradstore databases `inputs` into `out` (created when missing); returns one MergeReport per
    input, in order.

    progress: called as progress(rows_done, rows_total) as rows are copied (steps, passes, calls and tensors
    of every input; rows skipped with skip_existing count as done), first with rows_done = 0.

    Raises:
        GradstoreError: no input, an input named twice or equal to `out`.
        DatabaseNotFound / NotAGradstoreDatabase / SchemaTooNew: an input that is missing or not a gradstore
            database; SchemaTooOld: an input at an older revision (inputs are only read: upgrade it first).
        MergeConflict: an input step (run, rank, step) that `out` already holds (also one merged from an
            earlier input of the same call), unless `skip_existing`. Nothing is written then.
    """
    inputs = [str(i) for i in inputs]
    if not inputs:
        raise GradstoreError("merge needs at least one input database")
    out_id = _identity(out)
    seen: set[str] = set()
    for db in inputs:
        ident = _identity(db)
        if ident == out_id:
            raise GradstoreError(f"cannot merge {db} into itself: give a different output database")
        if ident in seen:
            raise GradstoreError(f"input {db} is given twice")
        seen.add(ident)
    for db in [out, *inputs]:
        flush_pending(db)  # this process's own recording may still be writing
    sources = []
    try:
        for db in inputs:
            sources.append(open_existing(db)[0])
        created = not is_url(out) and not Path(out).exists()
        target = make_engine(out, immediate=True)
        try:
            ensure_schema(target, str(out))
            reports = []
            total = sum(count_rows(e) for e in sources) if progress is not None else 0
            done = 0

            def tick(n: int) -> None:
                nonlocal done
                done += n
                if progress is not None:
                    progress(min(done, total), total)

            tick(0)
            with target.begin() as dst:
                for db, engine in zip(inputs, sources):
                    with engine.connect() as src:
                        before = done
                        reports.append(_merge_one(src, dst, db, str(out), skip_existing, tick))
                        if progress is not None:
                            tick(count_rows(engine) - (done - before))  # what was skipped counts as done
            return reports
        except BaseException:
            target.dispose()
            if created:
                for suffix in ("", "-wal", "-shm", "-journal"):
                    Path(str(out) + suffix).unlink(missing_ok=True)
            raise
        finally:
            target.dispose()
    finally:
        for engine in sources:
            engine.dispose()


def _chunks(rows, n=_CHUNK):
    for i in range(0, len(rows), n):
        yield rows[i : i + n]


def _insert_returning_ids(dst, table, rows: list[dict]) -> list[int]:
    """Insert `rows` and return their new ids in the same order (SQLAlchemy's portable insertmanyvalues)."""
    ids: list[int] = []
    for chunk in _chunks(rows):
        ids.extend(dst.execute(insert(table).returning(table.c.id, sort_by_parameter_order=True), chunk).scalars())
    return ids


def _stream(src, table, where=None, order_by=None):
    """The rows of `table` (as dicts) in id order (or `order_by`), `_CHUNK` at a time."""
    q = select(table).order_by(*(order_by if order_by is not None else (table.c.id,)))
    if where is not None:
        q = q.where(where)
    result = src.execute(q, execution_options={"yield_per": _CHUNK}).mappings()
    for part in result.partitions(_CHUNK):
        yield [dict(r) for r in part]


def _merge_runs(src, dst, report: MergeReport) -> tuple[dict[int, int], dict[int, str]]:
    run_map, names = {}, {}
    for r in src.execute(select(s.runs).order_by(s.runs.c.id)).mappings():
        names[r["id"]] = r["name"]
        have = dst.execute(select(s.runs).where(s.runs.c.name == r["name"])).mappings().first()
        if have is None:
            values = {k: v for k, v in r.items() if k != "id"}
            run_map[r["id"]] = dst.execute(insert(s.runs).returning(s.runs.c.id), values).scalar_one()
            report.runs_created.append(r["name"])
            continue
        run_map[r["id"]] = have["id"]
        report.runs_matched.append(r["name"])
        status = max(have["status"], r["status"], key=lambda v: _STATUS_RANK.get(v, 1))
        finished = [t for t in (have["finished_at"], r["finished_at"]) if t is not None]
        dst.execute(
            update(s.runs)
            .where(s.runs.c.id == have["id"])
            .values(
                world_size=max(have["world_size"], r["world_size"]),
                status=status,
                created_at=min(have["created_at"], r["created_at"]),
                finished_at=max(finished) if finished and status != "running" else None,
                meta=have["meta"] if have["meta"] is not None else r["meta"],
            )
        )
    return run_map, names


def _merge_claims(src, dst, run_map: dict[int, int]) -> None:
    """Each rank's claims row (who recorded it, and how its recording ended: revision 0013_rank_ends), copied where
    OUT has none for that (run, rank): the merged run's status is the aggregate over its ranks, as in each input."""
    c = s.claims.c
    have = {(row.run_id, row.rank) for row in dst.execute(select(c.run_id, c.rank))}
    rows = []
    for r in src.execute(select(s.claims).order_by(c.id)).mappings():
        key = (run_map[r["run_id"]], r["rank"])
        if key not in have:
            have.add(key)
            rows.append({**{k: v for k, v in r.items() if k != "id"}, "run_id": key[0]})
    if rows:
        dst.execute(insert(s.claims), rows)
    # the claims taken over (revision 0017_claim_history), of the (run, rank)s whose claims row came from this input
    copied = {(row["run_id"], row["rank"]) for row in rows}
    past = [
        {**{k: v for k, v in r.items() if k != "id"}, "run_id": run_map[r["run_id"]]}
        for r in src.execute(select(s.past_claims).order_by(s.past_claims.c.id)).mappings()
        if (run_map[r["run_id"]], r["rank"]) in copied
    ]
    if past:
        dst.execute(insert(s.past_claims), past)


def _merge_steps(src, dst, run_map, names, db, out, skip_existing, report) -> dict[int, int]:
    src_steps = list(src.execute(select(s.steps).order_by(s.steps.c.id)).mappings())
    existing = set()
    targets = sorted(set(run_map.values()))
    for chunk in _chunks(targets, _IN):
        existing.update(
            tuple(row)
            for row in dst.execute(
                select(s.steps.c.run_id, s.steps.c.rank, s.steps.c.step).where(s.steps.c.run_id.in_(chunk))
            )
        )
    rows, src_ids, conflicts = [], [], []
    for st in src_steps:
        key = (run_map[st["run_id"]], st["rank"], st["step"])
        if key in existing:
            where = (names[st["run_id"]], st["rank"], st["step"])
            (report.skipped if skip_existing else conflicts).append(where)
            continue
        values = {k: v for k, v in st.items() if k != "id"}
        values["run_id"] = key[0]
        rows.append(values)
        src_ids.append(st["id"])
    if conflicts:
        run, rank, step = conflicts[0]
        more = f" (and {len(conflicts) - 1} more steps)" if len(conflicts) > 1 else ""
        raise MergeConflict(
            f"run {run!r} rank {rank} step {step} of {db} is already in {out}{more}; nothing was merged. "
            "Merge with --skip-existing (skip_existing=True) to leave such steps out"
        )
    new_ids = _insert_returning_ids(dst, s.steps, rows)
    report.steps = len(new_ids)
    report.unwritten = sum(r["status"] == s.UNWRITTEN for r in rows)
    report.ranks = sorted({r["rank"] for r in rows})
    return dict(zip(src_ids, new_ids))


def _merge_nodes(src, dst, run_map, report) -> dict[int, int]:
    node_map: dict[int, int] = {}
    for src_run, dst_run in run_map.items():
        have = {
            key: (nid, first)
            for key, nid, first in dst.execute(
                select(s.nodes.c.key, s.nodes.c.id, s.nodes.c.first_step).where(s.nodes.c.run_id == dst_run)
            )
        }
        new_rows, new_src = [], []
        for n in src.execute(select(s.nodes).where(s.nodes.c.run_id == src_run).order_by(s.nodes.c.id)).mappings():
            hit = have.get(n["key"])
            if hit is None:
                values = {k: v for k, v in n.items() if k != "id"}
                values["run_id"] = dst_run
                new_rows.append(values)
                new_src.append(n["id"])
                continue
            node_map[n["id"]] = hit[0]
            if n["first_step"] < hit[1]:
                dst.execute(update(s.nodes).where(s.nodes.c.id == hit[0]).values(first_step=n["first_step"]))
        node_map.update(zip(new_src, _insert_returning_ids(dst, s.nodes, new_rows)))
        report.nodes += len(new_rows)
    return node_map


def _merge_edges(src, dst, run_map, node_map, report) -> dict[int, int]:
    """Edges matched by their nodes and slots within the run (new ones added; first_step the earliest); returns
    the input's edge id -> OUT's."""
    edge_map: dict[int, int] = {}
    for src_run, dst_run in run_map.items():
        have = {
            (a, a_slot, b, b_slot): (eid, first)
            for eid, a, a_slot, b, b_slot, first in dst.execute(
                select(
                    s.edges.c.id,
                    s.edges.c.src,
                    s.edges.c.src_slot,
                    s.edges.c.dst,
                    s.edges.c.dst_slot,
                    s.edges.c.first_step,
                ).where(s.edges.c.run_id == dst_run)
            )
        }
        new_rows, new_src = [], []
        for e in src.execute(select(s.edges).where(s.edges.c.run_id == src_run).order_by(s.edges.c.id)).mappings():
            key = (node_map[e["src"]], e["src_slot"], node_map[e["dst"]], e["dst_slot"])
            hit = have.get(key)
            if hit is None:
                new_src.append(e["id"])
                new_rows.append(
                    {
                        "run_id": dst_run,
                        "src": key[0],
                        "src_slot": key[1],
                        "dst": key[2],
                        "dst_slot": key[3],
                        "first_step": e["first_step"],
                    }
                )
                have[key] = (None, e["first_step"])
            else:  # (an input holds each edge once: its nodes and slots are unique)
                edge_map[e["id"]] = hit[0]
                if e["first_step"] < hit[1]:
                    dst.execute(update(s.edges).where(s.edges.c.id == hit[0]).values(first_step=e["first_step"]))
        edge_map.update(zip(new_src, _insert_returning_ids(dst, s.edges, new_rows)))
        report.edges += len(new_rows)
    return edge_map


def _merge_graphs(src, dst, run_map, edge_map) -> dict[int, int]:
    """graphs (revision 0012_edge_steps) matched by digest within the run (new ones added with their graph_edges;
    first_step the earliest); returns the input's graph id -> OUT's."""
    graph_map: dict[int, int] = {}
    g = s.graphs.c
    for src_run, dst_run in run_map.items():
        have = {
            digest: (gid, first)
            for gid, digest, first in dst.execute(select(g.id, g.digest, g.first_step).where(g.run_id == dst_run))
        }
        new_rows, new_src = [], []
        for row in src.execute(select(s.graphs).where(g.run_id == src_run).order_by(g.id)).mappings():
            hit = have.get(row["digest"])
            if hit is None:
                new_src.append(row["id"])
                new_rows.append({**{k: v for k, v in row.items() if k != "id"}, "run_id": dst_run})
                continue
            graph_map[row["id"]] = hit[0]
            if row["first_step"] < hit[1]:
                dst.execute(update(s.graphs).where(g.id == hit[0]).values(first_step=row["first_step"]))
        new_ids = _insert_returning_ids(dst, s.graphs, new_rows)
        graph_map.update(zip(new_src, new_ids))
        added = dict(zip(new_src, new_ids))
        for ids in _chunks(list(added), _IN):
            rows = [
                {"graph_id": added[gid], "edge_id": edge_map[eid]}
                for gid, eid in src.execute(
                    select(s.graph_edges.c.graph_id, s.graph_edges.c.edge_id).where(s.graph_edges.c.graph_id.in_(ids))
                )
            ]
            if rows:
                dst.execute(insert(s.graph_edges), rows)
    return graph_map


def _merge_one(src, dst, db: str, out: str, skip_existing: bool, tick: Callable[[int], None]) -> MergeReport:
    report = MergeReport(source=db)
    run_map, names = _merge_runs(src, dst, report)
    _merge_claims(src, dst, run_map)
    step_map = _merge_steps(src, dst, run_map, names, db, out, skip_existing, report)
    tick(len(step_map))
    node_map = _merge_nodes(src, dst, run_map, report)
    edge_map = _merge_edges(src, dst, run_map, node_map, report)
    graph_map = _merge_graphs(src, dst, run_map, edge_map)

    pass_map: dict[int, int] = {}
    for rows in _stream(src, s.passes):
        rows = [r for r in rows if r["step_id"] in step_map]
        for r in rows:
            r["step_id"] = step_map[r["step_id"]]
            r["first_call"] = r["last_call"] = None  # set below, from the calls' new ids
            if r["graph_id"] is not None:
                r["graph_id"] = graph_map[r["graph_id"]]
        src_ids = [r.pop("id") for r in rows]
        pass_map.update(zip(src_ids, _insert_returning_ids(dst, s.passes, rows)))
        tick(len(rows))
    report.passes = len(pass_map)

    call_map: dict[int, int] = {}
    ranges: dict[int, list[int]] = {}  # OUT's pass id -> [first_call, last_call]
    for rows in _stream(src, s.call_data):  # in id order: each pass's calls stay consecutive
        rows = [r for r in rows if r["pass_id"] in pass_map]
        for r in rows:
            r["pass_id"] = pass_map[r["pass_id"]]
            r["node_id"] = node_map[r["node_id"]]
        src_ids = [r.pop("id") for r in rows]
        new_ids = _insert_returning_ids(dst, s.call_data, rows)
        call_map.update(zip(src_ids, new_ids))
        tick(len(rows))
        for r, cid in zip(rows, new_ids):
            lo_hi = ranges.setdefault(r["pass_id"], [cid, cid])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], cid), max(lo_hi[1], cid)
    report.calls = len(call_map)
    if ranges:
        dst.execute(
            update(s.passes)
            .where(s.passes.c.id == bindparam("pid"))
            .values(first_call=bindparam("lo"), last_call=bindparam("hi")),
            [{"pid": pid, "lo": lo, "hi": hi} for pid, (lo, hi) in ranges.items()],
        )

    _merge_findings(src, dst, run_map, step_map, node_map)

    layout_map = _merge_layouts(src, dst)
    sharding_map = _merge_shardings(src, dst)
    td = s.tensor_data.c
    for rows in _stream(src, s.tensor_data, order_by=(td.step_id, td.node_id, td.id)):
        rows = [r for r in rows if r["step_id"] in step_map]
        side = {table: {} for table in _SIDE_TABLES}  # this chunk's rows of the tables keyed by a tensor's id
        for ids in _chunks([r["id"] for r in rows], _IN):
            for table, found in side.items():
                found.update(
                    (r["id"], dict(r)) for r in src.execute(select(table).where(table.c.id.in_(ids))).mappings()
                )
        new_ids = _reserve_tensor_ids(dst, len(rows))
        new_side = {table: [] for table in _SIDE_TABLES}
        for r, new_id in zip(rows, new_ids):
            for table, found in side.items():
                row = found.get(r["id"])
                if row is not None:
                    row = {**row, "id": new_id}
                    if table is s.tensor_shardings:  # its DTensor layout, by the layout's id in OUT
                        row["sharding_id"] = sharding_map[row["sharding_id"]]
                    new_side[table].append(row)
            r["id"] = new_id
            r["step_id"] = step_map[r["step_id"]]
            r["node_id"] = node_map[r["node_id"]]
            if r["pass_id"] is not None:
                r["pass_id"] = pass_map[r["pass_id"]]
            if r["call_id"] is not None:
                r["call_id"] = call_map[r["call_id"]]
            if r["layout_id"] is not None:
                r["layout_id"] = layout_map[r["layout_id"]]
        if rows:
            dst.execute(insert(s.tensor_data), rows)
        for table, side_rows in new_side.items():
            if side_rows:
                dst.execute(insert(table), side_rows)
        report.tensors += len(rows)
        tick(len(rows))
    _merge_loop(src, dst, run_map, step_map, node_map, names, report)
    return report


def _merge_findings(src, dst, run_map, step_map, node_map) -> None:
    """param_names (added where OUT's run lacks the name) and the per-step findings tables of the copied steps."""
    pn = s.param_names.c
    for src_run, dst_run in run_map.items():
        have = set(dst.execute(select(pn.name).where(pn.run_id == dst_run)).scalars())
        rows = []
        for r in src.execute(select(s.param_names).where(pn.run_id == src_run).order_by(pn.id)).mappings():
            if r["name"] not in have:
                have.add(r["name"])
                rows.append(
                    {**{k: v for k, v in r.items() if k != "id"}, "run_id": dst_run, "node_id": node_map[r["node_id"]]}
                )
        for chunk in _chunks(rows):
            dst.execute(insert(s.param_names), chunk)
    for table in (s.param_status, s.module_calls, s.step_nodes, s.step_warnings):
        order = (table.c.step_id, table.c.node_id) if "id" not in table.c else None
        for rows in _stream(src, table, order_by=order):
            rows = [r for r in rows if r["step_id"] in step_map]
            for r in rows:
                r.pop("id", None)
                r["step_id"] = step_map[r["step_id"]]
                if "node_id" in r:
                    r["node_id"] = node_map[r["node_id"]]
            if rows:
                dst.execute(insert(table), rows)


def _merge_loop(src, dst, run_map, step_map, node_map, names, report) -> None:
    """Step values, flight-recorder summaries (param_norms) and dumps rows of the merged steps and runs."""
    for table in (s.step_values, s.param_norms):
        for rows in _stream(src, table, order_by=(table.c.step_id,)):
            rows = [r for r in rows if r["step_id"] in step_map]
            for r in rows:
                r["step_id"] = step_map[r["step_id"]]
                if "node_id" in r:
                    r["node_id"] = node_map[r["node_id"]]
            if rows:
                dst.execute(insert(table), rows)
            if table is s.step_values:
                report.values += len(rows)
    skipped = set(report.skipped)
    dumps = [
        {**{k: v for k, v in r.items() if k != "id"}, "run_id": run_map[r["run_id"]]}
        for part in _stream(src, s.dumps)
        for r in part
        if (names[r["run_id"]], r["rank"], r["step"]) not in skipped
    ]
    if dumps:
        dst.execute(insert(s.dumps), dumps)


def _merge_layouts(src, dst) -> dict[int, int]:
    """Source layouts id -> OUT's id for the same (dtype, shape, numel), adding the ones OUT lacks."""
    lay = s.layouts.c
    have = {(d, sh, n): lid for lid, d, sh, n in dst.execute(select(lay.id, lay.dtype, lay.shape, lay.numel))}
    out = {}
    for lid, d, sh, n in src.execute(select(lay.id, lay.dtype, lay.shape, lay.numel).order_by(lay.id)):
        if (d, sh, n) not in have:
            have[(d, sh, n)] = dst.execute(
                insert(s.layouts).returning(lay.id), {"dtype": d, "shape": sh, "numel": n}
            ).scalar_one()
        out[lid] = have[(d, sh, n)]
    return out


def _merge_shardings(src, dst) -> dict[int, int]:
    """Source shardings id -> OUT's id for the same DTensor layout (matched by key), adding the ones OUT lacks."""
    c = s.shardings.c
    have = {k: i for k, i in dst.execute(select(c.key, c.id))}
    out = {}
    for row in src.execute(select(s.shardings).order_by(c.id)).mappings():
        if row["key"] not in have:
            values = {k: v for k, v in row.items() if k != "id"}
            have[row["key"]] = dst.execute(insert(s.shardings).returning(c.id), values).scalar_one()
        out[row["id"]] = have[row["key"]]
    return out


def _reserve_tensor_ids(dst, n: int) -> list[int]:
    """`n` fresh tensor ids in OUT, increasing (tensor ids increase with step_id; see gradstore.store.schema):
    SQLite: after the largest id, which is in the last step (OUT's write lock is held: the merge has written);
    PostgreSQL: from the sequence."""
    if n == 0:
        return []
    if dst.dialect.name == "postgresql":
        return list(
            dst.exec_driver_sql(f"SELECT nextval('tensor_data_id_seq') FROM generate_series(1, {int(n)})").scalars()
        )
    top = (
        dst.exec_driver_sql(
            "SELECT MAX(id) FROM tensor_data WHERE step_id = (SELECT MAX(step_id) FROM tensor_data)"
        ).scalar()
        or 0
    )
    return list(range(top + 1, top + 1 + n))
