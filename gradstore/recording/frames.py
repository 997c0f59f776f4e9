"""Which line of user code created each autograd node: a cheap frame note per forward op.

`FrameTracker` is a `torch.overrides.TorchFunctionMode`: while it is active, every torch function or Tensor
method called from Python passes through `__torch_function__`, which reads the autograd sequence counter
before and after the call (`torch._C._autograd._get_sequence_nr`, private, via gradstore.recording.torch_private).
Only when the call created nodes (the counter moved) does it look at the Python stack: `sys._getframe`
and `f_back`, up to the first frame whose file is outside torch and gradstore, and it keeps that frame's
(code object, line number) for each sequence number handed out during the call. No traceback is built and
no string is formatted until `owner_frame` asks. A custom `torch.autograd.Function.apply` does not go through
`__torch_function__`; it is seen through gradstore.recording.function_apply.

Nested calls: while `__torch_function__` runs, PyTorch disables the mode, so the ops a torch function runs
internally (F.multi_head_attention_forward creating dozens of nodes) are all given the line that called it.

Measured cost (torch 2.13 CPU, 2 cores, `gradstore.recording.frames.benchmark()`, best of 5 × 20000 ops, three runs):
`x * 2` on a 16-element float32 tensor with requires_grad takes 3.6 µs bare, 5.2 µs under a TorchFunctionMode
that only calls func, and 7.3-7.6 µs with a FrameTracker: ≈3.8 µs per op, of which ≈1.6 µs is
TorchFunctionMode's own dispatch and ≈2.2 µs the two counter reads, the stack walk and one dict store. Ops
that create no node (no_grad, inputs without requires_grad) pay the dispatch and the two counter reads only.

Limits: one thread (the mode stack and the sequence counter are per thread); ops run by C++ without a
Python call (inside torch.compile regions, autograd's own double-backward ops) get no frame. While torch.compile
traces, the mode only calls through (`torch.compiler.is_compiling()`, read before anything of the tracker's), so it
breaks no graph; a compiled region's node gets the compiled forward's file and function (dynamo's frame keeps its
code's file). Dynamo guards every compiled frame on the mode stack (`___check_torch_function_mode_stack`): a frame
compiled with the tracker on the stack is compiled again where it runs without it, so between the recorded steps
of a recording the tracker stays on the stack, paused (`sleep()`), once `torch._dynamo` is imported.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

from . import function_apply
from . import torch_private as tp

_peek = tp.sequence_counter() or tp.next_sequence_nr  # the raw counter read: no wrapper call per op
# torch.compile tracing (dynamo reads it as the constant True): the mode then only calls through
_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_GRADSTORE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the whole package


class FrameTracker(TorchFunctionMode):
    """While active (`with tracker:` or `install()` ... `remove()`), note for each autograd node created by a
    forward op the user-code frame (file, line, function) that called the op.

    Args:
        skip: path prefixes (str) of files that are not user code (default: torch's and gradstore's
            package directories). The first frame outside all of them is the one kept.
    Use `owner_frame(sequence_nr)` -> 'path/to/file.py:42 in forward' (or None), `clear()` between steps; `record()`
    hands out the step's notes (kept by gradstore.recording.lineage for a node a later step runs).
    """

    def __init__(self, skip: tuple[str, ...] | None = None):
        super().__init__()
        self.skip = tuple(skip) if skip is not None else (_TORCH_DIR, _GRADSTORE_DIR)
        self._sites: dict[int, tuple] = {}  # sequence_nr -> (code object, line number)
        self._internal: dict = {}  # code object -> bool (its file is in `skip`)
        self._active = False
        self._paused = False
        self._sleeping = False  # `sleep()`: on the stack, paused, between recorded steps
        self._apply_handle = None

    # ---- the hot path ------------------------------------------------------------------------------------
    def _note(self, before: int, after: int, frame) -> None:
        internal = self._internal
        while frame is not None:
            code = frame.f_code
            hit = internal.get(code)
            if hit is None:
                hit = internal[code] = code.co_filename.startswith(self.skip)
            if not hit:
                break
            frame = frame.f_back
        if frame is None:
            return
        site = (frame.f_code, frame.f_lineno)
        sites = self._sites
        for seq in range(before, after):
            sites.setdefault(seq, site)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # torch.compile traces: no counter read, no stack walk, no graph break; and `_paused` is not read there, so
        # dynamo guards on nothing of the tracker's (a paused step would recompile the frame)
        if _is_compiling() or self._paused:
            return func(*args, **(kwargs or {}))
        before = _peek()
        out = func(*args, **(kwargs or {}))
        after = _peek()
        if after > before:
            self._note(before, after, sys._getframe(1))
        return out

    # listener protocol of gradstore.recording.function_apply (custom Function.apply)
    def before(self, cls, args, kwargs):
        return None if self._paused else _peek()

    def after(self, cls, args, kwargs, output, token):
        after = _peek()
        if token is not None and after > token:
            self._note(token, after, sys._getframe(2))

    # ---- control ------------------------------------------------------------------------------------------
    def __enter__(self):
        out = super().__enter__()
        self._active = True
        self._apply_handle = function_apply.add(self)
        return out

    def __exit__(self, exc_type, exc, tb):
        if self._apply_handle is not None:
            self._apply_handle.remove()
            self._apply_handle = None
        self._active = False
        return super().__exit__(exc_type, exc, tb)

    def install(self) -> None:
        """Start noting frames on this thread (no-op when the sequence counter is unreadable; wakes a tracker that
        `sleep()` left on the stack). Pair with `remove()`; modes nest, so remove in the reverse order of
        installing."""
        _skip_own_frames()
        if self._sleeping:
            self._sleeping = self._paused = False
        if self._active or not tp.has_sequence_nr():
            return
        self.__enter__()

    def sleep(self) -> None:
        """Stop noting frames but stay on this thread's mode stack (and on custom Functions' `apply`), paused, until
        `install()` wakes it or `remove()` takes it off: for the steps a recording does not sample while
        torch.compile may run (`torch._dynamo` imported). Dynamo guards each compiled frame on the types of the
        TorchFunctionModes on the stack, so a mode pushed on recorded steps only would make it compile every frame
        twice; paused, each op pays the mode's dispatch only (about 1.6 µs; see the module docstring)."""
        if self._active and not self._sleeping:
            self._sleeping = self._paused = True

    def remove(self) -> None:
        """Stop noting frames; safe to call twice."""
        if self._sleeping:
            self._sleeping = self._paused = False
        if self._active:
            self.__exit__(None, None, None)

    def forget_in_child(self) -> None:
        """In a process forked while the tracker was active: stop it in this process (the parent's stays). Taken
        off this thread's mode stack when it is the innermost mode there; else left on it, paused for good (ops
        pass straight through), since popping another mode would break the stack."""
        if not self._active:
            return
        if tp.innermost_function_mode() is self:
            self.remove()
            return
        if self._apply_handle is not None:
            self._apply_handle.remove()
            self._apply_handle = None
        self._paused = True
        self._active = False
        self.clear()

    @contextmanager
    def paused(self):
        """Within this block, ops pass straight through (no counter read, no stack walk): wrap backward passes
        in it, whose hooks run torch ops (gradstore's reductions) on this thread while the mode is active. The
        mode stays on the stack, so other modes entered meanwhile are not disturbed."""
        previous, self._paused = self._paused, True
        try:
            yield self
        finally:
            self._paused = previous

    @property
    def active(self) -> bool:
        """True while the tracker is noting frames."""
        return self._active

    def clear(self) -> None:
        """Forget the frames noted so far (between steps): later notes go to a new record, so one that `record()`
        handed out (held by gradstore.recording.lineage for the last recorded steps) stays as it was."""
        self._sites = {}

    def record(self) -> dict:
        """The frames noted since the last `clear()`: {sequence_nr: (code object, line number)}, the tracker's own
        dict (not a copy), which it stops writing to at its next `clear()`. Read it with `site_in`."""
        return self._sites

    def __len__(self) -> int:
        return len(self._sites)

    # ---- reading ----------------------------------------------------------------------------------------------
    def site(self, sequence_nr: int) -> tuple[str, int, str] | None:
        """(file path, line number, function name) of the user code that created node `sequence_nr`, or None
        (created outside the tracker, by C++ alone, or an AccumulateGrad)."""
        return site_in(self._sites, sequence_nr)

    def owner_frame(self, sequence_nr: int) -> str | None:
        """'file.py:LINE in FUNCTION' for the node with this sequence number (`node._sequence_nr()`), or None."""
        return frame_in(self._sites, sequence_nr)


