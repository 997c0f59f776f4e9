"""The C++ node hooks (gradstore.recording.native) record exactly what the Python hooks
(gradstore.recording.passes) record.

Each case runs the same seeded computation twice, once with each kind of hook, and compares every tensor
row (statistics bit for bit), every call (order and node) and every pass (nesting); the gradients and
parameters must also be bit-identical to a run without gradstore. The cases cover what the C++ side hands
to Python (float16, non-dense gradients, a user Function, a tensor split across threads) and what it keeps for
itself (dense float32/float64 CPU gradients, NaN/Inf among them, reuse of one result for the same memory).
"""

import os
import sqlite3
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.utils.checkpoint as cp

import gradstore
from gradstore.recording import kernel, native, passes

pytestmark = pytest.mark.skipif(native.load(wait=True) is None, reason=f"C++ hooks: {native.status()}")

TENSOR_ROWS = """
SELECT st.step, p.pass, c.seq, n.key, t.role, t.slot, t.status, t.reason, t.dtype, t.shape, t.numel,
       t.norm, t.min, t.max, t.mean, t.std, t.nan, t.posinf, t.neginf, t.zeros, t.checksum,
       t.layout, t.nnz, t.coalesced
FROM tensors t JOIN steps st ON st.id = t.step_id JOIN passes p ON p.id = t.pass_id
JOIN nodes n ON n.id = t.node_id LEFT JOIN calls c ON c.id = t.call_id
ORDER BY st.step, t.id"""
CALLS = """
SELECT st.step, p.pass, c.seq, n.key, c.duration IS NULL FROM calls c JOIN passes p ON p.id = c.pass_id
JOIN steps st ON st.id = p.step_id JOIN nodes n ON n.id = c.node_id ORDER BY st.step, c.seq"""
PASSES = """
SELECT st.step, p.pass, p.parent_pass, p.parent_seq, p.kind, p.create_graph, p.retain_graph, p.roots, p.nodes
FROM passes p
JOIN steps st ON st.id = p.step_id ORDER BY st.step, p.pass"""


def record_both(tmp_path, monkeypatch, make, run, steps=2, **options):
    """Record `steps` calls of run(state) with the Python hooks and with the C++ hooks, each from make() (a
    fresh seeded state). Returns {'python'|'native': (tensor rows, calls, passes, state)} and checks that
    the C++ hooks recorded every pass of the 'native' run (and none of the 'python' one)."""
    out = {}
    installs = []
    real = native.available

    for mode in ("python", "native"):
        with monkeypatch.context() as m:
            if mode == "python":
                m.setattr(native, "available", lambda level: None)
            else:
                m.setattr(native, "available", lambda level: (installs.append(level), real(level))[1])
            state = make()
            db = str(tmp_path / f"{mode}.db")
            with gradstore.record(mode, db=db, model=state["model"], **options) as rec:
                for i in range(steps):
                    run(state)
                    if i + 1 < steps:
                        rec.step()
        con = sqlite3.connect(db)
        out[mode] = (
            con.execute(TENSOR_ROWS).fetchall(),
            con.execute(CALLS).fetchall(),
            con.execute(PASSES).fetchall(),
            state,
        )
        errors = con.execute("SELECT error FROM steps WHERE error IS NOT NULL").fetchall()
        con.close()
        assert errors == [], errors
    if options.get("stats", "full") != "params":
        assert installs, "the C++ hooks were never asked for"
    return out


def assert_same(out):
    py, nat = out["python"], out["native"]
    assert len(py[0]) > 0
    assert nat[2] == py[2]  # passes: nesting, node and call counts
    assert nat[1] == py[1]  # calls: order, node, whether the hook after the node fired
    for a, b in zip(py[0], nat[0]):
        assert a == b
    assert len(nat[0]) == len(py[0])


def plain_run(state):
    """Forward, backward and an SGD step; the loss and gradients are kept in the state for comparisons."""
    model, x = state["model"], state["x"]
    loss = state["loss_fn"](model, x)
    loss.backward()
    state.setdefault("grads", []).append([p.grad.clone() for p in model.parameters()])
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
            p.grad = None


def mlp_state(dtype=torch.float32, loss_fn=None):
    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).to(dtype)
        x = torch.randn(4, 16, dtype=dtype)
        return {"model": model, "x": x, "loss_fn": loss_fn or (lambda m, x: m(x).pow(2).mean())}

    return make


