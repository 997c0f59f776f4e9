"""Run a function in several forked processes (fast: torch is not imported again), collect what each one
returns, and never hang: a process that raises, dies or outlives the timeout fails the test, and every
process still running is killed.

Results travel through a multiprocessing Queue as plain Python data (lists, numbers, strings): no tensor
crosses a process boundary, so nothing depends on shared-memory file descriptors outliving the child.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import time
import traceback
from datetime import timedelta


def needs_gloo():
    """A pytest mark skipping a module or test where torch.distributed has no gloo backend."""
    import pytest
    import torch.distributed as dist

    return pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed with gloo is not available"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn, index, q, args):
    try:
        import torch

        torch.set_num_threads(1)  # N processes on a 2-core machine: no oversubscription
        q.put((index, True, fn(index, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        q.put((index, False, traceback.format_exc()))
    finally:
        q.close()
        q.join_thread()


def run_processes(fn, n: int, *args, timeout: float = 90.0) -> list:
    """Call fn(index, *args) in n forked processes; return their results in index order.

    Raises AssertionError with the child's traceback when one raises, its exit code when one dies without
    reporting, or the indexes still missing at the timeout. Every child is joined or killed before return.
    """
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(fn, i, q, args), daemon=True) for i in range(n)]
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.start()
        while len(results) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"processes {sorted(set(range(n)) - set(results))} did not finish in {timeout} s")
            try:
                index, ok, payload = q.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if i not in results and p.exitcode is not None]
                if dead:
                    time.sleep(0.5)  # its report may still be in the pipe
                    try:
                        index, ok, payload = q.get(timeout=0.5)
                    except queue.Empty:
                        raise AssertionError(
                            f"process {dead[0]} exited with code {procs[dead[0]].exitcode} without a result"
                        ) from None
                else:
                    continue
            if not ok:
                raise AssertionError(f"process {index} failed:\n{payload}")
            results[index] = payload
        for p in procs:
            p.join(timeout=max(5.0, deadline - time.monotonic()))
        stuck = [i for i, p in enumerate(procs) if p.exitcode is None]
        assert not stuck, f"processes {stuck} reported a result but did not exit"
        bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
        assert not bad, f"processes exited with non-zero codes: {bad}"
        return [results[i] for i in range(n)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        q.close()


def _distributed(rank, world_size, port, fn, args, timeout_s=60.0):
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        return fn(rank, *args)
    finally:
        dist.destroy_process_group()


def run_distributed(fn, *args, world_size: int = 2, timeout: float = 90.0) -> list:
    """Call fn(rank, *args) in `world_size` forked processes that form a gloo process group (rendezvous on a
    free TCP port of 127.0.0.1; destroyed before each process exits); results in rank order."""
    return run_processes(_distributed, world_size, world_size, free_port(), fn, args, timeout=timeout)


def _spawned(rank, world_size, port, fn, args, timeout_s):
    import torch

    torch.set_num_threads(1)
    _distributed(rank, world_size, port, fn, args, timeout_s)


def spawn_distributed(fn, *args, world_size: int = 2, timeout_s: float = 60.0) -> list:
    """Start fn(rank, *args) in `world_size` forked processes forming a gloo process group (as `run_distributed`,
    collectives timing out after `timeout_s`) and return them (multiprocessing Processes, rank order) while they
    run: for tests about ranks that raise, die or hang, which read each one's `exitcode`. The caller joins them, and
    kills (`kill_all`) whatever is left, in a `finally`."""
    ctx = mp.get_context("fork")
    port = free_port()
    procs = [
        ctx.Process(target=_spawned, args=(r, world_size, port, fn, args, timeout_s), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    return procs


def kill_all(procs, timeout: float = 5.0) -> None:
    """SIGKILL every process of `procs` still alive, and reap them all."""
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=timeout)