_frames_skipped = False  # torch._dynamo told to convert no frame of the tracker's own (`_skip_own_frames`)


def _skip_own_frames() -> None:
    """Once torch._dynamo is imported, tell it to convert no frame of `FrameTracker.__torch_function__` (its frames
    called from dynamo's own code at a graph break: converted, the op that broke the user's graph would break it
    again there, counted twice in `counters["graph_break"]`) nor of `_note` (torch_private.skip_top_frame,
    torch_private.skip_frames). The ops `__torch_function__` calls are converted as they are without the tracker;
    where dynamo traces an op it still inlines `__torch_function__`. Done once per process."""
    global _frames_skipped
    if _frames_skipped or not tp.dynamo_imported():
        return
    _frames_skipped = tp.skip_top_frame(FrameTracker.__torch_function__) and tp.skip_frames(FrameTracker._note)


def site_in(record: dict, sequence_nr: int) -> tuple[str, int, str] | None:
    """(file path, line number, function name) noted for node `sequence_nr` in `record` (a `FrameTracker.record()`),
    or None where it holds none."""
    hit = record.get(sequence_nr)
    if hit is None:
        return None
    code, line = hit
    return code.co_filename, line, code.co_name


def frame_in(record: dict, sequence_nr: int) -> str | None:
    """'file.py:LINE in FUNCTION' noted for node `sequence_nr` in `record` (a `FrameTracker.record()`), or None."""
    s = site_in(record, sequence_nr)
    return None if s is None else f"{s[0]}:{s[1]} in {s[2]}"


def benchmark(n: int = 20000) -> dict[str, float]:
    """Microseconds per `x * 2` (16 elements, requires_grad): bare, under a no-op TorchFunctionMode, and with a
    FrameTracker; best of 5 loops of n ops:
    `python -c "import gradstore.recording.frames as f; print(f.benchmark())"`."""
    import time

    class Bare(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x = torch.randn(16, requires_grad=True)

    def loop():
        t = time.perf_counter()
        for _ in range(n):
            x * 2
        return (time.perf_counter() - t) / n * 1e6

    loop()
    bare = min(loop() for _ in range(5))
    with Bare():
        mode = min(loop() for _ in range(5))
    tracker = FrameTracker()
    with tracker:
        tracked = min(loop() for _ in range(5))
    return {"bare_us": bare, "mode_us": mode, "tracker_us": tracked, "cost_per_op_us": tracked - bare}
