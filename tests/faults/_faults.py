"""Helpers of the fault tests: a small model whose rows per step are counted with plain PyTorch, forked children
that can be killed with SIGKILL at a chosen moment, a committed revision-0001 file made big, read-only files
that root cannot write either, and a reader that is not root."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import signal
import sqlite3
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn

ASSETS = Path(__file__).resolve().parents[1] / "assets"
FEATURES = 6
NOBODY = 65534


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))


def batch(step: int) -> torch.Tensor:
    """The input of step `step` (the same in every process)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(8, FEATURES, generator=g)


def plain_counts() -> dict:
    """One backward pass of `model()` seen by plain PyTorch node hooks: node calls, and tensor rows (each call's
    grad_output and grad_input slots, plus one param_grad row per parameter)."""
    m = model()
    loss = m(batch(0)).pow(2).mean()
    nodes, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        nodes.append(n)
        stack.extend(nxt for nxt, _ in n.next_functions)
    counts = {"calls": 0, "slots": 0}

    def pre(grad_outputs):
        counts["calls"] += 1
        counts["slots"] += len(grad_outputs)

    def post(grad_inputs, grad_outputs):
        counts["slots"] += len(grad_inputs)

    handles = [h for n in nodes for h in (n.register_prehook(pre), n.register_hook(post))]
    loss.backward()
    for h in handles:
        h.remove()
    # each parameter's .grad twice: after the pass (param_grad), and as the step left it (the final row)
    return {"calls": counts["calls"], "tensors": counts["slots"] + 2 * len(list(m.parameters()))}


def whole_steps(db, run: str) -> list[int]:
    """The step numbers of `run` in `db` (read with sqlite3), after checking that each is whole: one pass, the
    calls and tensor rows plain PyTorch counts for one step, the pass's call id range holding its calls."""
    expected = plain_counts()
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = con.execute(
            """SELECT st.step, st.passes, st.status,
                      (SELECT COUNT(*) FROM passes p WHERE p.step_id = st.id),
                      (SELECT COUNT(*) FROM calls c WHERE c.step_id = st.id),
                      (SELECT COUNT(*) FROM tensors t WHERE t.step_id = st.id),
                      (SELECT COUNT(*) FROM passes p JOIN call_data c ON c.id BETWEEN p.first_call AND p.last_call
                       WHERE p.step_id = st.id AND c.pass_id = p.id)
               FROM steps st JOIN runs r ON r.id = st.run_id WHERE r.name = ? ORDER BY st.step""",
            (run,),
        ).fetchall()
    finally:
        con.close()
    for step, passes, status, n_passes, calls, tensors, in_range in rows:
        assert (passes, n_passes, status) == (1, 1, "ok"), (step, passes, n_passes, status)
        assert (calls, tensors, in_range) == (expected["calls"], expected["tensors"], expected["calls"]), step
    return [r[0] for r in rows]


# ---- processes ------------------------------------------------------------------------------------------------
def _one_thread(target, *args):
    # a forked child of a process whose OpenMP thread team ran (torch's intra-op parallelism) can hang in its
    # first parallel op; with one intra-op thread torch runs every op inline, as tests/_procs.py's children do
    torch.set_num_threads(1)
    target(*args)


def fork(target, *args) -> mp.Process:
    """Start target(*args) in a forked process (torch is not imported again), with one intra-op thread."""
    p = mp.get_context("fork").Process(target=_one_thread, args=(target, *args), daemon=True)
    p.start()
    return p


def kill9(p: mp.Process) -> bool:
    """SIGKILL `p` and reap it; True when it was still running (the kill landed)."""
    alive = p.is_alive()
    if p.pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    return alive


