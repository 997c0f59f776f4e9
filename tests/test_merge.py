"""`gradstore merge OUT IN...` (gradstore.store.merge.merge): per-rank files joined into one database.

Rank 0 records into a.db and rank 1 into b.db (gradstore.recording.recorder._rank_and_world_size monkeypatched to (0, 2)
and (1, 2)); each step has two micro-batches, and rank 1 scales parameter 0.bias's gradient by 1.25. Row counts
are taken with plain sqlite3 on the files; query results on the merged file must equal those on the sources.
"""

import sqlite3

import pandas as pd
import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner

import gradstore
from gradstore.cli import main
from gradstore.recording import recorder
from gradstore.store.merge import MergeConflict, merge

STEPS = 3
TABLES = ("steps", "passes", "calls", "tensors")


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 1))


def record_rank(db, rank, monkeypatch, run="job"):
    monkeypatch.setattr(recorder, "_rank_and_world_size", lambda: (rank, 2))
    model = make_model()
    handle = model[0].bias.register_hook(lambda g: g * 1.25) if rank == 1 else None
    g = torch.Generator().manual_seed(1)
    with gradstore.record(run, db=db, model=model, checksum=True) as rec:  # checksums: merged too
        for i in range(STEPS):
            for _ in range(2):  # micro-batches: two passes per step
                model(torch.randn(3, 4, generator=g)).pow(2).mean().backward()
            model.zero_grad()
            if i < STEPS - 1:
                rec.step()
    if handle is not None:
        handle.remove()


def count(path, table, rank=None):
    """Rows of `table` (of the steps of `rank`), counted with plain sqlite3."""
    con = sqlite3.connect(path)
    try:
        if table == "steps":
            sql, args = "SELECT COUNT(*) FROM steps WHERE (? IS NULL OR rank = ?)", (rank, rank)
        else:
            sql = f"SELECT COUNT(*) FROM {table} x JOIN steps st ON st.id = x.step_id WHERE (? IS NULL OR st.rank = ?)"
            args = (rank, rank)
        return con.execute(sql, args).fetchone()[0]
    finally:
        con.close()


def scalar(path, sql):
    con = sqlite3.connect(path)
    try:
        return con.execute(sql).fetchone()[0]
    finally:
        con.close()


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    d = tmp_path_factory.mktemp("merge")
    a, b = str(d / "a.db"), str(d / "b.db")
    mp = pytest.MonkeyPatch()
    try:
        record_rank(a, 0, mp)
        record_rank(b, 1, mp)
    finally:
        mp.undo()
    gradstore.open(a).close()  # waits for this process's writers
    gradstore.open(b).close()
    return a, b


def canonical(df: pd.DataFrame) -> pd.DataFrame:
    """Rows in a fixed order (ties in a query's ORDER BY may come out in either order)."""
    return df.sort_values(list(df.columns), na_position="first").reset_index(drop=True)


