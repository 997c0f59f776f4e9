"""A recording's parameters, [(first name, parameter)], with what every pass and step reads of them made once.

`record` reads its models' parameters once per model structure (`record._read_names`, kept while
`gradstore.recording.modules.Structure.same` holds) and hands the same list to every pass and step. Each pass then
read it again the same way: the names in order (`StepState.note_grads`, `grads_changed`), id(parameter) -> name
(the graph walk's `describe`), and the parameters that the modules= / params= filters keep (`final_grads`, twice a
step). On benchmarks/steady.py's MLP (292 parameters, stats='shape') those loops took about 0.6 ms of a recorded
step's training thread (`time.perf_counter` around each, one process, a slow host). A `ParamList` makes each once,
the first time it is asked, and keeps it as long as the list lives; a plain list gives the same values, made anew.

Nothing that changes from step to step is kept: whether a parameter requires grad, its `.grad`, its state.
"""

from __future__ import annotations

from operator import itemgetter

_NAME = itemgetter(0)


class ParamList(list):
    """[(first qualified name, parameter)], never changed once made (a `list`, so everything that reads a list
    of pairs reads it). `names()`, `ids()` and `picked(...)` give what is derived from it, made on first use and
    the same object after: read them, never change them."""

    __slots__ = ("_names", "_ids", "_picked")

    def __init__(self, pairs=()):
        super().__init__(pairs)
        self._names: list[str] | None = None
        self._ids: dict[int, str] | None = None
        self._picked: dict = {}

    def names(self) -> list[str]:
        """The first names, in order."""
        if self._names is None:
            self._names = list(map(_NAME, self))
        return self._names

    def ids(self) -> dict[int, str]:
        """id(parameter) -> first name."""
        if self._ids is None:
            self._ids = {id(p): n for n, p in self}
        return self._ids

    def picked(self, key, pick) -> tuple[list, list]:
        """`pick(self)` -> (items, parameters), made once per `key` (hashable: the filters it depends on)."""
        hit = self._picked.get(key)
        if hit is None:
            if len(self._picked) > 64:
                self._picked.clear()
            hit = self._picked[key] = pick(self)
        return hit


def names_of(params) -> list[str]:
    """The first names of `params` ([(name, parameter)]) in order; a ParamList's own list (read only)."""
    return params.names() if isinstance(params, ParamList) else list(map(_NAME, params))


def ids_of(params) -> dict[int, str]:
    """id(parameter) -> name of `params`; a ParamList's own dict (read only: copy it to add to it)."""
    return params.ids() if isinstance(params, ParamList) else {id(p): n for n, p in params}
