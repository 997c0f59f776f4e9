"""The warnings a recorded step raised: noted as Python shows them, passed on unchanged.

Python hands every warning that its filters let through to `warnings._showwarnmsg(msg)` (CPython's private hook,
called by `warnings.warn` and by the C API `PyErr_WarnEx` that torch's TORCH_WARN uses) just before printing it.
While a step is recorded that hook is wrapped: the wrapper notes (category, message, 'file:line') for the step
and calls the hook it replaced with the same message object, so what reaches the user is exactly what would
without gradstore:
- the filters and the once-per-location registries are not touched (no `catch_warnings`, which would reset them),
  so `warnings.simplefilter("error")` still raises where the warning is issued (and is never noted: the step's
  error says it), and an ignored warning is neither shown nor noted;
- a `warnings.catch_warnings(record=True)` of the user's own still collects its warnings (they are noted too:
  they were raised in the step);
- `warnings.showwarning` replaced by the user is still called (by the wrapped hook, as before).
A warning torch hides from the user (`torch._logging.hide_warnings`, a `warnings.showwarning` wrapper that shows
only what its filter passes: torch._dynamo reading a tensor's `.grad` while tracing) is not noted
(`torch_private.warning_hidden`). What is counted is what Python showed: under the default filter a warning is shown
once per location, so a warning repeated in a loop counts 1; `warnings.simplefilter("always")` shows, and counts,
each.
Where `warnings._showwarnmsg` is missing (another Python), `warnings.showwarning` (public) is wrapped instead.
"""

from __future__ import annotations

import threading
import warnings

from . import torch_private as tp


def _category_name(category) -> str:
    module = getattr(category, "__module__", "builtins")
    name = getattr(category, "__qualname__", str(category))
    return name if module in ("builtins", "warnings") else f"{module}.{name}"


class WarningLog:
    """Wraps Python's warning display while installed; `sink()` names where a noted warning goes.

    Args:
        sink: callable of no arguments returning the dict {(category, message, location): count} of the step
            being recorded, or None (nothing is noted then).
        thread: the thread whose warnings count (the recording thread); a warning shown on another thread is
            noted only when `also()` (a callable of no arguments) returns True there (a backward pass of the
            recording runs on it).
    """

    def __init__(self, sink, thread: int | None = None, also=None):
        self.sink = sink
        self.thread = thread if thread is not None else threading.get_ident()
        self.also = also
        self._name = "_showwarnmsg" if callable(getattr(warnings, "_showwarnmsg", None)) else "showwarning"
        self._previous = None
        self._installed = None

    def install(self) -> None:
        """Wrap the display hook (no-op when already installed)."""
        if self._installed is not None:
            return
        previous = getattr(warnings, self._name)
        if self._name == "_showwarnmsg":

            def wrapper(msg):
                if not tp.warning_hidden(msg):  # torch hides some of its own warnings from the user
                    self._note(msg.category, msg.message, msg.filename, msg.lineno)
                return previous(msg)

        else:

            def wrapper(message, category, filename, lineno, file=None, line=None):
                self._note(category, message, filename, lineno)
                return previous(message, category, filename, lineno, file, line)

        self._previous = previous
        self._installed = wrapper
        setattr(warnings, self._name, wrapper)

    def remove(self) -> None:
        """Put the hook back as it was (safe to call twice). When someone else replaced it meanwhile, the
        wrapper stays under theirs but notes nothing more."""
        if self._installed is None:
            return
        if getattr(warnings, self._name) is self._installed:
            setattr(warnings, self._name, self._previous)
        else:
            self.sink = lambda: None
        self._installed = None

    def _note(self, category, message, filename, lineno) -> None:
        try:
            if threading.get_ident() != self.thread and not (self.also is not None and self.also()):
                return
            counts = self.sink()
            if counts is None:
                return
            text = str(message.args[0]) if isinstance(message, Warning) and message.args else str(message)
            key = (_category_name(category), text, f"{filename}:{lineno}")
            counts[key] = counts.get(key, 0) + 1
        except Exception:  # noting never stands in the warning's way
            pass