def test_merge_counts_every_row_and_queries_agree(sources, tmp_path):
    a, b = sources
    out = str(tmp_path / "out.db")
    reports = merge(out, [a, b])
    assert [r.source for r in reports] == [a, b]
    assert (reports[0].runs_created, reports[1].runs_matched) == (["job"], ["job"])
    for rank, src, report in ((0, a, reports[0]), (1, b, reports[1])):
        for table in TABLES:
            assert count(out, table, rank) == count(src, table) > 0, (table, rank)
        assert (report.steps, report.passes, report.calls, report.tensors) == tuple(count(src, t) for t in TABLES)
        assert report.ranks == [rank]
    for table in TABLES:
        assert count(out, table) == count(a, table) + count(b, table)
    # nodes matched by key, edges de-duplicated: the two ranks ran the same graph
    assert scalar(out, "SELECT COUNT(*) FROM nodes") == scalar(a, "SELECT COUNT(*) FROM nodes")
    assert scalar(out, "SELECT COUNT(*) FROM edges") == scalar(a, "SELECT COUNT(*) FROM edges")
    assert (reports[1].nodes, reports[1].edges) == (0, 0)
    assert scalar(out, "SELECT COUNT(*) FROM param_names") == scalar(a, "SELECT COUNT(*) FROM param_names") > 0
    assert count(out, "param_status") == count(a, "param_status") + count(b, "param_status") > 0
    assert count(out, "module_calls") == count(a, "module_calls") + count(b, "module_calls") > 0
    with gradstore.open(out) as merged, gradstore.open(a) as sa, gradstore.open(b) as sb:
        assert merged.runs().set_index("run").loc["job", "world_size"] == 2
        for rank, src in ((0, sa), (1, sb)):
            for name in (
                "steps",
                "passes",
                "calls",
                "tensors",
                "param_grads",
                "grad_norms",
                "param_status",  # the step findings travel with their steps
                "module_gains",
                "never_ran",
                "node_births",
                "warnings",
            ):
                got = getattr(merged, name)("job", rank=rank)
                want = getattr(src, name)("job", rank=rank)
                pd.testing.assert_frame_equal(canonical(got), canonical(want), obj=f"{name} rank {rank}")
            got = merged.history("job", key="0/AddmmBackward0#0", rank=rank)
            pd.testing.assert_frame_equal(canonical(got), canonical(src.history("job", key="0/AddmmBackward0#0")))
        pd.testing.assert_frame_equal(canonical(merged.nodes("job")), canonical(sa.nodes("job")))
        pd.testing.assert_frame_equal(canonical(merged.edges("job")), canonical(sb.edges("job")))
        # what merging is for: the ranks side by side
        bad = merged.rank_divergence("job")
        assert list(zip(bad.step, bad.param, bad.stage)) == [
            (s, "0.bias", stage) for s in range(STEPS) for stage in ("backward", "final")
        ]


def test_merge_again_is_a_conflict_unless_skipped(sources, tmp_path):
    a, b = sources
    out = str(tmp_path / "out.db")
    merge(out, [a])
    before = {t: count(out, t) for t in TABLES}
    with pytest.raises(
        MergeConflict,
        match=r"run 'job' rank 0 step 0 of .*a\.db is already in .*out\.db "
        r"\(and 2 more steps\); nothing was merged",
    ):
        merge(out, [b, a])  # b would merge, then a conflicts: one transaction, so b is not kept either
    assert {t: count(out, t) for t in TABLES} == before
    reports = merge(out, [a, b], skip_existing=True)
    assert reports[0].skipped == [("job", 0, s) for s in range(STEPS)] and reports[0].steps == 0
    assert reports[1].steps == STEPS and not reports[1].skipped
    for table in TABLES:
        assert count(out, table) == count(a, table) + count(b, table)


def test_merge_refuses_bad_inputs_and_leaves_no_new_file(sources, tmp_path):
    a, b = sources
    with pytest.raises(gradstore.GradstoreError, match="into itself"):
        merge(a, [b, a])
    with pytest.raises(gradstore.GradstoreError, match="given twice"):
        merge(str(tmp_path / "o.db"), [a, a])
    with pytest.raises(gradstore.DatabaseNotFound):
        merge(str(tmp_path / "o.db"), [str(tmp_path / "missing.db")])
    copy = str(tmp_path / "copy.db")  # the same steps under another path (sqlite3's backup: WAL included)
    src, dst = sqlite3.connect(a), sqlite3.connect(copy)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()
    out = tmp_path / "new.db"
    with pytest.raises(MergeConflict):
        merge(str(out), [a, copy])
    assert not out.exists()


def invoke(*args):
    return CliRunner().invoke(main, [str(x) for x in args], catch_exceptions=False)


def test_cli_merge(sources, tmp_path):
    a, b = sources
    out = tmp_path / "cli.db"
    result = invoke("merge", out, a, b)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith(
        f"{a}: run 'job' (new): {STEPS} steps of rank 0, {count(a, 'passes')} passes, "
        f"{count(a, 'calls')} calls, {count(a, 'tensors')} tensors"
    )
    assert lines[1].startswith(f"{b}: run 'job': {STEPS} steps of rank 1")
    assert lines[-1] == f"merged 2 databases into {out}"
    again = invoke("merge", out, b)
    assert again.exit_code == 1 and "Traceback" not in again.output
    errors = again.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("Error: run 'job' rank 1 step 0")
    assert "--skip-existing" in errors[0]
    skipped = invoke("merge", out, b, "--skip-existing")
    assert skipped.exit_code == 0 and f"{STEPS} steps already in {out} skipped" in skipped.output
    usage = invoke("merge", out)
    assert usage.exit_code == 2
    ranks = invoke("ranks", out, "job", "--step", 0)
    assert "ranks differ at step 0: 1 of 4 parameter gradients differ (ranks 0, 1)" in ranks.output


