"""gradstore's node hooks in C++ (gradstore/recording/kernels/hooks.cpp): built on first use, loaded as an
extension module.

With them, a pass's prehook and hook on every Node run without entering Python: the call's order and timing,
each gradient's dtype and shape, and (levels 'health' and 'full') the fused kernel's statistics
(gradstore.recording.kernel) are kept in C++ until the pass ends, and the writer thread turns them into rows. Python
hooks cost a GIL acquisition, a Python wrapper per gradient and the hook's own bytecode on every Node; on the
reference GPT-2 step (`python -m benchmarks.run`) that was about 1.5 % of the step at level 'shape'.

The same module walks a pass's graph in one call (`walk`, used by gradstore.recording.graph.walk: the Nodes, their
edges as packed int32, every sequence_nr and the signature gradstore.recording.graph keys a fresh pass by, with no
Python tuple per edge or per `next_functions` entry; a recorded pass's walk is lazy: its Nodes stay in C++, keyed by
address (`node_address`), and a Node's Python object is made only where one is asked for, `walk_node`), builds the
call rows on the writer thread (`call_rows`: each with its node's sequence_nr as the walk read it), reads every
parameter's `.grad` state (`grad_states`: data pointer and version counter, gradstore.recording.passes) without a
Python object per parameter, and measures the parameters'
`.grad`s into their rows (`param_rows`, gradstore.recording.final_grads: the kernel's statistics of each plain dense
float32/float64 CPU gradient, built into its row tuple with no `Measured` object or Python float per statistic), or
into packed rows (`param_pack`: one bytes object for all of them, built into rows where they are read, the writer's
child process). It also holds the module tracker's forward hooks on their common path (`module_hooks`,
gradstore.recording.modules: the same appends as the tracker's Python hooks, without their bytecode per module
call), the module tap that runs them around a module call with no global module hook installed (`module_tap`,
`tap_target`: the class attribute `nn.Module._compiled_call_impl` while a step records), and the check that the
models' structure is unchanged since their names were read (`same_structure`,
`Structure.same`: each module's class and registries compared by identity, with no fingerprint list built).

Every row is what the Python hooks (gradstore.recording.passes, gradstore.recording.stats) record for the same tensor: a
gradient the C++ side does not measure itself (a tensor subclass, a device tensor, float16/bfloat16, a
non-dense layout, finite float64 values whose squares overflow, one large enough to be split across threads) is
handed to
`gradstore.recording.stats.measure` / `shape_only` with the GIL, from the hook, before the node runs on. A gradient
holding NaN or Inf stays in C++: the kernel's gs_stats counts them exactly (the function stats.py measures with).

Build: the C++ compiler in `$CXX` (else `c++`), against the installed torch's headers and libraries, into the
cache directory of gradstore.recording.kernel, under a name that hashes the source, the compiler, torch's version and
build, and Python's. The first build takes about 15 s on one core; it runs in a child process watched by a
background thread, and passes use the Python hooks until it is done (same rows); a process that ends sooner
leaves the child to finish the build for the next one. `GRADSTORE_NATIVE=0` turns the C++ hooks off;
`load(wait=True)` builds in the calling thread.

Relies on PyTorch's C++ autograd API (torch/csrc/autograd: Node::add_pre_hook, add_post_hook, del_post_hook,
next_edges, sequence_nr, name, FunctionPreHook, FunctionPostHook, get_current_graph_task_id, AccumulateGrad::variable,
functionToPyObject), which the headers of the installed torch
describe, and nn.Module's private `_modules` / `_parameters` dicts (`same_structure`, read by getattr as
gradstore.recording.torch_private.module_registries reads them); a torch whose headers no longer compile it
leaves the Python hooks in place (`status()` says why).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from ..store import inserts, writer
from . import kernel
from . import torch_private as tp

SOURCE = Path(__file__).with_name("kernels") / "hooks.cpp"
MODULE = "_gradstore_hooks"
ABI_VERSION = 20
_FLAGS = ("-O2", "-fPIC", "-shared", "-w")
_STANDARDS = ("-std=c++17", "-std=c++20")  # the first the installed torch's headers compile with
_lock = threading.Lock()
_state: dict = {}  # "module": the module or None once settled; "error": why none; "thread": a build running
# this process's id, read once and again in every forked child (`os.register_at_fork`): `load` and the getters below
# ask it several times a recorded step, and `os.getpid()` is a system call each time
_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)
LEVEL_CODES = {"shape": 0, "health": 1, "full": 2}


def _compiler() -> list[str] | None:
    cxx = os.environ.get("CXX", "c++").split()
    return cxx if cxx and shutil.which(cxx[0]) else None


def _torch_dirs() -> tuple[list[str], str]:
    root = Path(torch.__file__).parent
    inc = root / "include"
    return [str(inc), str(inc / "torch" / "csrc" / "api" / "include")], str(root / "lib")


def _command(cxx: list[str], out: str, standard: str) -> list[str]:
    incs, libdir = _torch_dirs()
    abi = int(tp.cxx11_abi())
    cmd = [*cxx, *_FLAGS, standard, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{sysconfig.get_paths()['include']}"]
    cmd += [f"-I{d}" for d in incs]
    cmd += ["-o", out, str(SOURCE), f"-L{libdir}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]
    cmd += ["-undefined", "dynamic_lookup"] if sys.platform == "darwin" else [f"-Wl,-rpath,{libdir}"]
    return cmd


def _target(cxx: list[str] | None) -> Path:
    version = "none"
    if cxx is not None:
        proc = subprocess.run([*cxx, "--version"], capture_output=True, text=True, timeout=30)
        version = proc.stdout.splitlines()[0] if proc.stdout else ""
    parts = [
        SOURCE.read_bytes(),
        " ".join(cxx or []).encode(),
        version.encode(),
        torch.__version__.encode(),
        str(getattr(torch.version, "git_version", "")).encode(),
        str(Path(torch.__file__).parent).encode(),
        sys.version.encode(),
        " ".join(_FLAGS).encode(),
        platform.platform().encode(),
    ]
    digest = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return kernel.cache_dir() / f"hooks-{digest}{suffix}"


# The build runs in a child Python process that compiles into a temporary file and renames it into place: a
# process that records for less time than the build takes (a short script, the demo) exits without waiting,
# and the child still finishes the build for the next process. A lock file (the target's name + '.lock',
# holding the builder's pid) keeps concurrent processes from compiling the same build twice.
_BUILDER = """
import os, subprocess, sys, json
commands, tmp, target, lock = json.loads(sys.argv[1])
errors = []
try:
    for cmd in commands:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if proc.returncode == 0:
            os.replace(tmp, target)
            break
        errors.append(proc.stderr.strip()[-600:])
    else:
        sys.stderr.write(errors[-1] if errors else 'no command')
        sys.exit(1)