@pytest.mark.parametrize("stats", ["full", "health", "shape", "params"])
def test_mlp_rows_equal_and_gradients_untouched(tmp_path, monkeypatch, stats):
    out = record_both(tmp_path, monkeypatch, mlp_state(), plain_run, stats=stats)
    assert_same(out)
    plain = mlp_state()()
    for _ in range(2):
        plain_run(plain)
    for recorded in (out["python"][3], out["native"][3]):
        for ga, gb in zip(plain["grads"], recorded["grads"]):
            assert all(torch.equal(a, b) for a, b in zip(ga, gb))
        assert all(torch.equal(a, b) for a, b in zip(plain["model"].parameters(), recorded["model"].parameters()))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_float64_and_bfloat16(tmp_path, monkeypatch, dtype):
    assert_same(record_both(tmp_path, monkeypatch, mlp_state(dtype), plain_run))


def test_nonfinite_gradients_counted_in_cpp_as_in_python(tmp_path, monkeypatch):
    """A gradient holding NaN or Inf: the C++ hooks count them with the kernel's gs_stats, and every row equals
    the Python hooks' (which measure with the same kernel function)."""

    def loss_fn(m, x):
        y = m(x)
        return (y * torch.tensor([float("nan"), float("inf"), 1, 1, 1, 1, 1, -float("inf")])).sum()

    out = record_both(tmp_path, monkeypatch, mlp_state(loss_fn=loss_fn), plain_run)
    assert_same(out)
    rows = out["native"][0]
    assert any(r[16] and r[16] > 0 for r in rows) and any(r[17] and r[17] > 0 for r in rows)


@pytest.mark.parametrize("stats", ["full", "health"])
def test_float64_gradients_whose_squares_overflow(tmp_path, monkeypatch, stats):
    """Finite float64 gradients around 1e200: the kernel's sum of squares is Inf, the C++ hooks hand them to the
    scaled measurement: the same rows as the Python hooks, finite norms, no non-finite count."""
    make = mlp_state(torch.float64, lambda m, x: m(x).sum() * 1e200)
    out = record_both(tmp_path, monkeypatch, make, plain_run, steps=1, stats=stats)  # (SGD on 1e200 overflows)
    assert_same(out)
    rows = [r for r in out["native"][0] if r[6] == 0]  # status ok
    assert max(r[11] for r in rows) > 1e200 and all(r[11] < float("inf") for r in rows)
    assert all(r[16] == r[17] == r[18] == 0 for r in rows)


class Scale(torch.autograd.Function):
    """A user Function whose backward changes the incoming gradient in place through .data (no version bump)
    and returns a non-dense view: the C++ hooks must measure its grad_inputs afresh."""

    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, g):
        g.data.mul_(2.0)  # invisible to the version counter
        wide = torch.cat([g, g], dim=-1)
        return wide[..., ::2] * 1.5  # every other column: a non-dense gradient


def test_custom_function_and_non_dense_gradients(tmp_path, monkeypatch):
    def loss_fn(m, x):
        h = m[0](x)
        h = Scale.apply(h)
        return m[2](m[1](h)).pow(2).mean() + h.t().sum() * 0.5

    out = record_both(tmp_path, monkeypatch, mlp_state(loss_fn=loss_fn), plain_run)
    assert_same(out)
    keys = {r[3] for r in out["native"][0]}
    assert any(k.startswith("ScaleBackward") for k in keys)


@pytest.mark.parametrize("stats", ["full", "shape"])
def test_sparse_embedding_gradient_is_handed_to_python_and_rows_equal(tmp_path, monkeypatch, stats):
    """nn.Embedding(sparse=True): an uncoalesced COO gradient (duplicate indices), which the C++ hooks hand to the
    Python measurement: the same rows (layout, nnz, coalesced, statistics) either way, and .grad left as it was."""

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 3))
        return {"model": model, "x": torch.tensor([[1, 2, 1], [7, 1, 9]])}

    def run(state):
        model = state["model"]
        model(state["x"]).pow(2).sum().backward()
        g = model[0].weight.grad
        state.setdefault("grads", []).append((g.is_coalesced(), g._indices().clone(), g._values().clone()))
        model.zero_grad(set_to_none=True)

    out = record_both(tmp_path, monkeypatch, make, run, stats=stats)
    assert_same(out)
    sparse = [r for r in out["native"][0] if r[-3] is not None]
    assert len(sparse) == 3 * 2  # grad_inputs[0], AccumulateGrad's grad_outputs[0] and .grad, in 2 steps
    assert all(r[-3:] == ("sparse_coo", 6, 0) and r[6] == 0 for r in sparse)  # status ok
    plain = make()
    for _ in range(2):
        run(plain)
    for recorded in (out["python"][3], out["native"][3]):
        for (ca, ia, va), (cb, ib, vb) in zip(plain["grads"], recorded["grads"]):
            assert not ca and not cb and torch.equal(ia, ib) and torch.equal(va, vb)


