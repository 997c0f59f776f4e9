"""Generate docs/autograd_hooks.md, "How autograd hooks see the backward pass", from real recordings.

    python -m gradstore.inspect.docs_page            write docs/autograd_hooks.md
    python -m gradstore.inspect.docs_page --check    exit 1 when the committed page differs from a fresh one
    python -m gradstore.inspect.docs_page --out F    write to F instead

Every example is a code string that is both shown on the page and run: its graph is explained
(gradstore.explain), its backward pass runs with plain PyTorch node hooks that log what they receive and
inside `gradstore.record` into a temporary database, whose rows fill the tables; re-running nodes and the
error after a pass are real calls and real messages. Nothing on the page depends on time, paths, memory
addresses or sequence numbers, so the page is byte-identical on every run with the same PyTorch minor
version (tests/test_docs_page.py regenerates it and compares).
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import tempfile
import textwrap
from pathlib import Path

import torch

from ..recording.graph import node_name, walk
from ..recording.recorder import record
from ..recording.saved import saved_bytes, saved_tensors, saved_values
from ..store.reader import open as open_store
from .explain import explain
from .replay import replay

PAGE = Path(__file__).resolve().parents[2] / "docs" / "autograd_hooks.md"

ADD = """\
a = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
b = torch.tensor([10.0, 20.0, 30.0], requires_grad=True)
c = a + b                  # AddBackward0
loss = c.pow(2).sum()      # PowBackward0, then SumBackward0
"""

MEAN = """\
x = torch.arange(6.0).reshape(2, 3).requires_grad_()
loss = x.mean()            # MeanBackward0
"""

SAVED = """\
m = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
w = torch.tensor([[0.5, -1.0], [2.0, 0.0]], requires_grad=True)
node = (m @ w).grad_fn     # MmBackward0
"""

CUSTOM = """\
class Cube(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return scale * x ** 3

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        return grad_out * ctx.scale * 3 * x ** 2, None   # one value per forward argument

x = torch.tensor([1.0, 2.0], requires_grad=True)
loss = Cube.apply(x, 0.5).sum()   # CubeBackward, then SumBackward0
"""


# ---- formatting ------------------------------------------------------------------------------------------------
def num(v) -> str:
    """A number as the page shows it: 6 significant digits; '-' for None/NULL."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def tensor_text(t) -> str:
    """A small tensor as 'tensor([1, 2])' with 6 significant digits (None as 'None')."""
    if t is None:
        return "None"
    values = t.detach().reshape(-1).tolist()
    body = ", ".join(num(float(v)) for v in values)
    shape = "" if t.dim() == 1 else f", shape {tuple(t.shape)}"
    return f"tensor([{body}]{shape})" if t.dim() else f"tensor({num(float(t))})"


def _tuple_text(ts) -> str:
    inner = ", ".join(tensor_text(t) for t in ts)
    return f"({inner},)" if len(ts) == 1 else f"({inner})"


def _explanation_text(expl) -> str:
    """An Explanation's text without the line that carries the sequence number (it depends on what ran
    before in the process)."""
    head = f"{expl.name} ({expl.kind})  key {expl.key}"
    return "\n".join([head] + expl.lines()[1:])


def _table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


# ---- running an example -------------------------------------------------------------------------------------------
class Example:
    """Runs one example: explains chosen nodes before the pass, logs plain hooks during it, records it."""

    def __init__(self, name: str, code: str, db: str, retain: bool = False):
        self.name, self.code = name, code
        self.ns: dict = {"torch": torch}
        exec(compile(code, f"<docs example {name}>", "exec"), self.ns)  # noqa: S102 - our own example code
        loss = self.ns["loss"]
        self.walk = walk([loss.grad_fn])
        self.nodes = {node_name(n): n for n in self.walk.nodes if node_name(n) != "AccumulateGrad"}
        self.explained = {n: explain(node, root=loss) for n, node in self.nodes.items()}
        self.log: list[str] = []
        handles = []
        leaves = 0
        for node in self.walk.nodes:
            label = node_name(node)
            if label == "AccumulateGrad":
                label = f"AccumulateGrad of {self._leaf_name(node.variable)}"
                leaves += 1
            handles.append(
                node.register_prehook(
                    lambda gos, label=label: self.log.append(f"prehook  {label}: grad_outputs = {_tuple_text(gos)}")
                )
            )
            handles.append(
                node.register_hook(
                    lambda gis, gos, label=label: self.log.append(
                        f"hook     {label}: grad_inputs = {_tuple_text(gis) if gis else '()'}"
                    )
                )
            )
        try:
            with record(name, db=db):
                loss.backward(retain_graph=retain)
        finally:
            for h in handles:
                h.remove()
        with open_store(db) as store:
            self.tensors = store.tensors(run=name)
            self.edges = store.edges(run=name)

    def close(self) -> None:
        """Drop the example's graph. Its namespace must be cleared: a class defined by the example (Cube) keeps
        the namespace alive through its methods' globals, and PyTorch keeps Function classes alive."""
        self.ns.clear()
        self.nodes.clear()
        self.walk = None

    def _leaf_name(self, var) -> str:
        for k, v in self.ns.items():
            if v is var:
                return k
        return "a leaf"

    def recorded_table(self) -> str:
        rows = []
        for r in self.tensors.sort_values(["seq", "role", "slot"], ascending=[True, False, True]).to_dict("records"):
            if r["status"] != "ok":
                rows.append([r["seq"], f"`{r['key']}`", r["role"], r["slot"], "None", "-", "-", "-", "-"])
                continue
            shape = f"`{r['shape']}`" if r["shape"] else "`''` (0-d)"
            rows.append(
                [
                    r["seq"],
                    f"`{r['key']}`",
                    r["role"],
                    r["slot"],
                    shape,
                    num(r["norm"]),
                    num(r["min"]),
                    num(r["max"]),
                    num(r["mean"]),
                ]
            )
        return _table(["seq", "node", "role", "slot", "shape", "norm", "min", "max", "mean"], rows)


def _error_text(fn) -> str:
    try:
        fn()
    except Exception as exc:  # the real message, shown on the page
        return f"{type(exc).__name__}: {exc}"
    return "(no error)"


# ---- the page -------------------------------------------------------------------------------------------------
def render() -> str:
    """The page's markdown, from fresh recordings (a few hundred ms)."""
    torch_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    with tempfile.TemporaryDirectory() as tmp:
        db = str(Path(tmp) / "docs.db")
        add = Example("add", ADD, db)
        mean = Example("mean", MEAN, db)
        custom = Example("custom", CUSTOM, db, retain=True)
        add_node, pow_node = add.nodes["AddBackward0"], add.nodes["PowBackward0"]
        cube = custom.nodes["CubeBackward"]
        add_again = add_node(torch.tensor([22.0, 44.0, 66.0]))
        pow_error = _error_text(functools.partial(pow_node, torch.ones(3)))
        cube_before = custom.ns["x"].grad.tolist()
        cube_raw = cube.apply(torch.ones(2))
        cube_replay = replay(cube, torch.ones(2))
        cube_after = custom.ns["x"].grad.tolist()
        cube_saved = [(n, tuple(t.shape)) for n, t in saved_tensors(custom.nodes["CubeBackward"])]
        pow_values = saved_values(pow_node)
        mean_values = saved_values(mean.nodes["MeanBackward0"])
        add_values = saved_values(add_node)
        cube_values = saved_values(cube)
        # a graph whose saved tensors are alive, for the saved-state section
        ns = {"torch": torch}
        exec(compile(SAVED, "<docs example saved>", "exec"), ns)  # noqa: S102 - our own example code
        mm = ns["node"]
        mm_saved = [(n, tuple(t.shape)) for n, t in saved_tensors(mm)]
        mm_values = saved_values(mm)
        mm_bytes = saved_bytes(mm)
        ns.clear()
        del mm, add_node, pow_node, cube
        for example in (add, mean, custom):
            example.close()

    def vals(pairs) -> str:
        return ", ".join(f"`{n} = {v!r}`" for n, v in pairs) or "(none)"

    p: list[str] = []
    w_ = p.append
    w_("# How autograd hooks see the backward pass")
    w_("")
    w_(
        f"<!-- Generated by `python -m gradstore.inspect.docs_page` from real recordings (torch {torch_minor}); "
        "do not edit by hand. tests/test_docs_page.py regenerates this page and fails when it differs. -->"
    )
    w_("")
    w_("The question that started gradstore, from a researcher with hooks on every `grad_fn`:")
    w_("")
    w_(
        "> Each hook call gets two arguments; is the first the saved inputs and the second the gradients? Can I just "
        "re-run the backward with `grad_fn(*args)`, or is there more state? I found no docs."
    )
    w_("")
    w_("Short answers, each shown on a recorded example below:")
    w_("")
    w_(
        "1. **Neither hook argument is a saved input.** A node's *prehook* gets `grad_outputs`: the gradients "
        "w.r.t. the outputs of the forward op, flowing into the node (one per forward output). Its *hook* gets "
        "`(grad_inputs, grad_outputs)`: `grad_inputs` are the gradients w.r.t. the forward op's inputs, flowing "
        "out (one per `next_functions` entry, `None` where an input needs no gradient), then the same "
        "`grad_outputs` again."
    )
    w_(
        "2. **Yes, `grad_fn(*grad_outputs)` re-runs the backward and returns `grad_inputs`**, with no side effect "
        "(no hook runs, no `.grad` changes), as long as the node's saved tensors are alive: before the pass, "
        "inside the node's own hooks, or after a pass with `retain_graph=True`. After a pass without it, a node "
        "that saved tensors raises; a node that saved none (`AddBackward0`) still runs. Two exceptions: "
        "`AccumulateGrad` (calling it adds into `.grad`) and custom Functions, whose node is not callable: use "
        "`node.apply(*grad_outputs)`, which returns one value per *forward argument*. What it returns is the "
        "backward formula's result: the engine then sums each one to the shape of the input it flows to (a "
        "broadcast bias's `(4, 1)` becomes `(1,)`) before any hook sees it; `gradstore.replay(node, grad_outputs)` "
        "does that too."
    )
    w_(
        "3. **The state is in the node's `_saved_*` attributes** (tensors and plain values such as dims and "
        "sizes) and, for a custom Function, in `ctx.saved_tensors` and the attributes set on `ctx`. No hook "
        "receives them; `gradstore.explain(node)` lists them, `gradstore.saved_tensors(node)` reads them without "
        "side effects."
    )
    w_("")
    w_("| hook | called | arguments | meaning |")
    w_("|---|---|---|---|")
    w_(
        "| `node.register_prehook(fn)` | before the node runs | `fn(grad_outputs)` | gradients w.r.t. the forward "
        "op's **outputs**, flowing in; one per output (`None` for an output that got no gradient) |"
    )
    w_(
        "| `node.register_hook(fn)` | after the node runs | `fn(grad_inputs, grad_outputs)` | `grad_inputs`: "
        "gradients w.r.t. the forward op's **inputs**, flowing out; one per `next_functions` entry; then "
        "`grad_outputs` again |"
    )
    w_("")
    w_(
        "`node.next_functions[i] == (next_node, input_nr)`: `grad_inputs[i]` becomes `grad_outputs[input_nr]` of "
        "`next_node`; `(None, 0)` means input `i` needs no gradient. A hook that returns a value replaces the "
        "gradients; gradstore's hooks return `None`."
    )
    w_("")

    # -- AddBackward0 ------------------------------------------------------------------------------------------
    w_("## AddBackward0: one grad_output in, two grad_inputs out")
    w_("")
    w_("```python\n" + ADD + "```")
    w_("")
    w_("`gradstore.explain(c.grad_fn)` before the pass:")
    w_("")
    w_("```text\n" + _explanation_text(add.explained["AddBackward0"]) + "\n```")
    w_("")
    w_(
        "What plain node hooks (`register_prehook` / `register_hook` on every node) received during "
        "`loss.backward()`, in execution order:"
    )
    w_("")
    w_("```text\n" + "\n".join(add.log) + "\n```")
    w_("")
    w_(
        "The same pass recorded by gradstore (`gradstore.open(db).tensors(run)`; `seq` is execution order, "
        "`grad_output` rows are what the prehook saw, `grad_input` rows what the hook saw; the graph was built "
        "before the recording began, so which module made each node is not known to the record: `?/` in its key):"
    )
    w_("")
    w_(add.recorded_table())
    w_("")
    w_(
        f"`AddBackward0` saved no tensor, only {vals(add_values)}. `PowBackward0` saved its input "
        f"(`_saved_self`) and {vals(pow_values)}."
    )
    w_("")

    # -- MeanBackward0 ----------------------------------------------------------------------------------------
    w_("## MeanBackward0: what a node keeps instead of tensors")
    w_("")
    w_("```python\n" + MEAN + "```")
    w_("")
    w_("```text\n" + _explanation_text(mean.explained["MeanBackward0"]) + "\n```")
    w_("")
    w_("```text\n" + "\n".join(mean.log) + "\n```")
    w_("")
    w_(mean.recorded_table())
    w_("")
    w_(
        f"Its backward needs only the input's size and element count ({vals(mean_values)}): every element of "
        f"`grad_inputs[0]` is `grad_output / 6`."
    )
    w_("")

    # -- AccumulateGrad ----------------------------------------------------------------------------------------
    w_("## AccumulateGrad: the end of every path")
    w_("")
    w_(
        "Each leaf tensor with `requires_grad=True` (every parameter) has one `AccumulateGrad` node "
        "(`torch.autograd.graph.get_gradient_edge(x).node`, or reached through `next_functions`). Its prehook "
        "gets the leaf's gradient as `grad_outputs[0]`; it adds that into `x.grad`; its hook gets "
        "`grad_inputs == ()` because a leaf has no inputs (see the `hook     AccumulateGrad of ...` lines above). "
        "It is the one node whose re-run has a side effect: calling it accumulates into `.grad` again, so "
        "`gradstore.replay` refuses it. It saves nothing; `node.variable` is the leaf."
    )
    w_("")

    # -- custom Function -----------------------------------------------------------------------------------------
    w_("## A custom autograd.Function")
    w_("")
    w_("```python\n" + CUSTOM + "```")
    w_("")
    w_("```text\n" + _explanation_text(custom.explained["CubeBackward"]) + "\n```")
    w_("")
    w_("```text\n" + "\n".join(custom.log) + "\n```")
    w_("")
    w_(custom.recorded_table())
    w_("")
    w_(
        f"The forward took two arguments, so `backward` returns two values (the second `None`, for the "
        f"non-tensor `scale`); the engine drops the entries of non-tensor arguments, so the hook's `grad_inputs` has "
        f"one entry per `next_functions` slot. The saved state is `ctx.saved_tensors` "
        f"({', '.join(f'`{n}` {s}' for n, s in cube_saved)}) and the ctx attributes ({vals(cube_values)})."
    )
    w_("")

    # -- re-running --------------------------------------------------------------------------------------------
    w_("## Re-running a node's backward")
    w_("")
    w_(
        "Calling a node runs its backward on the `grad_outputs` you give and returns its `grad_inputs`. No hook "
        "runs and no `.grad` changes. From the examples above, after their passes:"
    )
    w_("")
    w_("```python")
    w_("c.grad_fn(torch.tensor([22.0, 44.0, 66.0]))   # AddBackward0 saved no tensor: works after the pass")
    w_(f"# -> {_tuple_text(add_again)}")
    w_("loss.grad_fn.next_functions[0][0](torch.ones(3))   # PowBackward0 after loss.backward()")
    w_("# -> " + "\n#    ".join(textwrap.wrap(pow_error, 100)))
    w_("```")
    w_("")
    w_(
        "The custom Function's pass ran with `retain_graph=True`, so its node can still be re-run. Its node is "
        "not callable; `node.apply(*grad_outputs)` calls your `backward` and returns what it returns (one value "
        "per forward argument); `gradstore.replay(node, grad_outputs)` returns `grad_inputs` as the hook sees them:"
    )
    w_("")
    w_("```python")
    w_("node = loss.grad_fn.next_functions[0][0]       # CubeBackward")
    w_(f"node.apply(torch.ones(2))                      # -> {_tuple_text(cube_raw)}")
    w_(f"gradstore.replay(node, torch.ones(2))          # -> {_tuple_text(cube_replay)}")
    same = "unchanged by the re-runs" if cube_after == cube_before else f"was {cube_before} before the re-runs"
    w_(f"x.grad                                         # -> {cube_after}: {same}")
    w_("```")
    w_("")
    w_(
        "`gradstore.replay_check(loss)` does this for every node of a live graph (capturing each node's "
        "grad_outputs with plain hooks during one pass, then replaying and comparing bitwise), and says which "
        "nodes cannot be replayed and why. `gradstore.verify(...)` compares each custom Function's backward "
        "with finite differences of its forward in float64."
    )
    w_("")

    # -- saved state -----------------------------------------------------------------------------------------------
    w_("## What state a node holds")
    w_("")
    w_(
        "Saved tensors are attributes named `_saved_<name>` (`[k for k in dir(node) if k.startswith('_saved_')]`); "
        "reading one unpacks it (runs any `saved_tensors_hooks` unpack hook and checks that the tensor was not "
        "modified in place) and raises `RuntimeError` once a pass freed it. For a matrix product:"
    )
    w_("")
    w_("```python\n" + SAVED)
    w_("[(name, tuple(t.shape)) for name, t in gradstore.saved_tensors(node)]")
    w_(f"# -> {mm_saved}")
    w_(f"gradstore.saved_bytes(node)   # -> {mm_bytes}")
    w_("gradstore.explain(node).values   # the non-tensor state")
    w_(f"# -> {mm_values}")
    w_("```")
    w_("")
    w_(
        "`gradstore.saved_tensors(node)` reads the stored tensors without unpacking (no hook runs, nothing "
        "raises; after a pass it returns an empty list with `.freed == True`), cheap enough for a prehook; "
        "`gradstore.saved_bytes(node)` adds up their size. The node also keeps its `next_functions`, its "
        "forward outputs' metadata (shape, dtype, device: the private `node._input_metadata`) and, for a custom "
        "Function, `ctx.needs_input_grad` and whatever was set on `ctx`."
    )
    w_("")
    return "\n".join(p).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gradstore.inspect.docs_page", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(PAGE), help="where to write the page (default: docs/autograd_hooks.md)")
    parser.add_argument("--check", action="store_true", help="exit 1 when the page at --out differs from a fresh one")
    args = parser.parse_args(argv)
    text = render()
    out = Path(args.out)
    if args.check:
        same = out.exists() and out.read_text() == text
        print(f"{out}: {'up to date' if same else 'STALE: run python -m gradstore.inspect.docs_page'}")
        return 0 if same else 1
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
