"""The op list as a graph: ``build_graph``, ``validate``, ``explain`` and ``to_dot``.

:func:`build_graph` turns a :class:`~te_ops.Sequential`, an :class:`~te_ops.OperationFuser` or a
single op into a :class:`networkx.DiGraph`:

* ``"input"`` and ``"output"``: the main input and output;
* ``"op{i}"``: the i-th step of the main chain, a basic op or a plain ``torch.nn.Module``
  (``fusible=False``), with attributes ``index``, ``type``, ``key`` (module path in the
  ``Sequential``), ``description``, ``fuser`` (index of its fuser group, ``None`` for plain
  modules), ``position`` (index among that fuser's basic ops) and ``module`` (the object);
* ``"extra{k}:{name}"`` (``"extra{k}"`` when the op does not name it): one node per extra-input
  channel, ``k`` being the extra input's position in the call
  (``block(x, extra0, extra1, ...)``). With sample extra inputs, inputs that are the same tensor
  object (or equal host lists) share one channel node, as the fuser's plan-cache key does.

Edges carry ``kind="main"`` (``input -> op0 -> ... -> output``) or ``kind="extra"`` (channel ->
consumer, with ``channel`` the name the consumer gives that input and ``slot`` its position among
the consumer's extra inputs). An extra input fed by an earlier op's extra output
(:meth:`~te_ops.op.BasicOperation.feed_extra_input`) is no channel: the consumer's node
attribute ``fed`` maps its slot to ``(producer node, name)``; :func:`to_dot` draws it dotted.

:func:`explain` prints, per op, which forward and backward op covers it in the fuser's plan,
why registered fusions did not apply and the ops' kernel-dispatch notes. :func:`to_dot` writes
Graphviz DOT text with the forward plan's fused ops as clusters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from . import env
from .fuser import OperationFuser
from .op import HOOKS_NOTE, BasicOperation, FusibleOperation, has_hooks
from .signature import CallSignature
from .splits import check_split_sizes_type

if TYPE_CHECKING:
    import networkx as nx

__all__ = ["build_graph", "validate", "explain", "to_dot", "extra_input_names"]


# ---------------------------------------------------------------------------- layout
@dataclass
class _Step:
    """One step of the main chain: a basic op of a fuser, or a plain module."""

    key: str
    module: torch.nn.Module
    fuser: int | None  # index into the fuser list, None for a plain module
    position: int | None  # index among the fuser's basic ops


def _fuser_of_op(op: FusibleOperation) -> OperationFuser:
    """The fuser a lone op runs through (the one it made on its first call, if any)."""
    fuser = op.__dict__.get("_standalone_fuser")
    return fuser if isinstance(fuser, OperationFuser) else OperationFuser([op])


def _is_container(module: Any) -> bool:
    """Whether ``module`` is a te_ops container (``te_ops.Sequential``, which sits above this
    module and calls it: its ``_groups()`` are its fusers and plain modules in order)."""
    return isinstance(module, torch.nn.Module) and callable(getattr(module, "_groups", None))


def _layout(module: Any) -> tuple[list[_Step], list[OperationFuser]]:
    """The main chain's steps and the fusers that run them, in order.

    Raises
    ------
    TypeError
        ``module`` is not a te_ops Sequential, OperationFuser or operation.
    """
    if _is_container(module):
        keyed: list[tuple[str, torch.nn.Module]] = []
        for i, item in module._modules.items():
            if isinstance(item, FusibleOperation):
                ops = item.basic_ops
                for j, op in enumerate(ops):
                    keyed.append((i if len(ops) == 1 else f"{i}.{j}", op))
            else:
                keyed.append((i, item))
        steps: list[_Step] = []
        fusers: list[OperationFuser] = []
        pos = 0
        for group in module._groups():
            if isinstance(group, OperationFuser):
                for j in range(len(group.basic_ops)):
                    key, _ = keyed[pos]
                    steps.append(_Step(key, group.basic_ops[j], len(fusers), j))
                    pos += 1
                fusers.append(group)
            else:
                steps.append(_Step(keyed[pos][0], group, None, None))
                pos += 1
        return steps, fusers
    if isinstance(module, OperationFuser):
        fuser = module
        keys = [str(i) for i in range(len(fuser.basic_ops))]
    elif isinstance(module, FusibleOperation):
        fuser = _fuser_of_op(module)
        ops = fuser.basic_ops
        keys = [""] if len(ops) == 1 else [str(j) for j in range(len(ops))]
    else:
        raise TypeError(
            "module must be a te_ops.Sequential, OperationFuser or FusibleOperation, got "
            f"{type(module).__name__}"
        )
    steps = [_Step(k, op, 0, j) for j, (k, op) in enumerate(zip(keys, fuser.basic_ops))]
    return steps, [fuser]


def extra_input_names(op: torch.nn.Module) -> list[str | None]:
    """Names of an op's extra inputs (from its :class:`~te_ops.signature.CallSignature`),
    ``None`` where the op does not name one; ``[]`` for modules without extra inputs."""
    if not isinstance(op, BasicOperation):
        return []
    return CallSignature([op]).names[0]


def _describe(module: torch.nn.Module) -> str:
    if isinstance(module, BasicOperation):
        return module.describe()
    extra = module.extra_repr()
    return f"{type(module).__name__}({extra})"


def _summary(value: Any) -> str:
    """Short text for a sample extra input."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        return f"tensor {dtype} {tuple(value.shape)} on {value.device}"
    if isinstance(value, (list, tuple)):
        text = repr(list(value))
        return f"list {text if len(text) <= 40 else text[:37] + '...'}"
    return type(value).__name__