def test_merge_into_postgresql_keeps_every_value(sources, pg_url):
    """Two SQLite files merged into PostgreSQL: tensor ids from its sequence, layouts matched, checksums carried
    (tensor_notes), and the queries give what they give on the sources."""
    a, b = sources
    reports = merge(pg_url, [a, b])
    assert [r.tensors for r in reports] == [count(a, "tensors"), count(b, "tensors")]
    with gradstore.open(pg_url) as merged, gradstore.open(a) as sa, gradstore.open(b) as sb:
        for rank, src in ((0, sa), (1, sb)):
            for name in ("tensors", "param_grads", "grad_norms"):
                got = getattr(merged, name)("job", rank=rank)
                want = getattr(src, name)("job", rank=rank)
                pd.testing.assert_frame_equal(canonical(got), canonical(want), obj=f"{name} rank {rank}")
            got = merged.history("job", key="0/AddmmBackward0#0", rank=rank)
            pd.testing.assert_frame_equal(canonical(got), canonical(src.history("job", key="0/AddmmBackward0#0")))
        assert merged.history("job", param="0.bias", role="param_grad")["checksum"].notna().all()
        bad = merged.rank_divergence("job")
        assert list(zip(bad.step, bad.param, bad.compared, bad.stage)) == [
            (s, "0.bias", "checksum", stage) for s in range(STEPS) for stage in ("backward", "final")
        ]


def test_rows_keyed_by_a_tensor_id_follow_it(tmp_path, monkeypatch):
    """Revision 0008_inside's side tables (slices, values, saved versions, forward seqs) are copied with their
    tensors under the new ids: every helper reads the same on the merged file as on the sources."""
    inside = dict(slices="*", values="*", forward=True, saved=True)
    for rank, name in ((0, "a.db"), (1, "b.db")):
        monkeypatch.setattr(recorder, "_rank_and_world_size", lambda rank=rank: (rank, 2))
        model = make_model()
        with gradstore.record("job", db=str(tmp_path / name), model=model, **inside):
            model(torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))).pow(2).mean().backward()
    out = str(tmp_path / "out.db")
    merge(out, [str(tmp_path / "a.db"), str(tmp_path / "b.db")])
    with gradstore.open(out) as merged:
        for rank, name in ((0, "a.db"), (1, "b.db")):
            with gradstore.open(str(tmp_path / name)) as src:
                for helper in ("slices", "activations", "losses", "saved"):
                    a = getattr(src, helper)("job", rank=rank)
                    b = getattr(merged, helper)("job", rank=rank)
                    assert len(a) > 0 and a.equals(b), helper
                assert torch.equal(
                    src.tensor("job", param="0.bias", rank=rank), merged.tensor("job", param="0.bias", rank=rank)
                )
            assert len(merged.losses("job", rank=rank)) == 1


def _record_flight(db, rank, monkeypatch):
    """A flight-recorder run of rank `rank`: step values, summaries, and a dump at the NaN of step 3."""
    monkeypatch.setattr(recorder, "_rank_and_world_size", lambda: (rank, 2))
    model = make_model()
    g = torch.Generator().manual_seed(10 + rank)
    with gradstore.record("loop", db=db, model=model, keep=2) as rec:
        for i in range(5):
            x = torch.randn(3, 4, generator=g)
            if i == 3:
                x[0, 0] = float("nan")
            loss = model(x).pow(2).mean()
            loss.backward()
            rec.log(loss=loss, rank_value=rank)
            model.zero_grad()
            if i < 4:
                rec.step()


