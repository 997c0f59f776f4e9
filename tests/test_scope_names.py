"""The models' names read once per model structure (gradstore.recording.modules.Structure, record._names_of).

A decorated step re-enters its scope every call; the module and parameter names (and compiled regions, the
parameters the filters keep, FSDP2's modules) are read again only when the models' structure changed. Each test
here changes the model between decorated steps in one of the ways a model can change and compares everything
the database holds with the same steps recorded by a fresh record object per step (which reads every name
anew: the path without the cache), and checks some rows against plain PyTorch.
"""

import gc
import sqlite3
import warnings
import weakref

import pytest
import torch
import torch.nn as nn
from _tables import SEQUENCE_NR

import gradstore
from gradstore.errors import RecordUsageWarning
from gradstore.recording import intercept
from gradstore.recording import recorder as gs_recorder
from gradstore.recording.modules import Structure

ORIGINAL_ENGINE_ENTRY = torch.autograd.graph._engine_run_backward
# columns that differ between two recordings of the same steps: clocks, process ids, leases
_CLOCKS = {"created_at", "finished_at", "started_at", "ended_at", "waited", "duration", "setup", "finish", "at"}
_CLOCKS |= {"pid", "heartbeat_at", "lease", "host", "start_ns", "duration_ns"}


def dump(db) -> dict[str, list[tuple]]:
    """Every table of a gradstore database but the claims and Alembic's, without the clock columns, sorted; autograd
    sequence numbers counted from the database's lowest (a thread's counter runs on from one recording to the
    next)."""
    conn = sqlite3.connect(db)
    try:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        out = {}
        for t in tables:
            if t in ("claims", "alembic_version"):
                continue
            cols = [r[1] for r in conn.execute(f'PRAGMA table_info("{t}")') if r[1] not in _CLOCKS]
            quoted = ", ".join(
                f'"{c}" - (SELECT MIN("{c}") FROM "{t}")' if (t, c) in SEQUENCE_NR else f'"{c}"' for c in cols
            )
            rows = conn.execute(f'SELECT {quoted} FROM "{t}"').fetchall()
            out[t] = sorted(rows, key=repr)
        return out
    finally:
        conn.close()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        for layer in self.body:
            x = torch.tanh(layer(x))
        extra = getattr(self, "extra", None)
        if isinstance(extra, nn.Module):
            x = extra(x)
        scale = self._parameters.get("scale")
        if scale is not None:
            x = x * scale
        return self.head(x)


def train_step(model, x):
    model(x).pow(2).sum().backward()
    for p in model.parameters():
        p.grad = None if p.grad is None else p.grad  # the .grad stays for the final rows


# each change happens before the step of its index; None: unchanged (the names must come from the cache)
def _changes():
    def add_module(m):
        m.extra = nn.Linear(4, 4)

    def replace_param(m):
        m.body[0].weight = nn.Parameter(m.body[0].weight.detach() * 0.5)

    def replace_module(m):
        m.extra = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    def delete_module(m):
        del m.extra

    def add_param(m):
        m.scale = nn.Parameter(torch.full((4,), 2.0))

    def insert_layer(m):  # ModuleList.insert writes _modules directly (no registration hook of torch's)
        m.body.insert(1, nn.Linear(4, 4))

    def delete_param(m):
        del m.scale

    def direct_write(m):  # a private write no hook sees
        m.body._modules["1"] = nn.Linear(4, 4)

    def unused_module(m):  # named and its parameters listed, never called
        m.spare = nn.Linear(4, 4)

    def param_dict_write(m):
        m.head._parameters["bias"] = nn.Parameter(torch.zeros(2))

    return [
        None,
        add_module,
        None,
        replace_param,
        replace_module,
        None,
        delete_module,
        add_param,
        insert_layer,
        None,
        delete_param,
        direct_write,
        unused_module,
        param_dict_write,
        None,
    ]


