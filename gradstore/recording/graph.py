"""The graph walk: from a backward pass's roots along `next_functions` to every reachable Node, and keys.

Facts this relies on (torch.autograd.graph.Node):
- `node.next_functions[i] == (next_node, input_nr)`: slot i of this node's grad_inputs flows into slot
  `input_nr` of next_node's grad_outputs; next_node is None where that input needs no gradient.
- `node.name()` is 'torch::autograd::AccumulateGrad' for a leaf's accumulator, '<Class>Backward' for a custom
  `torch.autograd.Function`, 'CompiledFunctionBackward' for a `torch.compile` region.
- The Python object of a Node is the same object for as long as someone holds it, so `id()` identifies it
  while the walk holds every node; a lazy C++ walk holds the C++ Nodes themselves and keys each by its address,
  which is its own while held (`Walk.ident`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, replace
from itertools import repeat

import torch
from torch.autograd.function import BackwardCFunction

from ..records import NodeInfo
from . import torch_private as tp
from .rows import LazyRows, PackedRows

ACCUMULATE_GRAD = "AccumulateGrad"
# the module of a node made before the recording began or in a step it did not record (run by a later pass): the
# module boundaries of its forward were not noted, so which module made it is not known
UNKNOWN_MODULE = "?"


def node_name(node) -> str:
    """`node.name()` with the C++ namespace dropped ('torch::autograd::AccumulateGrad' -> 'AccumulateGrad')."""
    return node.name().rsplit("::", 1)[-1]


def node_kind(node, name: str) -> str:
    """One of schema.KINDS: accumulate_grad, compiled, custom_function, function (built-in) or other."""
    if name == ACCUMULATE_GRAD:
        return "accumulate_grad"
    if name == "CompiledFunctionBackward":
        return "compiled"
    if isinstance(node, BackwardCFunction):
        return "custom_function"
    if isinstance(node, torch.autograd.graph.Node):
        return "function"
    return "other"


def roots_of(outputs) -> list:
    """The graph roots of a pass: for each output tensor its `grad_fn` (or a leaf's AccumulateGrad, via
    `torch.autograd.graph.get_gradient_edge`); for a `GradientEdge` its node. Tensors that need no gradient
    are left out."""
    roots = []
    for out in outputs:
        node = None
        if isinstance(out, torch.Tensor):
            if out.grad_fn is not None:
                node = out.grad_fn
            elif out.requires_grad:
                node = torch.autograd.graph.get_gradient_edge(out).node
        else:
            node = getattr(out, "node", None)
        if node is not None:
            roots.append(node)
    return roots


class LazyNodes:
    """A lazy C++ walk's Nodes (`walk(..., lazy=True)`), in walk order: held in C++, each one's Python object made
    where it is asked for (`nodes[i]`, iteration). Holding this keeps every Node of the walk alive."""

    __slots__ = ("held", "_native", "_n")

    def __init__(self, held, n: int, native):
        self.held, self._n, self._native = held, n, native

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int):
        if i < 0:
            i += self._n
        return self._native.walk_node(self.held, i)

    def __iter__(self):
        node = self._native.walk_node
        held = self.held
        return (node(held, i) for i in range(self._n))


@dataclass
class Walk:
    """The reachable graph of one pass. nodes: Node objects in walk order (depth-first from the roots, in
    `next_functions` order; a lazy C++ walk's `LazyNodes`); edges: (src index, src slot, dst index, dst slot) (a
    list, or from the C++ walk a `LazyRows` that makes them on first read); index: a node's key (`ident`: id(node),
    or a lazy walk's C++ Node address) -> its position, its keys in walk order (as `nodes`)."""

    nodes: list = field(default_factory=list)
    edges: list[tuple[int, int, int, int]] = field(default_factory=list)
    index: dict[int, int] = field(default_factory=dict)
    scope: dict | None = None  # set by describe: (module, name) -> highest ordinal given in this key scope
    seqs: list[int] | None = None  # set by describe: each node's sequence_nr
    born: dict[int, tuple] | None = None  # set by describe: index -> (step, pass, call) of nodes of earlier steps
    raw_seqs: list[int] | None = None  # the C++ walk's: each node's sequence_nr, read during the walk
    sig: tuple | None = None  # the C++ walk's: (base, signature bytes, id of each AccumulateGrad's variable)
    edge_bytes: bytes | None = None  # the C++ walk's: the edges as four native int32 each (`edges` unpacks them)
    address_of: object = None  # a lazy walk's: Node object -> its key in `index` (the C++ Node's address)

    def ident(self, node) -> int:
        """The key of a Node object in `index` (and in `Keyed`): its id(), or for a lazy C++ walk (`nodes` a
        `LazyNodes`) the address of its C++ Node. A node that is not an autograd Node: id()."""
        if self.address_of is None:
            return id(node)
        try:
            return self.address_of(node)
        except TypeError:
            return id(node)

    def idents(self) -> list[int]:
        """Every node's key in `index`, in walk order."""
        return list(self.index)


