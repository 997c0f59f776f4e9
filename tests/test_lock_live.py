"""A running recording meets a database another connection has locked (a real second sqlite3 connection holding
BEGIN EXCLUSIVE; busy timeouts lowered through the module constants so that the test takes seconds).

- Ctrl-C (here `_thread.interrupt_main`) while `rec.step()` waits for room in the writer's queue reaches the loop
  at once, not when the lock goes; the step whose hand-over it met is written (nothing of it lost), its row says
  what came, and the run's error is on that step, not on a next one that ran no backward pass.
- A writer blocked by the lock warns while it lasts (naming the file and the fix), before any step is given up,
  and says when writing goes on; every step is then written.
"""

from __future__ import annotations

import _thread
import sqlite3
import threading
import time
import warnings

import torch
from torch import nn

import gradstore
from gradstore.recording import recorder
from gradstore.store import database, writer


def _lock(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("BEGIN EXCLUSIVE")
    return conn


def _steps(path: str, run: str) -> list[tuple]:
    with sqlite3.connect(path) as conn:
        return conn.execute(
            "SELECT st.step, st.status, st.error, st.waited FROM steps st JOIN runs r ON r.id = st.run_id "
            "WHERE r.name = ? ORDER BY st.step",
            (run,),
        ).fetchall()


def test_ctrl_c_while_rec_step_waits_reaches_the_loop_and_stays_on_its_step(tmp_path, monkeypatch):
    monkeypatch.setattr(database, "SQLITE_BUSY_TIMEOUT_MS", 20_000)  # no step is given up while the lock lasts
    monkeypatch.setattr(recorder, "INTERRUPT_FLUSH_S", 0.3)
    path, hold_s = str(tmp_path / "ki.db"), 5.0
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    at: dict[str, float] = {}
    released = threading.Event()

    def interrupt_then_release(conn):
        try:
            time.sleep(0.5)
            at["interrupt"] = time.monotonic()
            _thread.interrupt_main()
            time.sleep(hold_s)
        finally:
            conn.execute("COMMIT")
            conn.close()
            released.set()

    step = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with gradstore.record("ki", db=path, model=model, queue_rows=1) as rec:
                for step in range(10_000):
                    if step == 3:
                        rec.flush()
                        threading.Thread(target=interrupt_then_release, args=(_lock(path),), daemon=True).start()
                    model(torch.randn(2, 4)).sum().backward()
                    rec.step()
        except KeyboardInterrupt:
            at["caught"] = time.monotonic()
    assert "caught" in at, "the interrupt never reached the loop"
    assert at["caught"] - at["interrupt"] < 2.5, at  # not held back until the lock goes (hold_s)
    assert step is not None and step >= 4  # it came in a rec.step() that waited for the locked writer
    assert released.wait(hold_s + 5)
    store = gradstore.open(path)  # waits for the writer, which writes what was queued once the lock is gone
    rows = _steps(path, "ki")
    assert [r[0] for r in rows] == list(range(step + 1))  # the interrupted step is there; no step after it
    last = rows[-1]
    assert last[1] == "ok" and "KeyboardInterrupt" in last[2] and "waited" in last[2]
    assert all(r[2] is None for r in rows[:-1])
    ranks = store.runs().set_index("run").loc["ki", "ranks"]
    assert f"error at step {step}: KeyboardInterrupt" in ranks


def test_a_writer_blocked_by_a_lock_warns_while_it_lasts_and_when_it_ends(tmp_path, monkeypatch):
    monkeypatch.setattr(database, "SQLITE_BUSY_TIMEOUT_MS", 20_000)  # no busy timeout expires: no step given up
    monkeypatch.setattr(writer, "LOCK_WARN_S", 0.3)
    path, hold_s = str(tmp_path / "lk.db"), 2.0
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    seen: dict[str, int] = {}

    def blocked(ws):
        return [w for w in ws if issubclass(w.category, gradstore.WriteFailedWarning) and "waited" in str(w.message)]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def release(conn):
            time.sleep(hold_s)
            seen["before"] = len(blocked(list(caught)))
            conn.execute("COMMIT")
            conn.close()

        with gradstore.record("lk", db=path, model=model, queue_rows=1) as rec:
            for step in range(8):
                if step == 2:
                    rec.flush()
                    t = threading.Thread(target=release, args=(_lock(path),), daemon=True)
                    t.start()
                model(torch.randn(2, 4)).sum().backward()
                rec.step()
        t.join()
    assert seen["before"] >= 1  # said while the lock lasted
    text = str(blocked(caught)[0].message)
    assert path in text and "write lock" in text and "on_full='drop'" in text and "held by another connection" in text
    assert any("got the write lock" in str(w.message) for w in caught)
    rows = _steps(path, "lk")
    assert [r[0] for r in rows] == list(range(8)) and {r[1] for r in rows} == {"ok"}
    assert sum(r[3] for r in rows) > 1.0  # the loop did wait for the writer (on_full='wait'): steps.waited says so
