"""Interleaved timing: every configuration takes one slot per round (A B C ... A B C ...), after warm-up
rounds, so that drift of the machine (other jobs, thermal, caches) falls on all of them alike. Reported:
the median step time per configuration and its ratio to the median of the un-instrumented step measured
in the same rounds."""

from __future__ import annotations

import gc
import itertools
import time
import traceback

from .common import log, median
from .configs import NotAvailable


def interleaved(configs: list, rounds: int, warmup: int, label: str = "", vary_order: bool = False) -> dict:
    """Run `configs` interleaved. The first configuration is the baseline. `vary_order`: the rounds take every
    order of the configurations in turn (itertools.permutations; for more than 4 configurations, the rotations
    of the list and of its reverse), so that no configuration always follows the same one (whose writer's work
    and memory the next slot would inherit); use a multiple of the number of orders as rounds.

    Returns {name: {"times": [s per step], "extra": {key: [values]}, "status": "ok" | "n/a (...)" |
    "error (...)", "records": str, "note": str}}.
    """
    out = {}
    live = []
    for c in configs:
        entry = {"times": [], "extra": {}, "status": "ok", "records": c.records, "note": ""}
        out[c.name] = entry
        try:
            c.setup()
            entry["note"] = getattr(c, "note", "")
            live.append(c)
        except NotAvailable as exc:
            entry["status"] = f"n/a ({exc})"
        except Exception as exc:
            entry["status"] = f"error ({type(exc).__name__}: {exc})"[:300]

    def slot(c, timed: bool) -> None:
        t0 = time.perf_counter()
        c.step()
        dt = (time.perf_counter() - t0) / c.steps_per_slot
        extra = c.after()
        if timed:
            out[c.name]["times"].append(dt)
            for k, v in extra.items():
                out[c.name]["extra"].setdefault(k, []).append(v)

    n = len(configs)
    if n <= 4:
        orders = list(itertools.permutations(range(n)))
    else:
        orders = [tuple(range(k, n)) + tuple(range(k)) for k in range(n)]
        orders += [tuple(reversed(o)) for o in orders]
    for r in range(warmup + rounds):
        timed = r >= warmup
        gc.collect()  # once per round, untimed: no slot inherits another's garbage
        order = [configs[i] for i in orders[r % len(orders)]] if vary_order else list(configs)
        for c in order:
            if c not in live:
                continue
            try:
                slot(c, timed)
            except Exception as exc:
                out[c.name]["status"] = f"error ({type(exc).__name__}: {exc})"[:300]
                out[c.name]["traceback"] = traceback.format_exc()[-2000:]
                live.remove(c)
        if timed:
            base = median(out[configs[0].name]["times"])
            log(
                f"{label} round {r - warmup + 1}/{rounds}: none {base * 1e3:.0f} ms"
                if base
                else f"{label} round {r - warmup + 1}/{rounds}"
            )
        else:
            log(f"{label} warm-up round {r + 1}/{warmup}")
    for c in live:
        try:
            c.teardown()
        except Exception:
            pass
    return out


def summarize(result: dict, baseline: str = "none") -> dict:
    """Medians and ratios to the baseline's median: adds median_s, ratio, drain_s, ratio_incl_write."""
    base = median(result[baseline]["times"]) if baseline in result else None
    for entry in result.values():
        m = median(entry["times"])
        entry["median_s"] = m
        entry["ratio"] = (m / base) if (m and base) else None
        drains = entry["extra"].get("drain_s")
        if drains:
            d = median(drains)
            entry["drain_s"] = d
            steps = [t + dr for t, dr in zip(entry["times"], drains)]
            entry["ratio_incl_write"] = median(steps) / base if base else None
    return result