def _run(db, fresh: bool, monkeypatch, **options):
    """The steps of `_changes()` on a fresh seeded model, recorded by one record object (fresh=False) or a new
    one per step; returns (model, number of times the names were read, the .grad of body[0].weight per step)."""
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(3, 4)
    reads = []
    real = gs_recorder.record._read_names
    monkeypatch.setattr(gs_recorder.record, "_read_names", lambda self, models: reads.append(1) or real(self, models))
    rec = gradstore.record("names", db=db, **options)
    step = rec(train_step)
    grads = []
    for change in _changes():
        if change is not None:
            change(model)
        if fresh:
            gradstore.record("names", db=db, **options)(train_step)(model, x)
        else:
            step(model, x)
        grads.append(model.body[0].weight.grad.clone())
        model.zero_grad(set_to_none=True)
    gradstore.record("names", db=db).flush()
    return model, len(reads), grads


@pytest.mark.parametrize(
    "options",
    [{}, {"stats": "params"}, {"modules": "body.*"}, {"params": "*.weight"}, {"modules": ["extra*", "head"]}],
    ids=["full", "params", "modules", "params-filter", "modules-list"],
)
def test_changed_models_are_named_as_without_the_cache(tmp_path, monkeypatch, options):
    cached_db, fresh_db = str(tmp_path / "cached.db"), str(tmp_path / "fresh.db")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecordUsageWarning)  # a filter that matches nothing yet (tested below)
        _, cached_reads, cached_grads = _run(cached_db, False, monkeypatch, **options)
        _, fresh_reads, fresh_grads = _run(fresh_db, True, monkeypatch, **options)
    changes = _changes()
    steps = len(changes)
    # gradients are the same with either recorder
    assert all(torch.equal(a, b) for a, b in zip(cached_grads, fresh_grads))
    cached, fresh = dump(cached_db), dump(fresh_db)
    assert cached.keys() == fresh.keys()
    for table in cached:
        assert cached[table] == fresh[table], table
    # the cache was used: names read once, then once per change (10 changes, 5 unchanged steps)
    assert cached_reads == 1 + sum(c is not None for c in changes[1:])
    assert fresh_reads == steps
    with gradstore.open(cached_db) as store:
        steps_frame = store.steps("names")
        assert list(steps_frame.step) == list(range(steps))
        names = store.param_status("names")
    by_step = {s: set(names[names.step == s].param) for s in range(steps)}
    wants_param = options.get("params") is None and options.get("modules") in (None, "body.*")
    if options.get("modules") is None and options.get("params") is None:
        # what plain PyTorch names the model's parameters, step by step
        torch.manual_seed(0)
        model, expected = Net(), []
        for change in changes:
            if change is not None:
                change(model)
            expected.append({n for n, _ in model.named_parameters()})
        assert [by_step[s] for s in range(steps)] == expected
    elif wants_param:  # modules='body.*': the body's layers, as they come and go
        assert by_step[7] == {"body.0.weight", "body.0.bias", "body.1.weight", "body.1.bias"}
        assert by_step[8] == by_step[7] | {"body.2.weight", "body.2.bias"}


def test_replaced_parameter_gradient_is_the_new_one(tmp_path, monkeypatch):
    """After `body[0].weight` is replaced between steps, its param_grad rows are the new parameter's gradient
    (norm by plain PyTorch), not the old parameter's (which no longer gets one)."""
    db = str(tmp_path / "g.db")
    model, _, grads = _run(db, False, monkeypatch, stats="params")
    with gradstore.open(db) as store:
        pg = store.param_grads("names")
    for step in (2, 3, 4):  # before and after the replacement at step 3
        rows = pg[(pg.step == step) & (pg.param == "body.0.weight")]
        assert len(rows) >= 1
        assert rows.norm.iloc[0] == pytest.approx(grads[step].double().norm().item(), rel=1e-6)


