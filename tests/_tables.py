"""Every table of a gradstore SQLite database as sorted rows, without the columns that differ between any two
recordings of the same steps (clocks, process ids, hosts): two databases of the same steps compare equal."""

from __future__ import annotations

import sqlite3

# columns that hold times, process ids or host names
CLOCK = {"started_at", "ended_at", "duration", "setup", "finish", "start_ns", "duration_ns", "created_at"}
CLOCK |= {"finished_at", "heartbeat", "heartbeat_at", "pid", "host", "taken_at", "since", "seen_at", "meta"}


def tables(path) -> dict:
    """{table: sorted rows without CLOCK columns} of the SQLite database at `path` (claims left out: they are
    live)."""
    con = sqlite3.connect(path)
    out = {}
    for (table,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name != 'claims'"):
        cols = [r[1] for r in con.execute(f"PRAGMA table_info({table})") if r[1] not in CLOCK]
        out[table] = sorted(con.execute(f"SELECT {', '.join(cols)} FROM {table}").fetchall(), key=repr)
    con.close()
    return out