# ---- databases -------------------------------------------------------------------------------------------------
def inflate_0001(dst: Path, copies: int) -> None:
    """tests/assets/rev0001.db with its 2 steps copied `copies` more times (new ids, later step numbers, the same
    nodes), still at revision 0001: a file whose upgrade takes long enough to be killed half-way."""
    shutil.copy(ASSETS / "rev0001.db", dst)
    con = sqlite3.connect(dst)
    top = {t: con.execute(f"SELECT MAX(id) FROM {t}").fetchone()[0] for t in ("steps", "passes", "calls", "tensors")}
    n_steps = con.execute("SELECT MAX(step) + 1 FROM steps").fetchone()[0]
    k = f"WITH RECURSIVE k(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM k WHERE n < {copies}) "
    S, P, C, T = top["steps"], top["passes"], top["calls"], top["tensors"]
    con.execute(
        k + f"INSERT INTO steps SELECT s.id + n * {S}, run_id, rank, step + n * {n_steps}, started_at, ended_at, "
        f"status, error, passes, level, dropped, waited FROM steps s, k WHERE s.id <= {S}"
    )
    con.execute(
        k + f"INSERT INTO passes SELECT p.id + n * {P}, step_id + n * {S}, pass, parent_pass, parent_seq, kind, "
        f"create_graph, retain_graph, roots, inputs, nodes, started_at, duration, setup, finish "
        f"FROM passes p, k WHERE p.id <= {P}"
    )
    con.execute(
        k + f"INSERT INTO calls SELECT c.id + n * {C}, step_id + n * {S}, pass_id + n * {P}, node_id, seq, start, "
        f"duration FROM calls c, k WHERE c.id <= {C}"
    )
    con.execute(
        k + f"INSERT INTO tensors SELECT t.id + n * {T}, step_id + n * {S}, pass_id + n * {P}, call_id + n * {C}, "
        "node_id, role, slot, status, reason, dtype, shape, numel, norm, min, max, mean, std, nan, posinf, neginf, "
        f"zeros, checksum FROM tensors t, k WHERE t.id <= {T}"
    )
    con.commit()
    con.close()


def revision(db) -> str:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return con.execute("SELECT version_num FROM alembic_version").fetchone()[0]
    finally:
        con.close()


def open_fds_on(path) -> list[str]:
    """This process's open file descriptors on `path` (or its -wal/-shm files)."""
    target = str(Path(path).resolve())
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith(target):
                found.append(link)
    return found


# ---- read-only files -------------------------------------------------------------------------------------------
def world_readable_dir() -> Path:
    """A fresh directory under the system's temporary directory that every user can enter and read (pytest's own
    tmp_path is root's only); remove it with `remove_tree`."""
    d = Path(tempfile.mkdtemp(prefix="gradstore-faults-"))
    d.chmod(0o755)
    return d


def remove_tree(d: Path) -> None:
    for p in [d, *d.rglob("*")]:
        subprocess.run(["chattr", "-i", str(p)], capture_output=True)
    shutil.rmtree(d, ignore_errors=True)


def immutable_supported(d: Path) -> bool:
    """True when `chattr +i` works here and stops even this process (root) from writing: the file system's
    immutable flag, the closest a test gets to read-only media without mounting one."""
    if shutil.which("chattr") is None:
        return False
    probe = d / "probe"
    probe.write_text("x")
    try:
        if subprocess.run(["chattr", "+i", str(probe)], capture_output=True).returncode != 0:
            return False
        try:
            with open(probe, "a") as f:
                f.write("y")
            return False  # written anyway: the flag does not hold
        except PermissionError:
            return True
    finally:
        subprocess.run(["chattr", "-i", str(probe)], capture_output=True)
        probe.unlink()


@contextlib.contextmanager
def immutable(*paths: Path):
    """`chattr +i` on `paths` (files and directories) for the block: nobody, root included, may change them."""
    for p in paths:
        subprocess.run(["chattr", "+i", str(p)], check=True)
    try:
        yield
    finally:
        for p in paths:
            subprocess.run(["chattr", "-i", str(p)], check=True)


@contextlib.contextmanager
def others_cannot_write(d: Path):
    """For the block, `as_other_user` may not write directory `d` or the files in it. As root nothing is
    needed (the child is nobody, `d` is root's 0755 and its files 0644); as another user the child is that user
    too, so `d` and its files are made read-only (0555, 0444) and restored afterwards."""
    if os.geteuid() == 0:
        yield
        return
    modes = {p: p.stat().st_mode for p in [d, *d.iterdir()]}
    for p in modes:
        p.chmod(0o555 if p.is_dir() else 0o444)
    try:
        yield
    finally:
        for p, mode in modes.items():
            p.chmod(mode)


def as_other_user(fn, *args, timeout: float = 60.0):
    """Run fn(*args) in a forked child as a user who owns nothing here: as root, the child drops to uid/gid
    65534 (nobody), so the permission bits hold for it; its result comes back by a pipe (plain data).

    Raises AssertionError with the child's traceback if it failed."""
    import pickle
    import traceback

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(r)
        try:
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            out = (True, fn(*args))
        except BaseException:  # noqa: BLE001 - reported to the parent
            out = (False, traceback.format_exc())
        with os.fdopen(w, "wb") as f:
            pickle.dump(out, f)
        os._exit(0)
    os.close(w)
    deadline = time.monotonic() + timeout
    with os.fdopen(r, "rb") as f:
        data = f.read()
    while True:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if not done:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    ok, payload = pickle.loads(data)
    assert ok, f"the child failed:\n{payload}"
    return payload
