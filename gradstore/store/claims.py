"""One writer per (run, rank): the claims table (revision 0007_faults).

A process that records a rank of a run claims it first (`take`, in the transaction that opens the run): one row per
(run, rank) with the process's pid and host, when it started, and a heartbeat that the process's writer thread
renews every `heartbeat_interval()` seconds (`renew`). The claim stands while `heartbeat_at + lease` is in the
future (lease: LEASE_HEARTBEATS heartbeats), and, when its holder runs on this host, while its pid is alive. A
second process claiming a rank whose claim stands gets `RankInUse`; a claim that no longer stands (its holder was
killed, or its machine lost) is taken over, so a restarted job resumes its record; the claims row as it stood then
is kept in past_claims (revision 0017_claim_history), so that an interruption stays on record after a resume. The
holder releases its claim when its scope ends (`release`), and the row stays (revision 0013_rank_ends) with how the
scope ended (`end`: finished / error, when, and where an error ended it) and when the claim was released, so that a
run's status is the aggregate over its ranks: running while a rank's writer is live, interrupted where a rank's
process died with its scope open, error where a rank raised, finished when every rank that recorded ended cleanly
(queries/runs.sql and queries/run_ranks.sql read it; `end` also stores that aggregate in runs.status, as far as it
can be known without a clock: a rank whose scope is open counts as running there). Readers on this host also bind
`dead` (the held claims whose pid is gone) so that a writer killed here reads as interrupted at once.

PostgreSQL: the claiming transaction takes an advisory lock on (run_id, rank) first, so two processes claiming
the same rank take turns; SQLite: the writer's transactions hold the file's write lock (BEGIN IMMEDIATE).
"""

from __future__ import annotations

import os
import socket
import time

from sqlalchemy import func, insert, select, update

from ..errors import RankInUse
from ..records import RankEnd
from . import schema as s

HEARTBEAT_S = 10.0  # seconds between heartbeats (the environment's GRADSTORE_HEARTBEAT_S overrides it)
LEASE_HEARTBEATS = 6  # a claim stands this many heartbeats after the last one


# a claim taken (again): no scope of it has ended yet
_OPEN = {"status": None, "ended_at": None, "ended_step": None, "error": None, "released_at": None}


def heartbeat_interval() -> float:
    """Seconds between a writer's heartbeats: $GRADSTORE_HEARTBEAT_S when set (a positive number), else
    HEARTBEAT_S."""
    value = os.environ.get("GRADSTORE_HEARTBEAT_S")
    try:
        return max(float(value), 0.01) if value else HEARTBEAT_S
    except ValueError:
        return HEARTBEAT_S


def lease() -> float:
    """Seconds a claim stands after its last heartbeat (LEASE_HEARTBEATS heartbeats)."""
    return LEASE_HEARTBEATS * heartbeat_interval()


def this_host() -> str:
    """The host name claims record (`socket.gethostname()`)."""
    return socket.gethostname()


def pid_alive(pid: int) -> bool:
    """True when process `pid` exists on this host and is not a zombie (killed, not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, but another user's
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def stands(row, now: float, host: str | None = None) -> bool:
    """True when the claim `row` (a claims row: pid, host, heartbeat_at, lease) still holds its rank at time
    `now` (s since the epoch): it is not released, its heartbeat is within its lease and, where its holder is on
    this host, the holder's pid is alive."""
    if getattr(row, "released_at", None) is not None:
        return False
    if row.heartbeat_at + row.lease < now:
        return False
    if row.host == (host or this_host()) and not pid_alive(row.pid):
        return False
    return True


def take(conn, run_id: int, rank: int, run_name: str) -> None:
    """Claim (run_id, rank) for this process inside the caller's transaction: insert the claim, renew it when
    it is already this process's, or take it over when its holder no longer stands.

    Raises RankInUse (naming the holder's pid, host and heartbeat, and what to do) when another process's claim
    stands.
    """
    now, host, pid = time.time(), this_host(), os.getpid()
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({int(run_id)}, {int(rank)})")
    c = s.claims.c
    row = conn.execute(select(s.claims).where(c.run_id == run_id, c.rank == rank)).first()
    mine = {"pid": pid, "host": host, "started_at": now, "heartbeat_at": now, "lease": lease(), **_OPEN}
    if row is None:
        conn.execute(insert(s.claims).values(run_id=run_id, rank=rank, **mine))
        return
    if (row.pid, row.host) != (pid, host) and stands(row, now, host):
        raise RankInUse(
            f"rank {rank} of run {run_name!r} is being written by process {row.pid} on {row.host} (claimed "
            f"{now - row.started_at:.0f} s ago, last heartbeat {now - row.heartbeat_at:.0f} s ago): two processes "
            "writing one rank would mix their steps. Give this process a rank of its own (torchrun sets RANK; or "
            "call init_process_group before the scope) or another run name, or end the other process. A claim "
            f"whose process died is taken over: at once on the same host, else {row.lease:.0f} s after its last "
            "heartbeat"
        )
    if (row.pid, row.host) != (pid, host):  # another process's claim: kept (past_claims), then taken over
        _keep(conn, row, now, pid, host)
    conn.execute(update(s.claims).where(c.id == row.id).values(**mine))


