"""Every table of a gradstore SQLite database as sorted rows, without the columns that differ between any two
recordings of the same steps (clocks, process ids, hosts), and with the autograd sequence numbers counted from the
database's lowest (a thread's counter runs on from one recording to the next): two databases of the same steps
compare equal."""

from __future__ import annotations

import sqlite3

# columns that hold times, process ids or host names
CLOCK = {"started_at", "ended_at", "duration", "setup", "finish", "start_ns", "duration_ns", "created_at"}
CLOCK |= {"finished_at", "heartbeat", "heartbeat_at", "pid", "host", "taken_at", "since", "seen_at", "meta"}


# columns that hold autograd sequence numbers (`grad_fn._sequence_nr()`): relative to the lowest in the database
SEQUENCE_NR = {("call_data", "sequence_nr")}


def tables(path) -> dict:
    """{table: sorted rows without CLOCK columns} of the SQLite database at `path` (claims left out: they are
    live); SEQUENCE_NR columns minus their lowest value."""
    con = sqlite3.connect(path)
    out = {}
    for (table,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name != 'claims'"):
        cols = [r[1] for r in con.execute(f"PRAGMA table_info({table})") if r[1] not in CLOCK]
        shown = []
        for c in cols:
            if (table, c) in SEQUENCE_NR:
                low = con.execute(f"SELECT MIN({c}) FROM {table}").fetchone()[0] or 0
                c = f"{c} - {int(low)}"
            shown.append(c)
        out[table] = sorted(con.execute(f"SELECT {', '.join(shown)} FROM {table}").fetchall(), key=repr)
    con.close()
    return out