def test_merge_carries_step_values_summaries_and_dumps(tmp_path, monkeypatch):
    a, b, out = (str(tmp_path / n) for n in ("a.db", "b.db", "out.db"))
    _record_flight(a, 0, monkeypatch)
    _record_flight(b, 1, monkeypatch)
    reports = merge(out, [a, b])
    assert [r.values for r in reports] == [10, 10]  # 5 steps x 2 names each
    merged = gradstore.open(out)
    sources = [gradstore.open(a), gradstore.open(b)]
    expected = pd.concat([s.values("loop") for s in sources]).sort_index()
    pd.testing.assert_frame_equal(merged.values("loop").sort_index(), expected)
    for frame in ("param_norms", "dumps"):
        got = getattr(merged, frame)("loop").drop(columns=["at"], errors="ignore")
        want = pd.concat([getattr(s, frame)("loop") for s in sources]).drop(columns=["at"], errors="ignore")
        pd.testing.assert_frame_equal(
            got.sort_values(list(got.columns[:4])).reset_index(drop=True),
            want.sort_values(list(want.columns[:4])).reset_index(drop=True),
        )
    assert list(merged.dumps("loop")["rank"]) == [0, 1]
    levels = merged.steps("loop").set_index(["rank", "step"])["level"]
    assert list(levels.loc[0]) == ["summary", "summary", "full", "full", "summary"] == list(levels.loc[1])


def test_the_graphs_each_step_walked_are_merged(tmp_path, monkeypatch):
    """A data-dependent branch (b on even steps only) recorded by two ranks into two files: after the merge, the
    edges of each step and rank are those that held there (as each source has them), each graph stored once."""

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b, self.c = nn.Linear(3, 3), nn.Linear(3, 3), nn.Linear(3, 1)

        def forward(self, x):
            h = self.a(x)
            return self.c(self.b(h) if x.sum() > 0 else h)

    paths = []
    for rank in (0, 1):
        path = str(tmp_path / f"r{rank}.db")
        monkeypatch.setattr(recorder, "_rank_and_world_size", lambda rank=rank: (rank, 2))
        model = Branchy()
        with gradstore.record("job", db=path, model=model) as rec:
            for step in range(3):
                model(torch.full((2, 3), 1.0 if (step + rank) % 2 == 0 else -1.0)).sum().backward()
                rec.step()
        gradstore.open(path).close()
        paths.append(path)
    out = str(tmp_path / "out.db")
    merge(out, paths)
    cols = ["src", "src_slot", "dst", "dst_slot", "held"]
    with gradstore.open(out) as merged:
        for rank, path in enumerate(paths):
            with gradstore.open(path) as src:
                for step in range(3):
                    got, want = merged.edges("job", step=step, rank=rank), src.edges("job", step=step)
                    pd.testing.assert_frame_equal(canonical(got[cols]), canonical(want[cols]), obj=f"{rank} {step}")
                    assert (got.held == "yes").all()
        # rank 0's step 0 (b ran) and rank 1's step 0 (b did not) differ
        assert "b/AddmmBackward0#0" in set(merged.edges("job", step=0, rank=0).dst)
        assert "b/AddmmBackward0#0" not in set(merged.edges("job", step=0, rank=1).dst)
    assert scalar(out, "SELECT COUNT(*) FROM graphs") == 2 == scalar(paths[0], "SELECT COUNT(*) FROM graphs")


def test_merge_keeps_each_ranks_end_and_the_run_is_their_aggregate(tmp_path, monkeypatch):
    """Rank 0's scope ends cleanly in a.db, rank 1's raises at its step 1 in b.db: merged (b first, so that the
    clean rank is merged last), the run is an error, and each rank's end (its claims row: status, step, error) is
    as its own file has it."""
    a, b, out = (str(tmp_path / n) for n in ("a.db", "b.db", "out.db"))
    record_rank(a, 0, monkeypatch, run="ends")
    monkeypatch.setattr(recorder, "_rank_and_world_size", lambda: (1, 2))
    model = make_model()
    with pytest.raises(RuntimeError, match="rank 1 stopped"):
        with gradstore.record("ends", db=b, model=model) as rec:
            model(torch.ones(3, 4)).sum().backward()
            rec.step()
            raise RuntimeError("rank 1 stopped")
    gradstore.record("ends", db=b).flush()
    merge(out, [b, a])
    with gradstore.open(out) as store:
        assert store.runs("ends").iloc[0]["status"] == "error"
        ranks = store.run_ranks("ends").set_index("rank")
    assert list(ranks["status"]) == ["finished", "error"]
    assert ranks.loc[1, "ended_step"] == 1 and ranks.loc[1, "error"] == "RuntimeError: rank 1 stopped"
