"""What a recording records: statistics level, step sampling, module and parameter filters, back-pressure, and
the opt-in looks inside tensors (slices=, values=) and at the forward (forward=).

Filters are applied before any reduction: a node that is not selected gets no hook at all.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field
from numbers import Integral

from ..errors import RecordUsageError
from .stats import LEVELS

WRITER_MODES = ("auto", "process", "thread")  # record(writer=...): see gradstore.recording.offload


def default_writer() -> str:
    """The writer mode when record(writer=...) is not given: the environment variable GRADSTORE_WRITER, else
    'auto' (checked where it is used, like the argument)."""
    return os.environ.get("GRADSTORE_WRITER", "") or "auto"


ON_FULL = ("wait", "drop")
MAX_NUMEL = 4096  # record(values=...): the largest gradient whose elements are stored, by default
VALUES_BUDGET = 8 << 20  # record(values=...): bytes of elements stored per step at most, by default (8 MiB)


def _slice_globs(value) -> tuple[tuple[str, int | None], ...] | None:
    """record(slices=...) as ((glob, dim or None), ...): a glob, a list of globs, or a dict glob -> dim."""
    if value is None:
        return None
    if isinstance(value, dict):
        pairs = tuple(value.items())
        ok = bool(pairs) and all(
            isinstance(g, str) and g and (d is None or (isinstance(d, int) and not isinstance(d, bool)))
            for g, d in pairs
        )
        if not ok:
            raise RecordUsageError(
                "record(slices=...) takes a glob, a list of globs, or a dict of glob -> dimension (an int, or "
                f"None for the default: the last for grad_inputs, 0 for parameter gradients), got {value!r}"
            )
        return pairs
    return tuple((g, None) for g in _globs(value, "slices"))


def matches(glob: str, key: str, module: str, param: str | None) -> bool:
    """True when `glob` (fnmatch, case-sensitive) selects a node: it matches the node's key
    ('transformer.h.0.attn/SoftmaxBackward0#0', 'param:transformer.wte.weight'), its module's qualified name or
    that of one of the module's parents (as modules= does: 'transformer.h.0' covers its submodules' nodes), or
    the qualified name of its parameter ('transformer.wte.weight', for a parameter's AccumulateGrad node)."""
    if fnmatch.fnmatchcase(key, glob) or (param is not None and fnmatch.fnmatchcase(param, glob)):
        return True
    parts = module.split(".") if module else [""]
    return any(fnmatch.fnmatchcase(".".join(parts[:i]), glob) for i in range(len(parts), 0, -1))


ON_NONFINITE = ("warn", "raise")  # or a callable
DUMP_ON = ("nonfinite", "spike", "error")  # the flight recorder's triggers (record(keep=N))
SPIKE_FACTOR = 10.0


def _globs(value, what: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    try:
        globs = tuple(value)
    except TypeError:
        globs = None
    if not globs or not all(isinstance(g, str) and g for g in globs):
        raise RecordUsageError(
            f"record({what}=...) takes a glob or a list of globs such as 'transformer.h.*.attn', got {value!r}"
        )
    return globs


@dataclass(frozen=True)
class Options:
    """Validated recording options (see `gradstore.record` for their meaning)."""

    stats: str = "full"
    every: int = 1
    steps: frozenset | range | None = None
    modules: tuple[str, ...] | None = None
    params: tuple[str, ...] | None = None
    on_full: str = "wait"
    queue_rows: int = 500_000
    saved: bool = False
    frames: bool = False
    checksum: bool | None = None
    slices: tuple[tuple[str, int | None], ...] | None = None  # ((glob, dim or None), ...)
    values: tuple[str, ...] | None = None
    max_numel: int = MAX_NUMEL
    values_budget: int = VALUES_BUDGET
    forward: bool = False
    on_nonfinite: object = None  # None, 'warn', 'raise' or a callable taking the first non-finite row (dict)
    keep: int | None = None  # flight recorder: the last `keep` steps held in memory
    dump_on: tuple[str, ...] = ()
    spike_factor: float = SPIKE_FACTOR
    writer: str = "auto"  # where the step's findings and SQL run: 'auto', 'process' or 'thread'
    # (key, module, param) -> (slice dim or None, slices matched, values matched), filled as nodes are seen
    _inside: dict = field(default_factory=dict, compare=False, repr=False)
    # a tied parameter's first name -> every name it has (filled by the recorder from the models): the filters keep
    # a tied parameter when any of its names (with its module) passes them
    aliases: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    aliases_key: tuple = field(default=(), compare=False, hash=False, repr=False)  # `aliases` as a tuple (caches)

    def add_aliases(self, groups) -> None:
        """Note the names of the tied parameters among `groups` ([(every name, parameter)]) in `aliases`."""
        self.aliases.update({names[0]: tuple(names) for names, _ in groups if len(names) > 1})
        object.__setattr__(self, "aliases_key", tuple(sorted(self.aliases.items())))

    @classmethod
    def make(
        cls,
        stats="full",
        every=1,
        steps=None,
        modules=None,
        params=None,
        on_full="wait",
        queue_rows=500_000,
        saved=False,
        frames=False,
        checksum=None,
        slices=None,
        values=None,
        max_numel=None,
        values_budget=None,
        forward=False,
        on_nonfinite=None,
        keep=None,
        dump_on=None,
        spike_factor=None,
        writer=None,
    ) -> Options:
        """Validate user arguments; raises RecordUsageError naming the argument and what it accepts."""
        if stats not in LEVELS:
            raise RecordUsageError(f"record(stats=...) is one of {', '.join(map(repr, LEVELS))}, got {stats!r}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise RecordUsageError(
                f"record(every=...) takes a whole number >= 1 (record every Nth step), got {every!r}"
            )
        if steps is not None:
            steps = _steps(steps)
        if on_full not in ON_FULL:
            raise RecordUsageError(
                f"record(on_full=...) is 'wait' (the step waits for the writer) or 'drop' "
                f"(rows are dropped and counted in steps.dropped), got {on_full!r}"
            )
        if isinstance(queue_rows, bool) or not isinstance(queue_rows, int) or queue_rows < 1:
            raise RecordUsageError(f"record(queue_rows=...) takes a whole number >= 1, got {queue_rows!r}")
        for name, flag in (("saved", saved), ("frames", frames), ("forward", forward)):
            if not isinstance(flag, bool):
                raise RecordUsageError(f"record({name}=...) is True or False, got {flag!r}")
        if saved and stats in ("params", "shape"):
            raise RecordUsageError(
                f"record(saved=True) measures saved tensors in node hooks; stats={stats!r} "
                "records no node statistics: use stats='full' or 'health'"
            )
        if forward and stats == "params":
            raise RecordUsageError(
                "record(forward=True) keys each pass's loss by its node, and stats='params' walks no graph: "
                "use stats='full', 'health' or 'shape'"
            )
        if checksum is not None and not isinstance(checksum, bool):
            raise RecordUsageError(f"record(checksum=...) is True, False or None (automatic), got {checksum!r}")
        for name, n, least in (("max_numel", max_numel, 1), ("values_budget", values_budget, 0)):
            if n is None:
                continue
            if values is None:
                raise RecordUsageError(
                    f"record({name}=...) bounds record(values=...): give values= (a glob or a list of globs on "
                    "node keys, modules or parameters) too"
                )
            if isinstance(n, bool) or not isinstance(n, int) or n < least:
                raise RecordUsageError(f"record({name}=...) takes a whole number >= {least}, got {n!r}")
        if on_nonfinite is not None and on_nonfinite not in ON_NONFINITE and not callable(on_nonfinite):
            raise RecordUsageError(
                "record(on_nonfinite=...) is 'warn', 'raise' or a function taking the first non-finite row "
                f"(a dict), got {on_nonfinite!r}"
            )
        if on_nonfinite is not None and stats == "shape":
            raise RecordUsageError(
                "record(on_nonfinite=...) reacts to NaN/Inf in measured gradients; stats='shape' measures no value, "
                "so it could never fire: use stats='health' (the cheapest level that counts NaN and Inf) or 'full'"
            )
        dump_on, spike_factor = _flight(keep, dump_on, spike_factor, stats, every, steps)
        given = writer is not None
        writer = default_writer() if writer is None else writer
        if writer not in WRITER_MODES:
            where = "record(writer=...)" if given else "the environment variable GRADSTORE_WRITER"
            raise RecordUsageError(
                f"{where} is 'auto' (a child process writes once a recording is long enough and a second CPU is "
                f"there), 'process' (always) or 'thread' (this process's writer thread), got {writer!r}"
            )
        return cls(
            stats,
            every,
            steps,
            _globs(modules, "modules"),
            _globs(params, "params"),
            on_full,
            queue_rows,
            saved,
            frames,
            checksum,
            _slice_globs(slices),
            _globs(values, "values"),
            MAX_NUMEL if max_numel is None else max_numel,
            VALUES_BUDGET if values_budget is None else values_budget,
            forward,
            on_nonfinite,
            keep,
            dump_on,
            spike_factor,
            writer,
        )

    @property
    def inside(self) -> bool:
        """True when slices= or values= may select a node (its pass then takes the Python hooks)."""
        return self.slices is not None or self.values is not None

    def inside_of(self, key: str, module: str, param: str | None) -> tuple[int | None, bool, bool]:
        """(dim, sliced, valued) for a node: whether slices= and values= select it (`matches`), and the slice
        dimension its first matching slices= glob names (None: the default). Cached per node."""
        hit = self._inside.get((key, module, param))
        if hit is None:
            dim, sliced = None, False
            for glob, d in self.slices or ():
                if matches(glob, key, module, param):
                    dim, sliced = d, True
                    break
            valued = any(matches(g, key, module, param) for g in self.values or ())
            if len(self._inside) > 100_000:
                self._inside.clear()
            hit = self._inside[(key, module, param)] = (dim, sliced, valued)
        return hit

    def wants_step(self, step: int) -> bool:
        """True when step number `step` is to be recorded (every= and steps=)."""
        return step % self.every == 0 and (self.steps is None or step in self.steps)

    def wants_module(self, module: str) -> bool:
        """True when nodes owned by `module` are recorded: it or one of its parents matches a modules= glob."""
        if self.modules is None:
            return True
        parts = module.split(".") if module else [""]
        candidates = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
        return any(fnmatch.fnmatchcase(c, g) for c in candidates for g in self.modules)

    def wants_tied(self, name: str) -> bool:
        """True when parameter `name` (its first name) is recorded under both filters: where it is tied, when any of
        its names passes modules= (its module) and params=."""
        names = self.aliases.get(name, (name,))
        return any(self.wants_module(n.rsplit(".", 1)[0] if "." in n else "") and self.wants_param(n) for n in names)

    def wants_param(self, name: str) -> bool:
        """True when parameter `name` (qualified) is recorded: it matches a params= glob (all when None)."""
        return self.params is None or any(fnmatch.fnmatchcase(name, g) for g in self.params)

    @property
    def node_level(self) -> str | None:
        """Statistics level inside node hooks, or None when no node is hooked (stats='params')."""
        return None if self.stats == "params" else self.stats

    @property
    def judges_spikes(self) -> bool:
        """The flight recorder's 'spike' trigger is on: each top-level backward pass notes its parameters' total
        gradient norm (`StepState.pass_norm`)."""
        return self.keep is not None and "spike" in self.dump_on

    @property
    def param_level(self) -> str:
        """Statistics level of param_grad rows: all statistics except at stats='shape'/'health'."""
        return "full" if self.stats == "params" else self.stats


def _steps(steps) -> frozenset | range:
    """record(steps=...) checked: a range (kept as it is) or an iterable of whole numbers (a
    frozenset), every step number >= 0; raises RecordUsageError saying what was given and what is taken."""
    takes = "a range or a list of step numbers >= 0 (e.g. range(100, 110) or [0, 5, 9])"
    if isinstance(steps, (str, bytes)) or not hasattr(steps, "__iter__"):
        raise RecordUsageError(f"record(steps=...) takes {takes}, got {steps!r}")
    if isinstance(steps, range):
        if len(steps) and min(steps) < 0:
            raise RecordUsageError(f"record(steps=...) takes step numbers >= 0, got {steps!r}")
        return steps
    try:
        numbers = frozenset(steps)
    except TypeError:
        raise RecordUsageError(f"record(steps=...) takes {takes}, got {steps!r}") from None
    bad = sorted((s for s in numbers if not isinstance(s, Integral) or isinstance(s, bool) or s < 0), key=repr)
    if bad:
        raise RecordUsageError(f"record(steps=...) takes {takes}; not a step number: {', '.join(map(repr, bad[:5]))}")
    return frozenset(int(s) for s in numbers)


def _flight(keep, dump_on, spike_factor, stats, every, steps) -> tuple[tuple[str, ...], float]:
    """Check the flight recorder's options; returns (dump_on, spike_factor) with their defaults filled in."""
    if keep is None:
        for name, value in (("dump_on", dump_on), ("spike_factor", spike_factor)):
            if value is not None:
                raise RecordUsageError(f"record({name}=...) is an option of the flight recorder: give keep=N too")
        return (), SPIKE_FACTOR
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise RecordUsageError(f"record(keep=...) takes a whole number >= 1 (steps held in memory), got {keep!r}")
    if every != 1 or steps is not None:
        raise RecordUsageError(
            "record(keep=N) measures every step into its ring: it does not combine with every= or steps="
        )
    if dump_on is None:
        dump_on = DUMP_ON
    elif isinstance(dump_on, str):
        dump_on = (dump_on,)
    try:
        dump_on = tuple(dump_on)
    except TypeError:
        dump_on = None
    if dump_on is None or not all(d in DUMP_ON for d in dump_on):
        raise RecordUsageError(
            f"record(dump_on=...) takes some of {', '.join(map(repr, DUMP_ON))} (or () for rec.dump() only), "
            f"got {dump_on!r}"
        )
    if spike_factor is None:
        spike_factor = SPIKE_FACTOR
    if isinstance(spike_factor, bool) or not isinstance(spike_factor, (int, float)) or not spike_factor > 1:
        raise RecordUsageError(
            f"record(spike_factor=...) is a number > 1 (times the running median of a total gradient norm), "
            f"got {spike_factor!r}"
        )
    if "nonfinite" in dump_on and stats == "shape":
        raise RecordUsageError(
            "record(keep=..., dump_on=('nonfinite', ...)) dumps on NaN/Inf in measured gradients; stats='shape' "
            "measures no value, so it could never fire: use stats='health' or 'full', or leave 'nonfinite' out"
        )
    if "spike" in dump_on and stats == "shape":
        raise RecordUsageError(
            "record(keep=..., dump_on=('spike', ...)) compares gradient norms; stats='shape' measures none: "
            "use stats='health' or 'full', or leave 'spike' out of dump_on"
        )
    return dump_on, float(spike_factor)