def test_structure_sees_every_change():
    torch.manual_seed(0)
    m = Net()
    models = [("", m)]
    s = Structure(models)
    assert s.same(models)
    assert not s.same([("", Net())])  # another model
    assert not s.same([("x", m)])  # another prefix
    for change in [c for c in _changes() if c is not None]:
        change(m)
        assert not s.same(models), change.__name__
        s = Structure(models)
        assert s.same(models)
    w = m.head.weight
    w.data = torch.zeros_like(w)  # the same parameter object: the names stand
    assert s.same(models)
    m.head.weight.requires_grad_(False)  # read when measured, not part of the names
    assert s.same(models)
    m.head.__class__ = type("Head", (nn.Linear,), {})  # a class swap (as fully_shard and parametrize do)
    assert not s.same(models)


def test_structure_sees_an_entry_moved_to_the_next_dict():
    """The flat fingerprint keeps each dict's size: an entry moved from one registry to the one after it (the same
    objects in the same order, flat) is a change."""
    seq = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    models = [("", seq)]
    s = Structure(models)
    first, second = seq[0], seq[1]
    bias = first._parameters.pop("bias")  # the last entry of seq[0]'s _parameters ...
    second._modules["bias"] = bias  # ... is now the first of seq[1]'s _modules, the dict after it
    assert not s.same(models)
    del second._modules["bias"]
    first._parameters["bias"] = bias
    assert s.same(models)


def test_structure_of_a_model_that_walks_its_own_way_is_never_the_same():
    class Odd(nn.Linear):
        def named_parameters(self, *a, **k):
            return super().named_parameters(*a, **k)

    m = nn.Sequential(Odd(2, 2))
    s = Structure([("", m)])
    assert not s.checkable and not s.same([("", m)])


def test_the_cache_does_not_keep_a_model_alive(tmp_path):
    db = str(tmp_path / "alive.db")
    step = gradstore.record("alive", db=db)(train_step)
    model = Net()
    step(model, torch.randn(3, 4))
    ref, head = weakref.ref(model), weakref.ref(model.head.weight)
    del model
    gc.collect()
    assert ref() is None and head() is None
    step(Net(), torch.randn(3, 4))  # a new model: named anew
    step.recorder.flush()
    with gradstore.open(db) as store:
        assert sorted(set(store.param_status("alive", step=1).param)) == sorted(n for n, _ in Net().named_parameters())