def test_reentrant_checkpoint_nested_passes(tmp_path, monkeypatch):
    def loss_fn(m, x):
        h = cp.checkpoint(m[0], x, use_reentrant=True)
        return m[2](m[1](h)).pow(2).mean()

    make = mlp_state(loss_fn=lambda m, x: loss_fn(m, x.requires_grad_()))
    out = record_both(tmp_path, monkeypatch, make, plain_run)
    assert_same(out)
    nested = [p for p in out["native"][2] if p[2] is not None]
    assert nested and all(p[3] is not None for p in nested)  # the call the nested pass ran inside


def test_double_backward_and_retained_graph(tmp_path, monkeypatch):
    def run(state):
        model, x = state["model"], state["x"]
        loss = model(x).pow(2).mean()
        (g,) = torch.autograd.grad(loss, [model[0].weight], create_graph=True)
        penalty = g.pow(2).sum()
        penalty.backward(retain_graph=True)
        penalty.backward()  # the same graph again: the first pass's hooks are gone, the second's fire
        state.setdefault("grads", []).append([p.grad.clone() for p in model.parameters()])
        for p in model.parameters():
            p.grad = None

    out = record_both(tmp_path, monkeypatch, mlp_state(), run)
    assert_same(out)
    assert len({p[1] for p in out["native"][2]}) == 3  # three passes per step


def test_module_filter(tmp_path, monkeypatch):
    out = record_both(tmp_path, monkeypatch, mlp_state(), plain_run, modules="2")
    assert_same(out)
    everything = (
        record_both(tmp_path / "all", monkeypatch, mlp_state(), plain_run) if not (tmp_path / "all").mkdir() else None
    )
    assert 0 < len(out["native"][1]) < len(everything["native"][1])