# ---------------------------------------------------------------------------- graph
def build_graph(module: Any, *extra_inputs: Any) -> nx.DiGraph:
    """The op graph of ``module`` (see the module docstring for nodes and edges).

    Parameters
    ----------
    module : te_ops.Sequential | OperationFuser | FusibleOperation
    *extra_inputs :
        Optional sample extra inputs, as they would follow the main input in a call. When
        given, extra inputs from one source (same tensor object, or equal host lists) share one
        channel node; otherwise every extra input gets its own.

    Returns
    -------
    networkx.DiGraph
        Graph attribute ``name`` is the module's class name.

    Raises
    ------
    TypeError
        ``module`` is not a te_ops container or operation.
    ValueError
        ``extra_inputs`` are given but their number is not what the ops take.
    """
    steps, _ = _layout(module)
    signature = CallSignature([s.module for s in steps if s.fuser is not None])
    if extra_inputs:
        signature.split(extra_inputs)  # raises on a wrong count
    classes = signature.source_classes(extra_inputs)
    per_op = iter([[sl for sl in signature.slots if sl.op == i]
                   for i in range(len(signature.counts))])

    import networkx as nx  # imported when used: `import te_ops` does not need it

    graph = nx.DiGraph(name=type(module).__name__)
    graph.add_node("input", kind="input")
    prev = "input"
    channel_node: dict[int, str] = {}
    k = 0
    op_node = [f"op{index}" for index, step in enumerate(steps) if step.fuser is not None]
    fed: dict[str, dict[int, tuple[str, str]]] = {}
    for (consumer, slot), source in signature.fed.items():
        fed.setdefault(op_node[consumer], {})[slot] = (
            op_node[source.op], signature.names[consumer][slot] or f"extra input {slot}")
    for index, step in enumerate(steps):
        node = f"op{index}"
        fusible = step.fuser is not None
        graph.add_node(
            node, kind="op", index=index, type=type(step.module).__name__, key=step.key,
            description=_describe(step.module), fuser=step.fuser, position=step.position,
            fusible=fusible, module=step.module, fed=fed.get(node, {}),
        )
        graph.add_edge(prev, node, kind="main")
        prev = node
        if not fusible:
            continue
        for slot, name in ((sl.slot, sl.name) for sl in next(per_op)):
            cls = classes[k]
            if cls not in channel_node:
                channel_node[cls] = f"extra{k}:{name}" if name else f"extra{k}"
                graph.add_node(channel_node[cls], kind="channel", channel=name or f"extra{k}",
                               positions=[],
                               summary=_summary(extra_inputs[k]) if extra_inputs else "")
            source = channel_node[cls]
            graph.nodes[source]["positions"].append(k)
            graph.add_edge(source, node, kind="extra", channel=name or f"extra{k}", slot=slot,
                           position=k)
            k += 1
    graph.add_node("output", kind="output")
    graph.add_edge(prev, "output", kind="main")
    return graph


def _node_kind(graph: nx.DiGraph, node: Any) -> str:
    kind = graph.nodes[node].get("kind")
    if kind:
        return kind
    if node in ("input", "output"):
        return node
    if str(node).startswith("extra"):
        return "channel"
    return "op"


