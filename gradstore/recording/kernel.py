"""The fused CPU reduction kernel (gradstore/recording/kernels/reduce.c): built on first use, loaded with ctypes.

One pass over a gradient's memory gives its float64 sum, sum of squares, min, max and zero count (`full`),
or its sum of squares, min and max (`health`): about 0.15 and 0.12 ns per float32 element on one core of
the reference machine (AVX-512; 0.23 and 0.18 built for AVX2 only), against ~1.5 and ~0.5 ns for the
NumPy/torch reductions it replaces (`python -m benchmarks.run --sections reductions`). With AVX-512 the float32
values are widened to float64 by one `vcvtps2pd` per 8 (GCC 12 compiles the portable conversion to four narrow ones
and two shuffles, which bound the loop): `full` over 16,384 float32 values in cache went from 0.19 to 0.13 ns per
element, over 1.6 M from 0.20 to 0.15, on an Intel Xeon with AVX-512 (2026-12-02, by hand); from memory (16 M
values) both read at about 0.5. The values are the same, bit for bit. A tensor holding NaN or Inf
takes its masked variant (exact NaN/+Inf/-Inf counts, and the finite values' sum, sum of squares, min, max and zeros
in one pass; their squared deviations from the mean in a second). `stats` finishes a tensor's statistics vector in
one call, `stats_many` that of many tensors (a model's parameter gradients), and the C++ node hooks call the same
C function (gs_stats), so every path gives the same values.

The source is compiled the first time a process needs it, with the C compiler found in `$CC` or as `cc`, for
this machine's CPU (`-march=native`), into a cache directory (`$GRADSTORE_CACHE_DIR`, else
`$XDG_CACHE_HOME/gradstore`, else `~/.cache/gradstore`), under a name that hashes the source, the compiler
command and version, and the CPU, so a shared home directory never hands one machine another's build. Where
nothing can be built (no compiler, a read-only cache) gradstore warns once and measures with NumPy and torch
instead: same statistics, slower. `GRADSTORE_KERNEL=0` turns the kernel off.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("kernels") / "reduce.c"
ABI_VERSION = 10
_FLAGS = ("-O3", "-fPIC", "-shared", "-Wno-psabi")
SPLIT = 1 << 19  # elements per share below which a tensor is reduced on the calling thread alone
_OUT = ctypes.c_double * 5
_OUT9 = ctypes.c_double * 9
_VEC = ctypes.c_double * 10
_KINDS = {"f32": 0, "f64": 1}
_LEVELS = {"health": 1, "full": 2}
_lock = threading.Lock()
_state: dict = {}  # "lib": Kernel | None once tried; "error": why there is none


class Kernel:
    """The loaded shared library, typed for ctypes.

    `full`, `health` and `m2` take a data pointer (`Tensor.data_ptr()`) to `n` contiguous values, float32
    (suffix 'f32') or float64 ('f64'). ctypes releases the GIL for each call. A large tensor is split into
    equal shares reduced at once on up to `torch.get_num_threads()` threads (the caller's and a small pool),
    as torch's own reductions would be; the shares' results are combined exactly (sums added, min of mins).
    """

    def __init__(self, lib: ctypes.CDLL):
        if lib.gs_abi_version() != ABI_VERSION:
            raise OSError(f"kernel ABI {lib.gs_abi_version()} != {ABI_VERSION}")
        ptr, n, out, real = ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(ctypes.c_double), ctypes.c_double
        signatures = {"full": ((ptr, n, out), None), "health": ((ptr, n, out), None), "m2": ((ptr, n, real), real)}
        self._fn = {}
        for name, (argtypes, restype) in signatures.items():
            for suffix in ("f32", "f64"):
                fn = self._fn[name, suffix] = getattr(lib, f"gs_{name}_{suffix}")
                fn.argtypes, fn.restype = argtypes, restype
        for suffix in ("f32", "f64"):
            fn = self._fn["masked", suffix] = getattr(lib, f"gs_masked_{suffix}")
            fn.argtypes, fn.restype = (ptr, n, out), None
            fn = self._fn["masked_m2", suffix] = getattr(lib, f"gs_masked_m2_{suffix}")
            fn.argtypes, fn.restype = (ptr, n, real), real
        self._stats = lib.gs_stats
        self._stats.argtypes, self._stats.restype = (ptr, n, ctypes.c_int, ctypes.c_int, out), ctypes.c_int
        self._stats_many = lib.gs_stats_many
        self._stats_many.argtypes = (n, ptr, ptr, ptr, ctypes.c_int, ptr, ptr)
        self._stats_many.restype = None
        self._slices = lib.gs_slices_f32
        self._slices.argtypes, self._slices.restype = (ptr, n, n, n, ctypes.c_void_p), None
        self.lib = lib
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self._pool_pid = os.getpid()

    def _shares(self, ptr: int, n: int, itemsize: int) -> list[tuple[int, int]]:
        """(pointer, length) of the shares `n` elements are reduced in: one below 2 * SPLIT elements or at one
        torch thread; else up to torch.get_num_threads(), each a multiple of 16 elements (the vector width)."""
        parts = min(torch.get_num_threads(), n // SPLIT)
        if parts < 2:
            return [(ptr, n)]
        size = -(-n // parts)
        size += -size % 16
        return [(ptr + i * itemsize, min(size, n - i)) for i in range(0, n, size)]

    def _map(self, call, shares):
        """call(pointer, length) for every share: the first on this thread, the others on the pool."""
        if len(shares) == 1:
            return [call(*shares[0])]
        pool = self._pool
        if pool is None or self._pool_size < len(shares) - 1 or self._pool_pid != os.getpid():
            # a forked child inherits the pool object but not its threads: it makes its own
            pool = self._pool = ThreadPoolExecutor(len(shares) - 1, thread_name_prefix="gradstore-reduce")
            self._pool_size, self._pool_pid = len(shares) - 1, os.getpid()
        futures = [pool.submit(call, *share) for share in shares[1:]]
        first = call(*shares[0])
        return [first] + [f.result() for f in futures]

    def full(self, suffix: str, ptr: int, n: int, itemsize: int) -> tuple[float, float, float, float, float]:
        """(sum, sum of squares, min, max, zero count) of n values, accumulated in float64."""
        fn = self._fn["full", suffix]
        if n < 2 * SPLIT:  # the common case: one share, no pool
            out = _OUT()
            fn(ptr, n, out)
            return out[0], out[1], out[2], out[3], out[4]

        def call(p, m):
            out = _OUT()
            fn(p, m, out)
            return out[0], out[1], out[2], out[3], out[4]

        parts = self._map(call, self._shares(ptr, n, itemsize))
        if len(parts) == 1:
            return parts[0]
        return (
            sum(p[0] for p in parts),
            sum(p[1] for p in parts),
            min(p[2] for p in parts),
            max(p[3] for p in parts),
            sum(p[4] for p in parts),
        )

    def health(self, suffix: str, ptr: int, n: int, itemsize: int) -> tuple[float, float, float]:
        """(sum of squares, min, max) of n values: float64 sums, but float32 squares are first added in float32
        over blocks of 16 per lane (within 1e-6 relative; see kernels/reduce.c)."""
        fn = self._fn["health", suffix]
        if n < 2 * SPLIT:
            out = _OUT()
            fn(ptr, n, out)
            return out[0], out[1], out[2]

        def call(p, m):
            out = _OUT()
            fn(p, m, out)
            return out[0], out[1], out[2]

        parts = self._map(call, self._shares(ptr, n, itemsize))
        if len(parts) == 1:
            return parts[0]
        return sum(p[0] for p in parts), min(p[1] for p in parts), max(p[2] for p in parts)

    def stats(self, suffix: str, ptr: int, n: int, level: str) -> tuple | None:
        """The finished statistics vector of n > 0 values on this thread (kernels/reduce.c, gs_stats): a tuple of
        10 floats in gradstore.recording.stats' VEC_LEN order (nan, posinf, neginf, zeros, finite count, norm,
        min, max, mean, std; NaN where the level does not compute it), counting NaN and Inf exactly; None where
        the sums of finite float64 values overflow (the caller measures those values scaled)."""
        out = _VEC()
        if self._stats(ptr, n, _KINDS[suffix], _LEVELS[level], out):
            return None
        return tuple(out)

    def stats_many(self, ptrs: int, numels: int, kinds: int, count: int, level: str, out: int, rc: int) -> None:
        """`stats` of `count` tensors in one call, on this thread: ptrs, numels (int64) and kinds (int8: 0 float32,
        1 float64) are addresses of arrays of `count` items; out (float64, 10 per tensor) and rc (int8: 0, or 1 for
        None from `stats`) receive the results."""
        self._stats_many(count, ptrs, numels, kinds, _LEVELS[level], out, rc)

    def masked(self, suffix: str, ptr: int, n: int, itemsize: int) -> tuple:
        """(NaN count, +Inf count, -Inf count, zeros, finite count, sum, sum of squares, min, max) of n values,
        the sums, min and max over the finite ones only (min +Inf and max -Inf where none is finite), in float64;
        split across threads as `full` is."""
        fn = self._fn["masked", suffix]

        def call(p, m):
            out = _OUT9()
            fn(p, m, out)
            return tuple(out)

        parts = self._map(call, self._shares(ptr, n, itemsize))
        if len(parts) == 1:
            return parts[0]
        return (
            *(sum(p[j] for p in parts) for j in range(7)),
            min(p[7] for p in parts),
            max(p[8] for p in parts),
        )

    def masked_m2(self, suffix: str, ptr: int, n: int, itemsize: int, mean: float) -> float:
        """Sum of squared differences of the finite ones of n values from `mean`, in float64."""
        fn = self._fn["masked_m2", suffix]
        return sum(self._map(lambda p, m: fn(p, m, mean), self._shares(ptr, n, itemsize)))

    def slices(self, ptr: int, outer: int, k: int, inner: int, out: int) -> None:
        """Per-slice sums of squares of a contiguous float32 block of shape (outer, k, inner), in float64:
        out (a pointer to k doubles)[i] = sum of the squares of slice i along the middle dimension (one pass, on
        this thread; see kernels/reduce.c, gs_slices_f32)."""
        self._slices(ptr, outer, k, inner, out)

    def m2(self, suffix: str, ptr: int, n: int, itemsize: int, mean: float) -> float:
        """Sum of squared differences of n values from `mean`, in float64."""
        fn = self._fn["m2", suffix]
        return sum(self._map(lambda p, m: fn(p, m, mean), self._shares(ptr, n, itemsize)))


def cache_dir() -> Path:
    """Where built kernels and hooks are kept: `$GRADSTORE_CACHE_DIR`, else `$XDG_CACHE_HOME/gradstore`, else
    `~/.cache/gradstore` (a `Path`; not created here)."""
    explicit = os.environ.get("GRADSTORE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gradstore"


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags (Linux), else the platform."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def _compiler() -> list[str] | None:
    cc = os.environ.get("CC", "cc").split()
    return cc if cc and shutil.which(cc[0]) else None


def _build(cc: list[str], target: Path) -> None:
    """Compile SOURCE into `target` atomically (a concurrent build by another process is harmless)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        errors = []
        for arch in (["-march=native"], []):  # some compilers (Apple clang on arm64) refuse -march=native
            proc = subprocess.run(
                [*cc, *_FLAGS, *arch, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=120
            )
            if proc.returncode == 0:
                os.replace(tmp, target)
                return
            errors.append(proc.stderr.strip()[-400:])
        raise OSError(f"{' '.join(cc)} failed: {errors[-1]}")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> Kernel | None:
    """The kernel, built and loaded on the first call in a process; None where it cannot be (the reason is in
    `status()`, and a RuntimeWarning says it once). Thread-safe; never raises."""
    if "lib" in _state:
        return _state["lib"]
    with _lock:
        if "lib" in _state:
            return _state["lib"]
        lib, error = None, None
        try:
            if os.environ.get("GRADSTORE_KERNEL", "1") == "0":
                error = "turned off (GRADSTORE_KERNEL=0)"
            else:
                lib = _load()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            warnings.warn(
                f"gradstore: the fused reduction kernel is not available ({error}); statistics are "
                "computed with NumPy and torch instead (same values, slower). Install a C compiler "
                "(cc) to get it, or set GRADSTORE_KERNEL=0 to silence this.",
                RuntimeWarning,
                stacklevel=2,
            )
        _state["lib"], _state["error"] = lib, error
        return lib


def _load() -> Kernel:
    cc = _compiler()
    source = SOURCE.read_bytes()
    version = "none"
    if cc is not None:
        proc = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30)
        version = proc.stdout.splitlines()[0] if proc.stdout else ""
    digest = hashlib.sha256(
        b"\0".join(
            [
                source,
                " ".join(cc or []).encode(),
                version.encode(),
                _cpu_signature().encode(),
                " ".join(_FLAGS).encode(),
                platform.platform().encode(),
            ]
        )
    ).hexdigest()[:16]
    target = cache_dir() / f"reduce-{digest}{'.dll' if os.name == 'nt' else '.so'}"
    if not target.exists():
        if cc is None:
            raise OSError("no C compiler found ($CC or cc)")
        _build(cc, target)
    return Kernel(ctypes.CDLL(str(target)))


def status() -> str:
    """'loaded <path>', 'not available: <why>', or 'not loaded yet' (for benchmark and bug reports)."""
    if "lib" not in _state:
        return "not loaded yet"
    lib = _state["lib"]
    return f"loaded {lib.lib._name}" if lib is not None else f"not available: {_state['error']}"