def test_large_gradient_split_across_threads(tmp_path, monkeypatch):
    """At 2 torch threads a gradient of >= 2 * kernel.SPLIT elements is reduced in shares (in Python)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:

        def make():
            torch.manual_seed(0)
            model = torch.nn.Linear(1024, 1100)
            return {"model": model, "x": torch.randn(2, 1024), "loss_fn": lambda m, x: m(x).sum()}

        out = record_both(tmp_path, monkeypatch, make, plain_run, steps=1)
    finally:
        torch.set_num_threads(threads)
    assert_same(out)
    assert any(r[10] >= 2 * kernel.SPLIT for r in out["native"][0] if r[10])


def test_gpt2_rows_equal(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")

    def make():
        torch.manual_seed(3)
        cfg = transformers.GPT2Config(
            n_layer=1,
            n_embd=32,
            n_head=2,
            vocab_size=100,
            n_positions=16,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        model = transformers.GPT2LMHeadModel(cfg)
        ids = torch.randint(0, 100, (2, 16))
        return {"model": model, "x": ids, "loss_fn": lambda m, x: m(input_ids=x, labels=x).loss}

    for stats in ("full", "shape"):
        (tmp_path / stats).mkdir()
        assert_same(record_both(tmp_path / stats, monkeypatch, make, plain_run, stats=stats))


def test_python_measurement_fault_is_a_skipped_row(tmp_path, monkeypatch):
    """A fault in the measurement the C++ hooks hand to Python (here: every bfloat16 tensor) leaves a
    skipped row with the reason; training and the other rows go on."""
    from gradstore.recording import stats

    real = stats.measure

    def broken(t, level="full", checksum=False):
        if t.dtype == torch.bfloat16:
            raise RuntimeError("measurement exploded")
        return real(t, level, checksum)

    monkeypatch.setattr(stats, "measure", broken)
    model = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    db = str(tmp_path / "f.db")
    with gradstore.record("f", db=db, model=model):
        (model(x).to(torch.bfloat16).float().sum()).backward()
    assert model.weight.grad is not None
    with gradstore.open(db) as store:
        t = store.tensors("f")
    bad = t[t.status == "skipped"]
    assert len(bad) > 0 and bad.reason.str.contains("the tensor could not be").all()
    assert (t[t.dtype == "float32"].status == "ok").all()


@pytest.mark.parametrize("settled", ["whenever", "before the step", "during backward"])
def test_not_built_without_a_compiler(tmp_path, python_hooks, settled):
    """No C++ compiler: one warning, pointing at the user's line wherever the failed build is noticed (at record
    entry, in a module hook, inside torch.autograd.backward), and the Python hooks record (a fresh process and
    cache directory)."""
    script = textwrap.dedent(f"""
        import threading, time, warnings, torch, gradstore
        from gradstore.recording import native
        def settle():
            while native.status() == "building":
                time.sleep(0.01)
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as w:
            torch.manual_seed(0)
            m = torch.nn.Linear(3, 2)
            if {settled == "before the step"}:
                native.load()  # the background build starts, and fails
                settle()
            if {settled == "during backward"}:  # the background build held until the backward pass
                gate, build = threading.Event(), native._settle
                native._settle = lambda wait: (gate.wait(), build(wait))
            with gradstore.record("r", db={str(tmp_path / "x.db")!r}, model=m):
                out = m(torch.ones(1, 3)).sum()
                if {settled == "during backward"}:  # the build ends inside torch.autograd.backward
                    out.register_hook(lambda g: (gate.set(), settle()) and None)
                out.backward()
            native.load(wait=True)
        print(native.status())
        print(sum("C++ node hooks" in str(x.message) for x in w))
        print([x.filename for x in w if "C++ node hooks" in str(x.message)][0])
    """)
    env = dict(os.environ, CXX="/nonexistent/c++", GRADSTORE_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    status, warned, where = proc.stdout.split("\n")[:3]
    assert status.startswith("not available:") and "no C++ compiler" in status
    assert int(warned) == 1
    assert where == "<string>"  # the user's code (here the -c script), not gradstore's or threading's
    torch.manual_seed(0)  # the same step here, with the Python hooks (the fixture)
    m = torch.nn.Linear(3, 2)
    with gradstore.record("r", db=str(tmp_path / "y.db"), model=m):
        m(torch.ones(1, 3)).sum().backward()
    with sqlite3.connect(tmp_path / "x.db") as a, sqlite3.connect(tmp_path / "y.db") as b:
        assert a.execute(TENSOR_ROWS).fetchall() == b.execute(TENSOR_ROWS).fetchall()


def test_turned_off(tmp_path):
    env = dict(os.environ, GRADSTORE_NATIVE="0")
    probe = "from gradstore.recording import native; native.load(); print(native.status())"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert proc.stdout.strip() == "not available: turned off (GRADSTORE_NATIVE=0)"


def test_step_state_counts_calls_in_cpp():
    state = passes.StepState(native.load(wait=True))
    assert [state.next_seq() for _ in range(3)] == [0, 1, 2]
    assert state.open_call() is None


def _reachable(root) -> int:
    """How many nodes are reachable from `root` along next_functions (plain torch)."""
    seen, stack = set(), [root]
    while stack:
        fn = stack.pop()
        if fn is not None and fn not in seen:
            seen.add(fn)
            stack.extend(n for n, _ in fn.next_functions)
    return len(seen)


@pytest.mark.parametrize("how", ["enable", "config"])
def test_compiled_autograd_records_the_pass_and_parameter_gradients(tmp_path, how):
    """Compiled autograd traces every Python node hook into its compiled backward graph, where gradstore's would
    break the graph at every node: under it a pass is recorded with its graph (nodes, edges) and the parameter
    gradients, without node hooks, so no call and no grad_output / grad_input row. Nothing crashes, no warning,
    no graph break more than without recording, and the gradients are the ones compiled autograd gives
    unrecorded. `enable`: eager backward inside `compiled_autograd._enable`; `config`:
    `torch._dynamo.config.compiled_autograd` with `loss.backward()` inside a torch.compile'd step."""
    import torch._dynamo

    old = torch._dynamo.config.compiled_autograd
    torch._dynamo.config.compiled_autograd = how == "config"  # before torch.compile wraps the step: it reads it
    try:
        _compiled_autograd_case(tmp_path, how)
    finally:
        torch._dynamo.config.compiled_autograd = old