def validate(graph: nx.DiGraph) -> None:
    """Check that ``graph`` is a well-formed op graph.

    The main edges must form one chain ``input -> ... -> output`` with increasing ``index``
    through every op node; every extra edge must come from a channel node that has no incoming
    edges.

    Raises
    ------
    ValueError
        The graph has a cycle, an op node is not on the main chain from ``"input"`` (a consumer
        without an earlier producer), the chain branches or is out of order, or an extra edge
        comes from something other than a source channel node. The message names the node.
    """
    import networkx as nx

    if not nx.is_directed_acyclic_graph(graph):
        cycle = nx.find_cycle(graph)
        nodes = " -> ".join(str(u) for u, _ in cycle) + f" -> {cycle[0][0]}"
        raise ValueError(f"graph has a cycle through node {cycle[0][0]!r}: {nodes}")
    if "input" not in graph:
        raise ValueError("graph has no 'input' node")
    for u, v, data in graph.edges(data=True):
        kind = data.get("kind")
        if kind not in ("main", "extra"):
            raise ValueError(f"edge {u!r} -> {v!r} has kind {kind!r}, expected 'main' or 'extra'")
        if kind == "extra":
            if _node_kind(graph, u) != "channel":
                raise ValueError(
                    f"extra edge into node {v!r} comes from {u!r}, which is not a channel node"
                )
            if graph.in_degree(u):
                raise ValueError(
                    f"channel node {u!r} (feeding {v!r}) has incoming edges; channels are sources"
                )
        elif _node_kind(graph, u) == "channel":
            raise ValueError(f"channel node {u!r} has a main edge to {v!r}")

    on_chain = {"input"}
    node, last_index = "input", -1
    while True:
        nexts = [v for v in graph.successors(node) if graph.edges[node, v].get("kind") == "main"]
        if not nexts:
            break
        if len(nexts) > 1:
            raise ValueError(f"node {node!r} has {len(nexts)} main successors {nexts}, "
                             "expected one")
        node = nexts[0]
        index = graph.nodes[node].get("index")
        if index is not None:
            if index <= last_index:
                raise ValueError(f"node {node!r} has index {index} after index {last_index}: "
                                 "main chain out of order")
            last_index = index
        on_chain.add(node)
    if node != "output" and "output" in graph:
        raise ValueError(f"main chain from 'input' ends at {node!r}, not at 'output'")
    for n in graph.nodes:
        if _node_kind(graph, n) in ("op", "output") and n not in on_chain:
            raise ValueError(f"node {n!r} has no producer on the main chain from 'input'")


# ---------------------------------------------------------------------------- plans
def _plans(fusers: list[OperationFuser], sample_inputs: Sequence[Any]) -> list[Any]:
    """Each fuser's plan: for the sample call if given, else the last call's, else unknown."""
    if not sample_inputs:
        plans = []
        for f in fusers:
            plan = getattr(f, "_plan", None)
            plans.append(plan if plan is not None else f.plan())
        return plans
    input_, *extra = sample_inputs
    if not isinstance(input_, torch.Tensor):
        raise TypeError(
            f"sample_inputs[0] must be the main input tensor, got {type(input_).__name__}"
        )
    counts = [f.signature.total for f in fusers]
    if extra and len(extra) != sum(counts):
        raise ValueError(
            f"sample_inputs: expected the main input and {sum(counts)} extra inputs, got the "
            f"main input and {len(extra)}"
        )
    _check_sample(fusers, input_, extra)
    plans, pos = [], 0
    for f, n in zip(fusers, counts):
        plans.append(f.plan(input_, *extra[pos:pos + n]))
        pos += n if extra else 0
    return plans


def _check_sample(fusers: list[OperationFuser], input_: torch.Tensor,
                  extra: Sequence[Any]) -> None:
    """Raise what the call raises for the sample's main input (checked by the first op, which
    takes it: features, dtype, device) and for every split-size input (kind, length, dtype,
    device; no host read), so that ``explain(sample)`` plans no call the ops reject. Checks
    that need an intermediate shape stay with the call."""
    ops = [op for f in fusers for op in f.basic_ops]
    check = getattr(ops[0], "check_input", None) if ops else None
    if callable(check):
        check(input_)
    values = iter(extra)
    for f in fusers:
        for op, names in zip(f.basic_ops, f.signature.names):
            for name in names:
                value = next(values, None)
                if (name == "split_sizes" and extra
                        and isinstance(getattr(op, "num_groups", None), int)):
                    check_split_sizes_type(value, op.num_groups, input_.device)