def test_filter_warning_once_per_record_object(tmp_path):
    """A modules= glob that matches nothing warns once per record object, also when the model then gains a
    matching module (behaviour as before the cache); a fresh record object warns again."""
    db = str(tmp_path / "warn.db")
    model = Net()
    step = gradstore.record("warn", db=db, modules="extra")(train_step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(model, torch.randn(3, 4))
        step(model, torch.randn(3, 4))
        model.extra = nn.Linear(4, 4)
        step(model, torch.randn(3, 4))
    idle = [w for w in caught if issubclass(w.category, RecordUsageWarning)]
    assert len(idle) == 1 and "'extra' matches no module name" in str(idle[0].message)
    step.recorder.flush()
    with gradstore.open(db) as store:
        status = store.param_status("warn")
    assert set(status[status.step == 2].param) == {"extra.weight", "extra.bias"}
    assert status[status.step < 2].empty


def test_nothing_stays_installed_between_decorated_steps(tmp_path):
    mm = torch.nn.modules.module
    before = (len(mm._global_forward_hooks), len(mm._global_forward_pre_hooks))
    show = warnings._showwarnmsg
    model = Net()
    step = gradstore.record("between", db=str(tmp_path / "b.db"), model=model, forward=True)(train_step)
    for _ in range(3):
        step(model, torch.randn(3, 4))
        assert (len(mm._global_forward_hooks), len(mm._global_forward_pre_hooks)) == before
        assert torch.autograd.graph._engine_run_backward is ORIGINAL_ENGINE_ENTRY
        assert intercept.active() is None
        assert warnings._showwarnmsg is show
    with gradstore.record("with", db=str(tmp_path / "w.db"), model=model):
        train_step(model, torch.randn(3, 4))
    assert (len(mm._global_forward_hooks), len(mm._global_forward_pre_hooks)) == before
    assert torch.autograd.graph._engine_run_backward is ORIGINAL_ENGINE_ENTRY


def test_the_c_check_of_the_structure_says_what_the_python_fingerprint_says():
    """`native.same_structure` (the C++ hooks' comparison) against the fingerprint built in Python
    (`Structure._fingerprint`), unchanged and after every kind of change, and None (no judgement) where a module
    lacks its registries."""
    import operator

    from gradstore.recording import native

    if native.load(wait=True) is None:
        pytest.skip(f"C++ hooks: {native.status()}")
    same = native.same_structure()
    assert same is not None

    def python_says(s, models):
        now = s._fingerprint([m for _, m in models])
        return len(now) == len(s._print) and all(map(operator.is_, now, s._print))

    torch.manual_seed(0)
    m = Net()
    models = [("", m)]
    s = Structure(models)
    assert same([m] + s._modules, s._print) is True and python_says(s, models)
    for change in [c for c in _changes() if c is not None]:
        s = Structure(models)
        change(m)
        got = same([m] + s._modules, s._print)
        assert got is python_says(s, models) is False, change.__name__
    s = Structure(models)
    assert same([m] + s._modules, s._print) is True
    assert same([m] + s._modules, s._print[:-1]) is False and same([m] + s._modules, s._print + [m]) is False
    seq = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    s = Structure([("", seq)])
    bias = seq[0]._parameters.pop("bias")
    seq[1]._modules["bias"] = bias  # moved to the next dict: the same objects flat, another layout
    assert same([seq] + s._modules, s._print) is False and not python_says(s, [("", seq)])
    bare = nn.Linear(2, 2)
    del bare._parameters  # an unfinished module: no judgement
    assert same([bare], [nn.Linear, bare._modules]) is None  # its class and _modules as stored, no _parameters


def test_a_torchscript_submodule_is_named_and_a_failed_entry_leaves_no_scope_open(tmp_path, monkeypatch):
    """A model holding a `torch.jit.script`ed submodule (whose registries are torch.jit's mappings, not dicts: its
    structure is read again every step) records with the scripted module named; an error while a scope opens
    reaches the caller and leaves no scope open, so the next `record` opens."""
    db = str(tmp_path / "s.db")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.script is deprecated in torch 2.13
        net = nn.Sequential(nn.Linear(2, 2), torch.jit.script(nn.Sequential(nn.Linear(2, 2), nn.ReLU())))
    assert not Structure([("", net)]).checkable
    x = torch.randn(3, 2)
    for _ in range(2):
        with gradstore.record("script", db=db, model=net):
            net(x).sum().backward()
    gradstore.record("script", db=db).flush()
    conn = sqlite3.connect(db)
    modules = conn.execute("SELECT module, COUNT(*) FROM module_calls GROUP BY module ORDER BY module").fetchall()
    assert modules == [("", 2), ("0", 2), ("1", 2)]
    keys = {k for (k,) in conn.execute("SELECT key FROM nodes")}
    assert {"1/AddmmBackward0#0", "1/ReluBackward0#0", "param:1.0.weight", "param:1.0.bias"} <= keys
    conn.close()

    def broken(self, models):
        raise RuntimeError("reading the names failed")

    monkeypatch.setattr(gs_recorder.record, "_known_names", broken)
    with pytest.raises(RuntimeError, match="reading the names failed"):
        with gradstore.record("broken", db=db, model=net):
            pass
    monkeypatch.undo()
    assert gs_recorder._open_scope is None
    assert torch.autograd.graph._engine_run_backward is ORIGINAL_ENGINE_ENTRY
    with gradstore.record("after", db=db, model=net):
        net(x).sum().backward()