finally:
    for path in (tmp, lock):
        try:
            os.unlink(path)
        except OSError:
            pass
"""
_LOCK_STALE_S = 900  # a lock older than this is a crashed build's


def _build(cxx: list[str], target: Path) -> None:
    """Compile SOURCE into `target` atomically, in a child process that completes even if this one exits.
    Waits for it (or for another process's build of the same target) and raises OSError when it failed."""
    import json
    import time

    target.parent.mkdir(parents=True, exist_ok=True)
    lock = Path(str(target) + ".lock")
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:  # another process is building it: wait for its result
        while lock.exists() and time.time() - lock.stat().st_mtime < _LOCK_STALE_S:
            time.sleep(0.5)
        if target.exists():
            return
        try:
            lock.unlink()
        except OSError:
            pass
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    for stale in target.parent.glob("hooks-*.tmp"):  # a build killed before it could clean up
        try:
            if time.time() - stale.stat().st_mtime > _LOCK_STALE_S:
                stale.unlink()
        except OSError:
            pass
    tmp = tempfile.mktemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    args = json.dumps([[_command(cxx, tmp, std) for std in _STANDARDS], tmp, str(target), str(lock)])
    proc = subprocess.run(
        [sys.executable, "-c", _BUILDER, args], capture_output=True, text=True, start_new_session=True
    )
    if proc.returncode != 0 or not target.exists():
        raise OSError(f"{' '.join(cxx)} failed: {proc.stderr.strip()[-600:]}")


def _import(path: Path):
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    if module.abi() != ABI_VERSION:
        raise OSError(f"hooks ABI {module.abi()} != {ABI_VERSION}")
    return module


def _fallback(t, level: int):
    """The Python measurement of one tensor the C++ hooks hand over (with the GIL); never raises.

    Args: t: a tensor, or a str (a reason: the tensor could not be handed over); level: LEVEL_CODES value.
    Returns: what gradstore.recording.stats.Measurer would record: `shape_only(t)` at level shape, else
        `measure(t, level)`.
    """
    from .stats import Measured, measure, shape_only

    if isinstance(t, str):
        return Measured("skipped", reason=t)
    if level == 0:
        return shape_only(t)
    return measure(t, "full" if level == 2 else "health")


def _reuse(m, t):
    """A grad_input `t` that is the same memory as a grad_output whose Python measurement is `m`: `m` with t's
    shape where it holds statistics, else None (as gradstore.recording.stats.Measurer.grad_inputs)."""
    from .stats import Measured

    if type(m) is Measured and m.status == "ok" and m.vec is not None:
        return Measured(m.status, m.reason, m.dtype, ",".join(map(str, t.shape)), m.numel, m.vec, m.checksum)
    return None


def _init(module) -> None:
    from ..records import ROLE, STATUS
    from .stats import PLAIN_REAL_DTYPES, ROW_COLUMNS, dtype_code

    codes = [(module.scalar_type(torch.empty(0, dtype=d)), dtype_code(d)) for d in PLAIN_REAL_DTYPES]
    k = kernel.load()
    stats_fn = ctypes.cast(k.lib.gs_stats, ctypes.c_void_p).value if k is not None else 0
    module.init(
        codes,
        stats_fn,
        _fallback,
        _reuse,
        torch.Tensor,
        torch.nn.Parameter,
        kernel.SPLIT,
        STATUS["ok"],
        STATUS["none"],
        ROLE["grad_output"],
        ROLE["grad_input"],
        len(ROW_COLUMNS) + 1,  # a row's items after its head: the columns, then the sharding (stats.to_rows)
    )
    _state["kernel"] = k is not None
    inserts.use_native_values(module.none_values)  # the writer's inserts split and pick their rows in C from now on
    writer.use_native_rows(getattr(module, "tensor_rows", None))  # and build the tensor_data rows in C
    if hasattr(os, "register_at_fork"):  # a child forked while an operator watch runs: not its watch (ops_watch)
        os.register_at_fork(after_in_child=lambda: module.ops_watch(None))


def _settle(wait: bool):
    """Load the cached build or build it; records the module or the reason there is none."""
    module, error = None, None
    try:
        cxx = _compiler()
        target = _target(cxx)
        if not target.exists():
            if cxx is None:
                raise OSError("no C++ compiler found ($CXX or c++)")
            _build(cxx, target)
        module = _import(target)
        _init(module)
    except Exception as exc:
        module, error = None, f"{type(exc).__name__}: {exc}"[:800]
    with _lock:
        _state["module"], _state["error"] = module, error
        _state.pop("thread", None)
        if error is not None and not wait:
            _state["warn"] = error  # said by the next load() on a caller's thread, not from the build thread


def _user_stacklevel() -> int:
    """The `stacklevel` (for a warning raised by this module's caller) of the first frame outside gradstore and
    torch: the warning may be said from inside a backward pass (torch.autograd's frames), still the user's line."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # gradstore/, all of it
    skipped = (package, os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(skipped):
        frame, level = frame.f_back, level + 1
    return level


def load(wait: bool = False):
    """The hooks module, or None while it is being built or where it cannot be (see `status()`).

    Args:
        wait: build (or load) in this thread and return the result; else start a background build the first
            time and return None until it is done.
    Never raises. Thread-safe. A forked child whose parent was building starts its own.
    """
    if _state.get("pid") != _pid:  # a fresh process, or a fork: the parent's build thread is not ours
        with _lock:
            if _state.get("pid") != _pid:
                settled = "module" in _state and "thread" not in _state
                keep = {k: v for k, v in _state.items() if k != "pid"} if settled else {}
                _state.clear()
                _state.update(keep, pid=_pid)
    if "module" in _state:
        if "warn" in _state:
            error = _state.pop("warn", None)
            if error is not None:
                warnings.warn(
                    f"gradstore: the C++ node hooks are not available ({error}); the Python hooks "
                    "record the same rows, slower. Set GRADSTORE_NATIVE=0 to silence this.",
                    RuntimeWarning,
                    stacklevel=_user_stacklevel(),
                )
        return _state["module"]
    if os.environ.get("GRADSTORE_NATIVE", "1") == "0":
        with _lock:
            _state.setdefault("module", None)
            _state.setdefault("error", "turned off (GRADSTORE_NATIVE=0)")
        return None
    if wait:
        thread = _state.get("thread")
        if thread is not None:
            thread.join()
        else:
            _settle(wait=True)
        return _state.get("module")
    with _lock:
        if "module" in _state or "thread" in _state:
            return _state.get("module")
        target = None
        try:
            target = _target(_compiler())
        except Exception:
            pass
        if target is not None and target.exists():  # cached: load now (milliseconds)
            pass
        else:
            thread = threading.Thread(target=_settle, args=(False,), name="gradstore-build-hooks", daemon=True)
            _state["thread"] = thread
            thread.start()
            return None
    _settle(wait=True)
    return _state.get("module")


def load_cached():
    """The hooks module where it is loaded already or its build is in the cache (then loaded now: milliseconds),
    else None; never starts a build. For a process that only reads rows the hooks packed in another one
    (gradstore.recording.rows.unpack, in the writer's child). Never raises."""
    if "module" in _state and _state.get("pid") == _pid:
        return _state["module"]
    try:
        target = _target(_compiler())
    except Exception:
        return None
    if target is None or not target.exists():
        return None
    return load()


def available(level: str):
    """The hooks module when the C++ hooks can record at `level` now, else None.

    Args: level (str): 'shape', 'health' or 'full'. Returns: the extension module or None (not built yet, not
    buildable, turned off, or a statistics level without the reduction kernel). Never raises."""
    module = load()
    if module is None:
        return None
    if level != "shape" and not _state.get("kernel"):
        return None  # statistics without the kernel: the Python path is the faster one
    return module


def same_structure():
    """The hooks module's `same_structure(modules, stored)` (gradstore.recording.modules.Structure.same: the modules'
    flat fingerprint compared with the stored one by identity, without building it; True, False, or None for no
    judgement) where the module is loaded in this process, else None. Never starts a build; never raises."""
    module = _state.get("module") if _state.get("pid") == _pid else None
    return getattr(module, "same_structure", None)


def grads_of():
    """The hooks module's `grads_of(params, types)` where the module is loaded in this process, else None. Never
    starts a build; never raises.

    The function returned takes a sequence of tensors and a tuple of the exact types it reads (torch.Tensor,
    torch.nn.Parameter), and returns ([requires_grad: bool], [.grad: Tensor or None]) as Python's attribute reads
    give them (`at::Tensor::requires_grad()`, `grad()`), or None where it declines (a subclass, a non-leaf, not a
    tensor, an error while reading): the caller then reads them in Python."""
    module = _state.get("module") if _state.get("pid") == _pid else None
    return getattr(module, "grads_of", None)


def grad_impls():
    """The hooks module's `grad_impls(params)` where the module is loaded in this process, else None. Never starts
    a build; never raises. The function returned takes a list of (name, parameter) and returns the address of each
    parameter's `.grad` TensorImpl (0 for None) as int64 bytes, or None where a parameter is not a plain tensor."""
    module = _state.get("module") if _state.get("pid") == _pid else None
    return getattr(module, "grad_impls", None)


def ops_watch():
    """The hooks module's `ops_watch(on)` where the module is loaded in this process, else None. Never starts a
    build; never raises.

    The function returned counts the operators PyTorch's dispatcher runs, on every thread, while a watcher is on
    (a global `at::RecordFunction` callback, `at::addGlobalCallback`): `ops_watch(True)` adds a watcher and returns
    the count so far (int), or -1 where RecordFunction is off on the calling thread (no watcher added);
    `ops_watch(False)` removes one and returns the count (-1 where none was on). The count only grows: a window's
    operators are the difference of its two readings. torch.profiler.record_function's own enter / exit operators
    and the 'Optimizer.*' records torch.optim opens around `step()` / `zero_grad()` are not counted (the operators
    inside them are). A write to a tensor's memory that no operator makes (through a NumPy array sharing it, a C
    extension writing raw memory) is not counted. `ops_watch(None)` (run in every forked child) removes the callback
    and every watcher: a child's operators are not the parent's."""
    module = _state.get("module") if _state.get("pid") == _pid else None
    return getattr(module, "ops_watch", None)


def status() -> str:
    """'loaded <path>', 'building', 'not available: <why>' or 'not loaded yet'."""
    if "thread" in _state:
        return "building"
    if "module" not in _state and os.environ.get("GRADSTORE_NATIVE", "1") == "0":
        return "not available: turned off (GRADSTORE_NATIVE=0)"
    if "module" not in _state:
        return "not loaded yet"
    module = _state["module"]
    return f"loaded {module.__file__}" if module is not None else f"not available: {_state['error']}"