def walk(roots: list, base: int = 0, native=None, lazy: bool = False) -> Walk:
    """Visit every Node reachable from `roots` once; O(nodes + edges).

    Args:
        roots: Node objects (`roots_of`).
        base: the sequence number the C++ walk's signature counts from (`ModuleTracker.signature()[0]`).
        native: the C++ hooks' module (gradstore.recording.native) or None: with it the walk runs in one C++
            call, which also reads every node's sequence_nr and what `describe` keys a fresh pass by (the same
            nodes, edges and order as the walk here); a root it cannot read falls back to the walk here (with
            `lazy`, its nodes then keyed by address too).
        lazy: with `native`, the Nodes stay in C++ (`Walk.nodes` a `LazyNodes`, `Walk.index` keyed by their
            C++ addresses, `Walk.ident`): no Python object is made for a Node nobody asks for.
    """
    if native is not None:
        try:
            nodes, edges, seqs, signature, leaves, index = native.walk(
                roots if type(roots) is list else list(roots), base, lazy
            )
        except (TypeError, RuntimeError):
            pass
        else:  # the edges' tuples are made where they are first read (the writer thread: rows.LazyRows)
            edge_rows = LazyRows(len(edges) // 16, lambda: list(struct.iter_unpack("=4i", edges)))
            edge_rows.pack = lambda: PackedRows("walk_edges", len(edges) // 16, (edges,))
            if lazy:
                nodes = LazyNodes(nodes, len(seqs), native)
            return Walk(
                nodes,
                edge_rows,
                index,
                raw_seqs=seqs,
                sig=(base, signature, leaves),
                edge_bytes=edges,
                address_of=native.node_address if lazy else None,
            )
    w = Walk()
    index = w.index
    nodes = w.nodes
    nexts_of = []  # each visited node's next_functions, read once
    stack = list(reversed(roots))
    while stack:
        node = stack.pop()
        if id(node) in index:
            continue
        index[id(node)] = len(nodes)
        nodes.append(node)
        nexts = node.next_functions
        nexts_of.append(nexts)
        for nxt, _ in reversed(nexts):
            if nxt is not None and id(nxt) not in index:
                stack.append(nxt)
    w.edges = [
        (src, slot, index[id(nxt)], input_nr)
        for src, nexts in enumerate(nexts_of)
        for slot, (nxt, input_nr) in enumerate(nexts)
        if nxt is not None
    ]
    if lazy and native is not None:  # the C++ walk declined a root: keyed as a lazy walk's nodes are (by address),
        # so that a node another pass of the step walked in C++ is known by the same key
        w.address_of = native.node_address
        w.index = {w.ident(node): i for i, node in enumerate(nodes)}
    return w


class Keyed:
    """The Nodes keyed earlier in one step: a node's key in its walk (`Walk.ident`: its id(), or the address of its
    C++ Node) -> (its NodeInfo, the key scope it was keyed in).

    Held in flat lists (one position per node) rather than a tuple per node: a tuple per node stays tracked by the
    garbage collector for as long as the step holds it, and 633 of them a pass (benchmarks/steady.py's MLP)
    counted towards its collections and were promoted with the step. Each walk's Nodes (`Walk.nodes`: a list of
    Node objects, or a lazy walk's `LazyNodes`) are held, so the keys stay theirs until `clear()`."""

    __slots__ = ("_at", "_held", "_infos", "_scopes", "_segment", "_starts", "_ended")

    def __init__(self):
        self._at: dict[int, int] = {}
        self._held: list = []  # what keeps the keyed Nodes alive: one entry per walk
        self._infos: list[NodeInfo] = []
        self._scopes: list[dict] = []
        # the key scopes given to fresh graphs since the last one that started over (`fresh_base`)
        self._segment: list[dict] = []
        # per fresh graph that started over: [its nodes, seqs, edges (bytes or rows), its _structure or None]
        self._starts: list[list] = []
        self._ended = -1  # the sequence counter when the step's last pass ended (-1: none, or not to be trusted)

    def __contains__(self, ident: int) -> bool:
        return ident in self._at

    def __len__(self) -> int:
        return len(self._at)

    def get(self, ident: int) -> tuple | None:
        """(NodeInfo, scope) of the node keyed `ident`, or None."""
        i = self._at.get(ident)
        return None if i is None else (self._infos[i], self._scopes[i])

    def isdisjoint(self, idents) -> bool:
        """True when no key of `idents` is keyed here."""
        return self._at.keys().isdisjoint(idents)

    def hold(self, nodes) -> None:
        """Keep a walk's Nodes (`Walk.nodes`) alive until `clear()`: their keys stay theirs meanwhile."""
        if not any(h is nodes for h in self._held):
            self._held.append(nodes)

    def add(self, ident: int, info: NodeInfo, scope: dict) -> None:
        """Key one node of a walk held here (a node keyed already keeps its entry)."""
        if ident not in self._at:
            self._at[ident] = len(self._infos)
            self._infos.append(info)
            self._scopes.append(scope)

    def add_all(self, idents, nodes, infos, scope: dict) -> None:
        """Key the nodes of a pass none of which is keyed yet (`isdisjoint`), all in `scope`; holds `nodes`."""
        self.hold(nodes)
        start = len(self._infos)
        self._at.update(zip(idents, range(start, start + len(nodes))))
        self._infos.extend(infos)
        self._scopes.extend(repeat(scope, len(nodes)))

    def set_info(self, ident: int, info: NodeInfo) -> None:
        """Replace the NodeInfo of a keyed node."""
        self._infos[self._at[ident]] = info

    def pass_ended(self, next_seq: int, trusted: bool = True) -> None:
        """A pass of the step ended, the sequence counter standing at `next_seq` (`tp.next_sequence_nr()`);
        `trusted` False when nodes it created may carry numbers of another thread's counter (a pass with
        create_graph on an accelerator, whose device threads count for themselves): from then on in this step
        creation order does not tell a new forward (`fresh_base`)."""
        if self._ended is None:
            return
        self._ended = max(self._ended, next_seq) if trusted and next_seq >= 0 else None

    def fresh_base(self, w: Walk, seqs: list[int], low: int | None = None, exact=None) -> dict | None:
        """The key scope a fresh graph of the step (no node but AccumulateGrad keyed earlier in it, no enclosing
        pass) continues, or None where it starts over with a scope of its own: as the step's first graph; as a
        new forward, every node it keys having been created after the step's earlier passes ended (a micro-batch:
        `low`, the least sequence number among them; `exact()` gives it without the nodes keyed from earlier
        steps, asked only where `low` is below); or as a graph with the same structure as one that started over
        (micro-batches whose forwards all ran before their backward passes: the same names, creation order, edges
        and leaves). Otherwise (double backward: a graph made by an earlier pass; a second loss of the same forward) it
        continues the scope of the graphs since the last one that started over: ordinals after theirs, so that no
        two of its nodes and theirs share a key, and the same code gives the same keys step after step."""
        if not self._segment:
            return None
        ended = self._ended
        if ended is not None and ended >= 0:
            if low is None:
                low = min(seqs, default=-1)
            if low < ended and exact is not None:
                low = exact()
            if low >= ended:
                return None
        if self._same_structure(w, seqs):
            return None
        merged: dict = {}
        for scope in self._segment:
            for base, ordinal in scope.items():
                if ordinal > merged.get(base, -1):
                    merged[base] = ordinal
        return merged

    def _same_structure(self, w: Walk, seqs: list[int]) -> bool:
        n, edges = len(w.nodes), _edges_of(w)
        mine = None
        for start in self._starts:
            nodes, other_seqs, other_edges, known = start
            if len(nodes) != n or _edge_count(other_edges) != _edge_count(edges):
                continue
            if mine is None:
                mine = _structure(w.nodes, seqs, edges)
            if known is None:
                known = start[3] = _structure(nodes, other_seqs, other_edges)
            if known == mine:
                return True
        return False

    def note_fresh(self, scope: dict, w: Walk, seqs: list[int], started: bool) -> None:
        """A fresh graph was keyed in `scope`: `started` True where it started over (`fresh_base` None)."""
        if started:
            self._segment = [scope]
            self._starts.append([w.nodes, seqs, _edges_of(w), None])
        else:
            self._segment.append(scope)

    def clear(self) -> None:
        """Forget every node (the end of a step): the Nodes are let go."""
        self._at.clear()
        self._held.clear()
        self._infos.clear()
        self._scopes.clear()
        self._segment = []
        self._starts.clear()
        self._ended = -1


def _edges_of(w: Walk):
    """A walk's edges as held: the C++ walk's bytes (four native int32 each), else the list of tuples."""
    return w.edge_bytes if w.edge_bytes is not None else w.edges


def _edge_count(edges) -> int:
    return len(edges) // 16 if isinstance(edges, bytes) else len(edges)


def _structure(nodes, seqs: list[int], edges) -> tuple:
    """What keys a walked graph by, less where it is: per node in walk order its name and its sequence number
    (`seqs`) counted from the graph's least (AccumulateGrad's and unknown numbers as they are), its edges
    (`_edges_of`; tuples packed as the C++ walk's bytes), and the leaves its AccumulateGrad nodes accumulate into
    (id() of each `variable`, alive while its node is held: two graphs of one structure over other leaves are not
    repetitions). Reads every node's name: only for the rare graph that asks."""
    if not isinstance(edges, bytes):
        edges = b"".join(struct.pack("=4i", *e) for e in edges)
    accumulate = tp.ACCUMULATE_GRAD_SEQUENCE_NR
    low = min((s for s in seqs if 0 <= s < accumulate), default=0)
    names = tuple(n.name() for n in nodes)
    leaves = tuple(id(getattr(n, "variable", None)) for n, name in zip(nodes, names) if name.endswith(ACCUMULATE_GRAD))
    return (names, tuple(s - low if 0 <= s < accumulate else s for s in seqs), edges, leaves)


_MEMO: dict = {}  # signature of a fresh pass -> (its NodeInfos, its key scope as items)
_MEMO_SIZE = 32


def _signature(w: Walk, param_names: dict[int, str], owner_key: tuple) -> tuple[tuple, list[int]]:
    """Everything `describe` reads of a fresh pass (none of its nodes known, no parent scope), as a hashable value that
    holds no graph object: per node in walk order its raw name and, for an AccumulateGrad node, the name of
    its parameter (leaves are keyed by walk order, which the position gives), for any other node its class
    and its sequence_nr relative to the first module boundary; and the module boundaries (`owner_key`, see
    `ModuleTracker.signature`), relative to the same base, on which `owner` depends. Also returns every node's
    sequence_nr (AccumulateGrad: `ACCUMULATE_GRAD_SEQUENCE_NR`), read in the same loop."""
    base = owner_key[0]
    if w.sig is not None and w.sig[0] == base:  # read by the C++ walk: the same facts, one bytes object
        get = param_names.get
        return (w.sig[1], tuple([get(v) for v in w.sig[2]]), owner_key[1]), w.raw_seqs
    parts = []  # three items per node, flat: one tuple in all rather than one per node
    extend = parts.extend
    seqs: list[int] = []
    keep = seqs.append
    sequence_nr = tp.sequence_nr
    accumulate = tp.ACCUMULATE_GRAD_SEQUENCE_NR
    for node in w.nodes:
        name = node.name()
        if name.endswith(ACCUMULATE_GRAD):
            var = getattr(node, "variable", None)
            extend((name, type(node), param_names.get(id(var)) if var is not None else None))
            keep(accumulate)
        else:
            seq = sequence_nr(node)
            extend((name, type(node), seq - base if seq >= 0 else None))
            keep(seq)
    return (tuple(parts), owner_key[1]), seqs


def key_ordinal(key: str) -> int:
    """The ordinal of a key 'module/Name#k' (-1 for a key without one)."""
    _, sep, k = key.rpartition("#")
    return int(k) if sep and k.isdigit() else -1


def _earlier(seqs: list[int], first_seq: int) -> bool:
    """True when some node of `seqs` (sequence numbers, -1 unknown) was created before `first_seq`."""
    low = min(seqs, default=first_seq)
    if low < 0:
        low = min((s for s in seqs if s >= 0), default=first_seq)
    return low < first_seq


def describe(
    w: Walk,
    owner,
    param_names: dict[int, str],
    known: Keyed,
    parent_scope: dict | None = None,
    owner_key: tuple | None = None,
    region=None,
    lineage=None,
    device_threads: bool = False,
) -> list[NodeInfo]:
    """Give every walked node a `NodeInfo`, with keys 'module/Name#ordinal' or 'param:qualified.name'.

    Args:
        w: the walk; `w.scope` is set to the key scope this pass used, `w.seqs` to every node's sequence_nr
            (`ACCUMULATE_GRAD_SEQUENCE_NR` for AccumulateGrad, -1 unknown) and `w.born` to {index: (step, pass,
            module call)} for the nodes created before this step (step None where no remembered recorded step
            created it; pass None: by a forward; call: `module_calls.call` of that step, None: none or not known).
        owner: callable sequence_nr -> module qualified name ('' outside any module).
        param_names: id(parameter) -> qualified name.
        known: the nodes already keyed earlier in this step (`Keyed`: a second pass over the same graph, double
            backward); updated in place.
        parent_scope: the key scope of the enclosing pass, for a nested pass (reentrant checkpoint).
        owner_key: `ModuleTracker.signature()` of the tracker behind `owner` (and `region`), or None. When given, a
            fresh pass (none of its nodes known, no parent scope) whose graph has the same signature as an earlier
            one (the same code, step after step) reuses that pass's NodeInfos: the same keys as computing them again.
        lineage: a `gradstore.recording.lineage.Lineage` (the nodes earlier steps keyed, by sequence number, and
            the first sequence number of this step), or None. A node created before this step (a hidden state
            that was not detached, a graph retained across steps) keeps the NodeInfo it got in the step that
            created it; the nodes of this step take ordinals after it, so no two nodes of a step share a key. One
            that no remembered walk keyed (made in a module's forward, first run by a later step) gets the module
            its own step's boundaries name (`Lineage.made`): for a module output that step did not walk, the key
            that step's findings gave it; else keyed in that module here; and the frame that step noted for it
            (`NodeInfo.frame`, record(frames=True)), where one was. One made where no remembered step
            noted module boundaries (before the recording, in a step not recorded) gets module `UNKNOWN_MODULE`.
        device_threads: a pass of this step ran on an accelerator, whose device threads number the nodes they
            create (double backward, recomputation) with counters of their own: a node below the step's first
            number that the lineage does not know is then not said to be older than the step.
        region: callable sequence_nr -> the modules inside the compiled region running then (str) or None
            (`ModuleTracker.region`); sets `NodeInfo.region` of every node (AccumulateGrad aside) created inside a
            `torch.compile` wrapper's call: its CompiledFunctionBackward, and the per-op nodes of a backend that runs
            the graph eagerly (backend='eager') or of ops run between graph breaks, which no module hook bounded
            either. None: no region is known.
    The ordinal of a node counts the nodes of the same name and module in forward order (`sequence_nr`,
    then walk order) within a key scope. A pass whose graph reuses nodes keyed earlier in this step (other
    than AccumulateGrad nodes: a second pass over a retained graph) continues their scope, and a nested pass
    continues its parent's. A fresh graph starts a new scope where it repeats an earlier graph of the step (a
    micro-batch: made after the earlier passes ended, or of the same structure over the same leaves), and
    otherwise continues the scope of the graphs since the last that started over (the graph double backward's
    first pass made, a second loss of one forward: `Keyed.fresh_base`). So two different nodes of a step never
    share a key unless one repeats the other, while micro-batches and steps of the same code give the same keys.
    The decision costs a `min` over the sequence numbers of a later fresh graph, and reads its structure only
    where that does not settle it.
    """
    memo_key = None
    seqs = None
    decided = None  # (the scope a fresh graph continues, or None where it starts over), once decided
    first_seq = lineage.first_seq if lineage is not None else None
    if owner_key is not None and parent_scope is None and known.isdisjoint(w.index):
        memo_key, seqs = _signature(w, param_names, owner_key)
        if first_seq is not None and _earlier(seqs, first_seq):
            memo_key = None  # nodes of an earlier step: keyed from the lineage, not the memo
        if memo_key is not None:  # every node new to the step: the memo keys a graph that starts over
            decided = (known.fresh_base(w, seqs),)
            if decided[0] is not None:
                memo_key = None
        hit = _MEMO.get(memo_key) if memo_key is not None else None
        if hit is not None:
            cached, scope_items = hit
            scope = dict(scope_items)
            known.add_all(w.index, w.nodes, cached, scope)  # index: the nodes' keys in walk order
            known.note_fresh(scope, w, seqs, True)
            w.scope = scope
            w.seqs = seqs
            return list(cached)
    if seqs is None:
        sequence_nr = tp.sequence_nr
        seqs = w.raw_seqs if w.raw_seqs is not None else [sequence_nr(n) for n in w.nodes]
    w.seqs = seqs
    infos: list[NodeInfo | None] = [None] * len(w.nodes)
    groups: dict[tuple[str, str], list[tuple[int, int]]] = {}
    taken: dict[tuple[str, str], int] = {}  # ordinals held by nodes of earlier steps
    born: dict[int, tuple] = {}
    made_in: dict[int, str] | None = None  # nodes of an earlier step made inside a compiled region: that region
    made_at: dict[int, str] | None = None  # nodes of an earlier step whose frame that step noted: that frame
    scope = parent_scope
    leaf_ordinal = 0
    idents = w.idents()
    kinds: list[str | None] = [None] * len(idents)
    for i, ident in enumerate(idents):
        hit = known.get(ident)
        if hit is not None:
            infos[i] = hit[0]
            if hit[0].kind != "accumulate_grad":
                if scope is None:
                    scope = hit[1]
                elif hit[1] is not scope:
                    for base, ordinal in hit[1].items():
                        scope[base] = max(scope.get(base, -1), ordinal)
            continue
        node = w.nodes[i]
        name = node_name(node)
        kind = kinds[i] = node_kind(node, name)
        if kind == "accumulate_grad":
            var = getattr(node, "variable", None)
            pname = param_names.get(id(var)) if var is not None else None
            if pname is not None:
                module = pname.rsplit(".", 1)[0] if "." in pname else ""
                infos[i] = NodeInfo(f"param:{pname}", name, kind, module, pname)
                continue
            # a leaf that is not a named parameter (an input with requires_grad): keyed by walk order
            groups.setdefault(("", name), []).append((-1, leaf_ordinal, i))
            leaf_ordinal += 1
            continue
        seq = seqs[i]
        if first_seq is not None and 0 <= seq < first_seq:  # created before this step
            earlier = lineage.lookup(seq)
            if earlier is not None and earlier[0].name == name:
                info = infos[i] = earlier[0]
                born[i] = earlier[1:]
                base = (info.module, info.name)
                taken[base] = max(taken.get(base, -1), key_ordinal(info.key))
                continue
            if not device_threads:  # no remembered walk keyed it: where its number was handed out, if remembered
                birth = lineage.made(seq, name)
                if birth is None:  # before the recording, or in a step not recorded: its module is not known
                    born[i] = (None, None, None)
                    groups.setdefault((UNKNOWN_MODULE, name), []).append((seq, i, i))
                    continue
                born[i] = (birth.step, birth.pass_, birth.call)
                if birth.info is not None:  # a module output its step did not walk: the key that step gave it
                    info = infos[i] = replace(birth.info, kind=kind, region=birth.region, frame=birth.frame)
                    base = (info.module, info.name)
                    taken[base] = max(taken.get(base, -1), key_ordinal(info.key))
                    continue
                if birth.frame is not None:  # the user-code line that made it, noted in the step that made it
                    if made_at is None:
                        made_at = {}
                    made_at[i] = birth.frame
                if birth.module is None:
                    groups.setdefault((UNKNOWN_MODULE, name), []).append((seq, i, i))
                    continue
                if birth.region is not None:
                    if made_in is None:
                        made_in = {}
                    made_in[i] = birth.region
                groups.setdefault((birth.module, name), []).append((seq, i, i))  # the module of the step that made it
                continue
        groups.setdefault((owner(seq), name), []).append((seq, i, i))
    fresh = scope is None
    if fresh:
        if decided is None:

            def exact() -> int:  # the least sequence number of the nodes this graph keys (-1: one is unknown)
                keyed = (seqs[i] for ms in groups.values() for _, _, i in ms if kinds[i] != "accumulate_grad")
                return min(keyed, default=tp.ACCUMULATE_GRAD_SEQUENCE_NR)

            decided = (known.fresh_base(w, seqs, exact=exact),)
        scope = {} if decided[0] is None else decided[0]
    for base, ordinal in taken.items():
        scope[base] = max(scope.get(base, -1), ordinal)
    for (module, name), members in groups.items():
        start = scope.get((module, name), -1) + 1
        prefix = f"{module}/" if module else ""
        for ordinal, (seq, _, i) in enumerate(sorted(members), start=start):
            kind = kinds[i]
            inside = region(seq) if region is not None else None
            infos[i] = NodeInfo(f"{prefix}{name}#{ordinal}", name, kind, module, None, region=inside)
        scope[(module, name)] = start + len(members) - 1
    if made_in:  # the region of the step that made them, not this step's (`region` answers for this step's numbers)
        for i, inside in made_in.items():
            infos[i] = replace(infos[i], region=inside)
    if made_at:  # the frame noted in the step that made them (this step's frame record starts at its first number)
        for i, frame in made_at.items():
            infos[i] = replace(infos[i], frame=frame)
    known.hold(w.nodes)
    for i, ident in enumerate(idents):
        known.add(ident, infos[i], scope)
    if fresh:
        known.note_fresh(scope, w, seqs, decided[0] is None)
    w.scope = scope
    w.born = born or None
    if memo_key is not None:
        if len(_MEMO) >= _MEMO_SIZE:
            _MEMO.clear()
        _MEMO[memo_key] = (tuple(infos), tuple(scope.items()))
    return infos  # type: ignore[return-value]