def _keep(conn, row, now: float, pid: int, host: str) -> None:
    """Keep the claims row `row` as it stands (revision 0017_claim_history: past_claims) before process `pid` on
    `host` takes its rank over at `now`, with the rank's highest step written until then."""
    st = s.steps.c
    last = conn.execute(
        select(func.max(st.step)).where(st.run_id == row.run_id, st.rank == row.rank, st.status != s.UNWRITTEN)
    ).scalar()
    kept = {k: getattr(row, k) for k in _KEPT}
    conn.execute(
        insert(s.past_claims).values(
            run_id=row.run_id,
            rank=row.rank,
            **kept,
            last_step=last,
            taken_at=now,
            taken_by_pid=pid,
            taken_by_host=host,
        )
    )


_KEPT = (
    "pid",
    "host",
    "started_at",
    "heartbeat_at",
    "lease",
    "status",
    "ended_at",
    "ended_step",
    "error",
    "released_at",
)


def renew(conn, keys) -> list[tuple[int, int]]:
    """Renew this process's claims on `keys` ((run_id, rank) pairs) at the current time; returns the keys
    that are no longer this process's (another process took them over)."""
    now, host, pid = time.time(), this_host(), os.getpid()
    c = s.claims.c
    lost = []
    for run_id, rank in keys:
        n = conn.execute(
            update(s.claims)
            .where(c.run_id == run_id, c.rank == rank, c.pid == pid, c.host == host, c.released_at.is_(None))
            .values(heartbeat_at=now, lease=lease())
        ).rowcount
        if n == 0:
            lost.append((run_id, rank))
    return lost


def release(conn, run_id: int, rank: int) -> None:
    """Give back this process's claim on (run_id, rank), if it still holds it: the row stays, with `released_at`
    (how its scope ended was written before, by `end`)."""
    c = s.claims.c
    conn.execute(
        update(s.claims)
        .where(c.run_id == run_id, c.rank == rank, c.pid == os.getpid(), c.host == this_host(), c.released_at.is_(None))
        .values(released_at=time.time())
    )


def end(cur, pg: bool, run_id: int, rank: int, how: RankEnd) -> None:
    """On the writer's DB-API cursor `cur`, inside its transaction (`pg`: PostgreSQL's driver): record that the
    scope of process `how.pid` (on this host) on (run_id, rank) ended as `how` says (its claims row: status,
    ended_at, ended_step, error; nothing when another process took the rank over), then store the run's status as
    the aggregate over its ranks' rows: running while some rank's scope is open, else error where a rank ended with
    one, else `how.status`; finished_at NULL while running. On PostgreSQL the run's row is locked first, so that
    two ranks ending at once each see the other's end (READ COMMITTED would otherwise let both read the other as
    still running); on SQLite the transaction holds the file's write lock already."""
    sql = _END_SQL["%s" if pg else "?"]
    if pg:
        # NO KEY UPDATE: ranks' ends take turns, while the KEY SHARE locks that the step's rows (foreign keys to
        # the run) hold in other ranks' transactions do not block it (FOR UPDATE would deadlock with them)
        cur.execute(sql[0], (run_id,))
        cur.fetchall()
    cur.execute(sql[1], (how.status, how.at, how.step, how.error, run_id, rank, how.pid or os.getpid(), this_host()))
    cur.execute(sql[2], (run_id, run_id, how.status, run_id, how.at, run_id))


def _end_sql(mark: str) -> tuple[str, str, str]:
    """`end`'s statements for the driver's parameter mark: lock the run (PostgreSQL), the rank's end, the run's
    status as the aggregate (the driver's own SQL: run at each scope end, also each call of a decorated function)."""
    open_ = f"EXISTS (SELECT 1 FROM claims c WHERE c.run_id = {mark} AND c.status IS NULL AND c.released_at IS NULL)"
    return (
        f"SELECT id FROM runs WHERE id = {mark} FOR NO KEY UPDATE",
        f"UPDATE claims SET status = {mark}, ended_at = {mark}, ended_step = {mark}, error = {mark} "
        f"WHERE run_id = {mark} AND rank = {mark} AND pid = {mark} AND host = {mark}",
        f"UPDATE runs SET status = CASE WHEN {open_} THEN 'running' "
        f"WHEN EXISTS (SELECT 1 FROM claims c WHERE c.run_id = {mark} AND c.status = 'error') THEN 'error' "
        f"ELSE {mark} END, finished_at = CASE WHEN {open_} THEN NULL ELSE {mark} END WHERE id = {mark}",
    )


_END_SQL = {mark: _end_sql(mark) for mark in ("?", "%s")}


def dead(conn) -> list[int]:
    """The ids of the claims held (not released) by a process on this host that is gone (`pid_alive`): what a
    reader here binds as the queries' `dead` parameter (queries/runs.sql, run_ranks.sql), since SQL sees no pid."""
    c = s.claims.c
    rows = conn.execute(select(c.id, c.pid).where(c.host == this_host(), c.released_at.is_(None))).fetchall()
    return [row.id for row in rows if not pid_alive(row.pid)]