def _compiled_autograd_case(tmp_path, how):
    import warnings

    from torch._dynamo import compiled_autograd
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    init = {k: v.clone() for k, v in m.state_dict().items()}
    xs = [torch.randn(2, 4) for _ in range(2)]
    nodes = _reachable(m(xs[0]).sum().grad_fn)

    @torch.compile(backend="eager")
    def compiled_step(x):
        loss = m(x).sum()
        loss.backward()
        return loss

    def step(x):
        if how == "enable":
            with compiled_autograd._enable(torch.compile(backend="eager")):
                m(x).sum().backward()
        else:
            compiled_step(x)

    def run(record: bool):
        m.load_state_dict(init)
        m.zero_grad(set_to_none=True)
        breaks = sum(counters["graph_break"].values())
        grads = []
        db = str(tmp_path / "ca.db")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scope = gradstore.record("ca", db=db, model=m) if record else None
            rec = scope.__enter__() if scope is not None else None
            try:
                for x in xs:
                    step(x)
                    grads.append([p.grad.clone() for p in m.parameters()])
                    if rec is not None and x is not xs[-1]:
                        rec.step()
            finally:
                if scope is not None:
                    scope.__exit__(None, None, None)
        return grads, sum(counters["graph_break"].values()) - breaks, [str(w.message) for w in caught], db

    run(False)  # compiles once, so that both runs below find the same caches
    plain, plain_breaks, _, _ = run(False)
    recorded, breaks, caught, db = run(True)
    assert all(torch.equal(a, b) for ga, gb in zip(plain, recorded) for a, b in zip(ga, gb))
    assert breaks == plain_breaks and caught == [], (breaks, plain_breaks, caught)
    with gradstore.open(db) as store:
        steps = store.steps("ca")
        passes = store.passes("ca")
        t = store.tensors("ca")
        calls = store.calls("ca")
    assert list(steps.status) == ["ok", "ok"] and steps.error.isna().all()
    assert list(steps.passes) == [1, 1] and list(steps.tracing_passes) == [0, 0]
    assert list(passes.kind) == ["backward", "backward"] and list(passes.nodes) == [nodes, nodes]
    assert calls.empty and set(t.role) == {"param_grad", "grad_output"}
    # each pass's root (the loss's SumBackward0): one skipped grad_output row saying why no node row is there
    roots = t[t.role == "grad_output"]
    assert list(roots.step) == [0, 1] and set(roots.key) == {"SumBackward0#0"} and set(roots.status) == {"skipped"}
    assert roots.reason.str.startswith("compiled autograd ran this pass").all()
    assert passes.calls.isna().all()  # not known: no node hooked
    names = [n for n, _ in m.named_parameters()]
    for step, grads in enumerate(recorded):
        for name, g in zip(names, grads):
            (row,) = t[(t.step == step) & (t.param == name) & (t.final == 0)].itertuples()
            assert row.status == "ok" and row.norm == pytest.approx(float(g.double().norm()), rel=1e-12)
            assert (row.min, row.max) == (float(g.min()), float(g.max()))


THREADS = """
import sys, threading, torch, gradstore
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(12)])
stop = threading.Event()

def other():  # another thread: backward passes through the same parameters' AccumulateGrad nodes
    x = torch.randn(4, 32)
    while not stop.is_set():
        model(x).sum().backward()

t = threading.Thread(target=other, name="other")
t.start()
try:
    with gradstore.record("t", db=sys.argv[1], model=model, stats=sys.argv[2]) as rec:
        x = torch.randn(4, 32)
        for i in range(int(sys.argv[3])):
            model(x).sum().backward()
            rec.step()
finally:
    stop.set()
    t.join()
print("ok")
"""