def _covering(plan: Any, attr: str) -> dict[int, tuple[Any, list[int]]]:
    """Basic-op position -> (op covering it in the plan's forward or backward list, positions)."""
    out: dict[int, tuple[Any, list[int]]] = {}
    for op, idx in getattr(plan, attr):
        for i in idx:
            out[i] = (op, list(idx))
    return out


def _cover_text(op: Any, idx: list[int]) -> str:
    if not getattr(op, "is_fused_op", False):
        return "unfused"
    span = f"ops {idx[0]}-{idx[-1]}" if len(idx) > 1 else f"op {idx[0]}"
    return f"{type(op).__name__} ({span})"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]

    def line(cells: Sequence[str]) -> str:
        return (indent + "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))).rstrip()

    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _changed_env() -> list[str]:
    return [f"{name}={value}" for name, value in env.snapshot()
            if value != env.ENV_VARS[name].default]


def explain(module: Any, *sample_inputs: Any) -> str:
    """A plain-text report of the fusion and dispatch decisions for ``module``.

    Parameters
    ----------
    module : te_ops.Sequential | OperationFuser | FusibleOperation
    *sample_inputs :
        Optional ``(input_, *extra_inputs)`` of a call to plan for (nothing runs; the main
        input's dtype and device stand for every fuser's input). Without them each fuser's plan
        of its last call is shown, or, before any call, the plan for unknown inputs.

    Returns
    -------
    str
        An ops table (index, key, description, fuser, forward op, backward op; ``unfused`` for
        basic ops that run on their own), a ``fusions not applied`` section with the reasons
        fusions recorded, and a ``dispatch`` section: what each op ran at its last call
        (``dispatch_records``, the decisions saved in its layout), or with sample inputs or
        before any call what the plan would take (``dispatch_notes``).

    Raises
    ------
    TypeError
        ``module`` is not a te_ops container or op, or ``sample_inputs[0]`` is not a tensor.
    ValueError
        ``sample_inputs`` hold extra inputs but not as many as the ops take.
    TypeError, ValueError
        The call's own error where the first op rejects the main input (features, dtype,
        device) or a GroupedLinear its split sizes (kind, length, dtype, device).
    """
    _, fusers = _layout(module)
    plans = _plans(fusers, sample_inputs)  # checks the sample inputs
    graph = build_graph(module, *sample_inputs[1:])
    forward = [_covering(p, "forward_ops") for p in plans]
    backward = [_covering(p, "backward_ops") for p in plans]

    steps = [d for _, d in sorted(((d["index"], d) for n, d in graph.nodes(data=True)
                                   if d.get("kind") == "op"), key=lambda t: t[0])]
    rows = []
    for d in steps:
        if d["fuser"] is None:
            rows.append([str(d["index"]), d["key"], d["description"], "-", "runs as is (torch)",
                         "runs as is (torch)"])
            continue
        k, pos = d["fuser"], d["position"]
        rows.append([str(d["index"]), d["key"], d["description"], str(k),
                     _cover_text(*forward[k][pos]), _cover_text(*backward[k][pos])])

    info0 = plans[0].info if plans else None
    if info0 is not None and info0.dtype is not None:
        call = f"input {str(info0.dtype).removeprefix('torch.')} on {info0.device}"
    else:
        call = "input unknown (planned without a call)"
    lines = [f"te_ops plan for {type(module).__name__}: {_count(len(steps), 'op')}, "
             f"{_count(len(fusers), 'fuser')}; {call}"]
    changed = _changed_env()
    lines.append("env: " + (", ".join(changed) if changed else "defaults"))
    lines.append("")
    lines += _table(["#", "key", "op", "fuser", "forward", "backward"], rows)

    lines += ["", "fusions not applied:"]
    note_rows = []
    for k, plan in enumerate(plans):
        if _is_container(module) and len(fusers[k].basic_ops) == 1:
            op = fusers[k].basic_ops[0]
            if has_hooks(op):
                note_rows.append([str(k), "-", f"{op.describe()} {HOOKS_NOTE}"])
        seen = set()
        for name, reason in plan.info.notes:
            if (name, reason) not in seen:
                seen.add((name, reason))
                note_rows.append([str(k), name or "-", reason])
    lines += _table(["fuser", "fusion", "reason"], note_rows) if note_rows else ["  (none)"]

    lines += ["", "dispatch:"]
    dispatch_rows = []
    for d in steps:
        if d["fuser"] is None:
            continue
        ran = [] if sample_inputs else d["module"].dispatch_records()
        try:  # what ran at the last call; else what the plan would take
            notes = ran or list(d["module"].dispatch_notes(plans[d["fuser"]].info))
        except Exception as exc:  # a diagnostic report should not die on one op
            notes = [f"dispatch_notes raised {type(exc).__name__}: {exc}"]
        for j, note in enumerate(notes):
            dispatch_rows.append([str(d["index"]) if j == 0 else "",
                                  d["description"] if j == 0 else "", note])
    lines += (_table(["#", "op", "decision"], dispatch_rows) if dispatch_rows
              else ["  (no dispatch decisions)"])
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- DOT
def _q(text: Any) -> str:
    """A DOT quoted string."""
    escaped = str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def to_dot(module: Any, *sample_inputs: Any) -> str:
    """Graphviz DOT text of the op graph.

    Each fuser group is a dotted cluster; inside it every op of its forward plan that is fused
    is a filled cluster named after the fused op's class. Extra-input channels are dashed
    nodes with dashed edges labelled by the channel name. Op labels show the backward op where
    the backward plan fuses differently. Render with ``dot -Tsvg``.

    Parameters
    ----------
    module : te_ops.Sequential | OperationFuser | FusibleOperation
    *sample_inputs :
        As :func:`explain`: optional ``(input_, *extra_inputs)`` of a call to plan for
        (nothing runs; the last call's plan is kept); the extra inputs also let channels from
        one source share a node (see :func:`build_graph`).
    """
    _, fusers = _layout(module)
    plans = _plans(fusers, sample_inputs)  # checks the sample inputs
    graph = build_graph(module, *sample_inputs[1:])
    backward = [_covering(p, "backward_ops") for p in plans]
    ops = {d["index"]: n for n, d in graph.nodes(data=True) if d.get("kind") == "op"}
    by_position = {(d["fuser"], d["position"]): n for n, d in graph.nodes(data=True)
                   if d.get("kind") == "op" and d["fuser"] is not None}

    def op_line(node: str) -> str:
        d = graph.nodes[node]
        label = f"{node}: {d['description']}"
        if d["key"]:
            label += f"\nkey {d['key']}"
        if d["fuser"] is not None:
            bop, bidx = backward[d["fuser"]][d["position"]]
            if getattr(bop, "is_fused_op", False):
                label += f"\nbwd: {_cover_text(bop, bidx)}"
        shape = "box" if d["fusible"] else "box, style=rounded"
        return f"{_q(node)} [label={_q(label)}, shape={shape}];"

    out = [f"digraph {_q(graph.graph.get('name', 'te_ops'))} {{", "  rankdir=TB;",
           '  node [fontname="Helvetica"];', '  edge [fontname="Helvetica"];',
           '  "input" [shape=oval];', '  "output" [shape=oval];']
    placed: set[str] = set()
    for k, plan in enumerate(plans):
        out.append(f"  subgraph cluster_fuser{k} {{")
        out.append(f"    label={_q(f'OperationFuser {k}')}; style=dotted;")
        for j, (op, idx) in enumerate(plan.forward_ops):
            members = [by_position[(k, i)] for i in idx]
            if getattr(op, "is_fused_op", False):
                out.append(f"    subgraph cluster_fuser{k}_fwd{j} {{")
                out.append(f"      label={_q(type(op).__name__)}; style=filled; "
                           'fillcolor="#e8f0fe";')
                out += [f"      {op_line(n)}" for n in members]
                out.append("    }")
            else:
                out += [f"    {op_line(n)}" for n in members]
            placed.update(members)
        out.append("  }")
    for index in sorted(ops):
        if ops[index] not in placed:
            out.append(f"  {op_line(ops[index])}")
    for node, d in graph.nodes(data=True):
        if d.get("kind") == "channel":
            label = node if not d.get("summary") else f"{node}\n{d['summary']}"
            out.append(f"  {_q(node)} [label={_q(label)}, shape=note, style=dashed];")
    for node, d in graph.nodes(data=True):
        for producer, channel in d.get("fed", {}).values():
            out.append(f"  {_q(producer)} -> {_q(node)} [style=dotted, label={_q(channel)}];")
    for u, v, d in graph.edges(data=True):
        if d["kind"] == "main":
            out.append(f"  {_q(u)} -> {_q(v)};")
        else:
            out.append(f"  {_q(u)} -> {_q(v)} [style=dashed, label={_q(d['channel'])}];")
    out.append("}")
    return "\n".join(out) + "\n"
