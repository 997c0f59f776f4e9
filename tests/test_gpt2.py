"""A real model: HuggingFace GPT-2 (random weights from a small config), three recorded AdamW steps with
dropout on, against twin runs without gradstore from the same seed.

Twin A: no hooks at all (values, for bit-identity and the param_grads statistics).
Twin B: plain `Node.register_prehook` on every node reachable from the loss (which nodes the engine ran).
"""

import math
from collections import Counter

import pytest
import torch

import gradstore

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

SEED = 1234
STEPS = 3
BATCH, SEQ = 2, 24


def make_model():
    torch.manual_seed(SEED)
    cfg = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=2,
        vocab_size=500,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )  # dropout stays at its 0.1 defaults
    model = GPT2LMHeadModel(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt


def batches():
    g = torch.Generator().manual_seed(99)
    return [torch.randint(0, 500, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def train_step(model, opt, ids, before_backward=None):
    """One step; returns what the comparisons need (copies taken outside autograd)."""
    loss = model(input_ids=ids, labels=ids).loss
    if before_backward is not None:
        before_backward(loss)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    opt.zero_grad()
    return {
        "loss": loss.detach().clone(),
        "grads": grads,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "rng": torch.get_rng_state(),
    }


def plain_name(node) -> str:
    return node.name().rsplit("::", 1)[-1]


def reachable(root) -> list:
    seen, out, stack = set(), [], [root]
    while stack:
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        out.append(n)
        stack.extend(nxt for nxt, _ in n.next_functions)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    db = str(tmp_path_factory.mktemp("gpt2") / "grads.db")
    data = batches()

    # twin A: no hooks of any kind
    model, opt = make_model()
    assert model.training and model.config.resid_pdrop > 0 and model.config.attn_pdrop > 0
    plain = [train_step(model, opt, ids) for ids in data]
    names = dict(model.named_parameters())
    modules = dict(model.named_modules())
    del model, opt

    # twin B: which nodes the engine runs, counted with plain prehooks
    model, opt = make_model()
    ran, reach = [], []

    def observe(loss):
        counter = Counter()
        ran.append(counter)
        nodes = reachable(loss.grad_fn)
        reach.append(len(nodes))

        def prehook(name):
            def hook(grad_outputs):
                counter[name] += 1

            return hook

        handles = [n.register_prehook(prehook(plain_name(n))) for n in nodes]
        observe.handles = handles

    for ids in data:
        train_step(model, opt, ids, before_backward=observe)
        for h in observe.handles:
            h.remove()
    del model, opt

    # recorded
    model, opt = make_model()
    step = gradstore.record("gpt2", db=db, model=model)(train_step)
    recorded = [step(model, opt, ids) for ids in data]
    tied = model.lm_head.weight is model.transformer.wte.weight
    with gradstore.open(db) as store:
        frames = {
            "steps": store.steps("gpt2"),
            "passes": store.passes("gpt2"),
            "calls": store.calls("gpt2"),
            "nodes": store.nodes("gpt2"),
            "param_grads": store.param_grads("gpt2"),
        }
    return {
        "plain": plain,
        "ran": ran,
        "reach": reach,
        "recorded": recorded,
        "names": names,
        "modules": modules,
        "tied": tied,
        **frames,
    }


def test_steps_and_passes(runs):
    st, p = runs["steps"], runs["passes"]
    assert list(st.step) == list(range(STEPS))
    assert list(st.status) == ["ok"] * STEPS
    assert st.error.isna().all()  # no recorder fault
    assert list(st.passes) == [1] * STEPS
    assert list(p.kind) == ["backward"] * STEPS
    assert p.parent_pass.isna().all()


def test_every_node_that_ran_is_one_call(runs):
    calls = runs["calls"]
    assert len(runs["ran"]) == STEPS
    for step in range(STEPS):
        c = calls[calls.step == step]
        assert Counter(c.name) == runs["ran"][step], step
        assert not c.key.duplicated().any()  # exactly one call per node per pass
        assert list(c.seq) == list(range(len(c)))
    assert list(runs["passes"].calls) == [sum(r.values()) for r in runs["ran"]]
    assert list(runs["passes"].nodes) == runs["reach"]


def test_keys_identical_across_steps(runs):
    calls = runs["calls"]
    per_step = [sorted(calls[calls.step == s].key) for s in range(STEPS)]
    assert per_step[0] == per_step[1] == per_step[2]
    nodes = runs["nodes"]
    assert set(nodes.first_step) == {0}  # no new node key after step 0
    assert set(nodes.key) == set(per_step[0])


def test_every_node_has_its_owning_module(runs):
    nodes = runs["nodes"]
    module_names = set(runs["modules"])  # includes '' (the model itself; also code outside any module)
    fn = nodes[nodes.kind != "accumulate_grad"]
    assert len(fn) > 100
    assert set(fn.module) <= module_names, set(fn.module) - module_names
    assert not fn.module.str.startswith("<").any()
    # the ops whose owner is known without gradstore: Conv1D runs one addmm, Embedding one embedding
    conv1d = {n for n, m in runs["modules"].items() if isinstance(m, Conv1D)}
    assert len(conv1d) == 8
    assert set(fn[fn.name == "AddmmBackward0"].module) == conv1d
    assert len(fn[fn.name == "AddmmBackward0"]) == 8
    assert set(fn[fn.name == "EmbeddingBackward0"].module) == {"transformer.wte", "transformer.wpe"}
    assert set(fn[fn.name == "NativeLayerNormBackward0"].module) == {
        n for n, m in runs["modules"].items() if isinstance(m, torch.nn.LayerNorm)
    }
    # keys carry the module
    for _, r in fn.iterrows():
        assert r.key == (f"{r.module}/" if r.module else "") + f"{r['name']}#" + r.key.rsplit("#", 1)[1]


def test_every_parameter_is_named_once(runs):
    nodes = runs["nodes"]
    acc = nodes[nodes.kind == "accumulate_grad"]
    assert runs["tied"]
    names = set(runs["names"])  # named_parameters(): the tied weight once, as transformer.wte.weight
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    assert list(acc.key) == [f"param:{p}" for p in acc.param]
    assert set(acc.param) == names and len(acc) == len(names)
    calls = runs["calls"]
    for step in range(STEPS):
        c = calls[calls.step == step]
        assert Counter(c[c.name == "AccumulateGrad"].param) == Counter(names)  # tied weight: one call
    pg = runs["param_grads"]
    assert len(pg) == STEPS * len(names)
    assert (pg.status == "ok").all()


def _reference(g: torch.Tensor) -> dict:
    x = g.detach().to(torch.float64).reshape(-1)
    fin = x[torch.isfinite(x)]
    return {
        "norm": float(torch.linalg.vector_norm(fin)),
        "min": float(fin.min()),
        "max": float(fin.max()),
        "mean": float(fin.mean()),
        "std": float(fin.std()),
        "nan": int(torch.isnan(x).sum()),
        "posinf": int((x == math.inf).sum()),
        "neginf": int((x == -math.inf).sum()),
        "zeros": int((x == 0).sum()),
    }


def test_param_grads_match_twin(runs):
    pg = runs["param_grads"]
    for step in range(STEPS):
        rows = pg[pg.step == step].set_index("param")
        for name, g in runs["plain"][step]["grads"].items():
            r = rows.loc[name]
            assert r["shape"] == ",".join(str(s) for s in g.shape) and r["numel"] == g.numel()
            assert r["dtype"] == "float32"
            want = _reference(g)
            for k in ("nan", "posinf", "neginf", "zeros"):
                assert r[k] == want[k], (step, name, k)
            for k in ("norm", "min", "max", "mean", "std"):
                if want[k] == 0:
                    assert abs(r[k]) <= 1e-12, (step, name, k, r[k])
                else:
                    assert math.isclose(r[k], want[k], rel_tol=1e-6), (step, name, k, r[k], want[k])


def test_recording_changes_nothing(runs):
    plain, recorded = runs["plain"], runs["recorded"]
    assert not torch.equal(plain[0]["loss"], plain[1]["loss"])  # the steps really differ
    assert not torch.equal(plain[0]["rng"], plain[1]["rng"])  # dropout draws from the CPU generator
    for step, (a, b) in enumerate(zip(plain, recorded)):
        assert torch.equal(a["loss"], b["loss"]), step
        assert torch.equal(a["rng"], b["rng"]), step
        assert a["grads"].keys() == b["grads"].keys()
        for n in a["grads"]:
            assert torch.equal(a["grads"][n], b["grads"][n]), (step, n)
            assert torch.equal(a["params"][n], b["params"][n]), (step, n)