@pytest.mark.parametrize("stats", ["full", "shape"])
def test_another_thread_backward_on_the_same_model(tmp_path, stats):
    """Another thread runs backward passes through the same model during a recording: no crash (the C++ hooks
    never change a Node's hook list while the other thread's engine may read it); that thread's passes are
    not recorded, and the steps say so; the recording thread's passes are recorded with the right modules."""
    db = str(tmp_path / "t.db")
    proc = subprocess.run(
        [sys.executable, "-c", THREADS, db, stats, "150"], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", (proc.returncode, proc.stderr[-2000:])
    con = sqlite3.connect(db)
    passes = con.execute("SELECT p.parent_pass, count(*) FROM passes p GROUP BY p.step_id").fetchall()
    assert passes and all(parent is None and n == 1 for parent, n in passes)  # one pass per step, its own
    errors = [e for (e,) in con.execute("SELECT error FROM steps WHERE error IS NOT NULL")]
    assert errors and all("on thread 'other' was not recorded" in e for e in errors)
    # every Linear's AddmmBackward0 belongs to its own module, once per step
    modules = con.execute(
        "SELECT n.module, count(*) FROM calls c JOIN nodes n ON n.id = c.node_id "
        "WHERE n.name = 'AddmmBackward0' GROUP BY n.module"
    ).fetchall()
    steps = con.execute("SELECT count(*) FROM steps").fetchone()[0]
    assert sorted(modules) == sorted((str(i), steps) for i in range(12))


def test_grads_of_reads_what_python_reads_and_declines_what_it_cannot():
    """hooks.cpp's grads_of: each parameter's requires_grad and .grad (the same tensor object Python's `p.grad`
    gives, or None), for torch.Tensor and torch.nn.Parameter leaves; None (the caller reads them in Python) for a
    subclass, a non-leaf (whose .grad warns in Python) or anything that is not a tensor."""
    grads_of = native.grads_of()
    assert grads_of is not None
    plain = (torch.Tensor, torch.nn.Parameter)
    with_grad = torch.nn.Parameter(torch.ones(2))
    with_grad.grad = torch.full((2,), 3.0)
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    no_grad_yet = torch.nn.Parameter(torch.zeros(1))
    leaf = torch.ones(2, requires_grad=True)
    leaf.sum().backward()
    params = [with_grad, frozen, no_grad_yet, leaf]
    flags, grads = grads_of(params, plain)
    assert flags == [p.requires_grad for p in params] == [True, False, True, True]
    assert all(g is p.grad for g, p in zip(grads, params))  # the same objects: None, or the tensor itself
    assert grads_of(tuple(params), plain) == (flags, grads)
    assert grads_of([], plain) == ([], [])

    class Sub(torch.Tensor):
        pass

    assert grads_of([with_grad, leaf.as_subclass(Sub).detach().requires_grad_()], plain) is None
    assert grads_of([with_grad, leaf * 2], plain) is None  # a non-leaf
    assert grads_of([with_grad, "weight"], plain) is None
    assert grads_of([with_grad], (torch.Tensor,)) is None  # a Parameter, where only plain tensors were asked for


def test_parameter_rows_are_the_same_read_in_cpp_or_in_python(tmp_path, monkeypatch):
    """The pass's and the step's final param_grad rows, with grads_of reading `.grad` and with Python's attribute
    reads (grads_of turned off; and under a TorchFunctionMode, which makes gradstore read them in Python): equal,
    and equal to the norms of the gradients plain PyTorch left (a frozen parameter has none)."""
    from torch.overrides import TorchFunctionMode

    class PassThrough(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def run(name, mode=None):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        model[2].bias.requires_grad_(False)
        with gradstore.record(name, db=str(tmp_path / "g.db"), model=model):
            with mode if mode is not None else contextlib.nullcontext():
                model(torch.randn(5, 3)).pow(2).sum().backward()
        return {n: float(p.grad.double().norm()) for n, p in model.named_parameters() if p.grad is not None}

    import contextlib

    want = run("cpp")
    assert run("mode", PassThrough()) == want
    monkeypatch.setattr(native, "grads_of", lambda: None)
    assert run("python") == want
    with gradstore.open(str(tmp_path / "g.db")) as store:
        rows = store.param_grads(which="all")
    for name in ("cpp", "mode", "python"):
        mine = rows[(rows["run"] == name) & (rows["status"] == "ok")]
        assert set(mine["param"]) == set(want) and len(mine) == 2 * len(want)  # the pass's row and the final one
        for _, r in mine.iterrows():
            assert r["norm"] == pytest.approx(want[r["param"]], rel=1e-6)
