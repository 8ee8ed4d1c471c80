"""Tests of te_ops.ir: the op graph, its validation, explain() and to_dot()."""

from __future__ import annotations

import re

import networkx as nx
import pytest
import torch

import te_ops
from te_ops.fuser import register_forward_fusion, unregister_fusion
from te_ops.ir import build_graph, explain, extra_input_names, to_dot, validate

G, HIDDEN, FFN, TOKENS = 4, 8, 16, 10


def _mlp(**fc2_kwargs) -> te_ops.Sequential:
    torch.manual_seed(0)
    return te_ops.Sequential(
        te_ops.GroupedLinear(G, HIDDEN, 2 * FFN),
        te_ops.ScaledSwiGLU(),
        te_ops.GroupedLinear(G, FFN, HIDDEN, **fc2_kwargs),
    )


def _inputs():
    x = torch.randn(TOKENS, HIDDEN, requires_grad=True)
    splits = torch.tensor([3, 0, 4, 3])
    probs = torch.rand(TOKENS)
    return x, splits, probs


def _edges(graph: nx.DiGraph, kind: str) -> set[tuple[str, str]]:
    return {(u, v) for u, v, d in graph.edges(data=True) if d["kind"] == kind}


# ---------------------------------------------------------------------------- build_graph
def test_graph_nodes_and_main_edges():
    graph = build_graph(_mlp())
    ops = ["op0", "op1", "op2"]
    assert set(graph.nodes) == {"input", "output", *ops, "extra0:split_sizes", "extra1:probs",
                                "extra2:split_sizes"}
    assert _edges(graph, "main") == {("input", "op0"), ("op0", "op1"), ("op1", "op2"),
                                     ("op2", "output")}
    types = [graph.nodes[n]["type"] for n in ops]
    assert types == ["GroupedLinear", "ScaledSwiGLU", "GroupedLinear"]
    assert [graph.nodes[n]["key"] for n in ops] == ["0", "1", "2"]
    assert [graph.nodes[n]["index"] for n in ops] == [0, 1, 2]
    assert [graph.nodes[n]["fuser"] for n in ops] == [0, 0, 0]
    assert all(graph.nodes[n]["fusible"] for n in ops)
    assert graph.nodes["op0"]["description"] == "GroupedLinear(groups=4, 8->32)"
    assert validate(graph) is None


def test_graph_extra_edges_without_samples_are_separate_channels():
    graph = build_graph(_mlp())
    assert _edges(graph, "extra") == {("extra0:split_sizes", "op0"), ("extra1:probs", "op1"),
                                      ("extra2:split_sizes", "op2")}
    for u, _, d in graph.edges(data=True):
        if d["kind"] == "extra":
            assert d["channel"] == u.split(":")[1]
            assert graph.nodes[u]["kind"] == "channel"


def test_graph_shares_split_size_channel_for_same_tensor():
    _, splits, probs = _inputs()
    graph = build_graph(_mlp(), splits, probs, splits)
    assert "extra2:split_sizes" not in graph
    assert set(graph.successors("extra0:split_sizes")) == {"op0", "op2"}
    assert graph.nodes["extra0:split_sizes"]["positions"] == [0, 2]
    assert graph.edges["extra0:split_sizes", "op2"]["channel"] == "split_sizes"
    assert validate(graph) is None


def test_graph_shares_channel_for_equal_host_lists():
    _, _, probs = _inputs()
    graph = build_graph(_mlp(), [3, 0, 4, 3], probs, [3, 0, 4, 3])
    assert set(graph.successors("extra0:split_sizes")) == {"op0", "op2"}


def test_graph_separate_channels_for_different_tensors():
    _, splits, probs = _inputs()
    graph = build_graph(_mlp(), splits, probs, splits.clone())
    assert set(graph.successors("extra0:split_sizes")) == {"op0"}
    assert set(graph.successors("extra2:split_sizes")) == {"op2"}


def test_graph_scale_bias_probs_channel_shared_with_swiglu():
    _, splits, probs = _inputs()
    graph = build_graph(_mlp(scale_bias=True), splits, probs, splits, probs)
    assert set(graph.successors("extra1:probs")) == {"op1", "op2"}
    assert graph.edges["extra1:probs", "op2"]["slot"] == 1
    assert extra_input_names(te_ops.GroupedLinear(2, 4, 4, scale_bias=True)) == [
        "split_sizes", "probs"]


def test_graph_wrong_number_of_extra_inputs_names_argument():
    _, splits, probs = _inputs()
    with pytest.raises(ValueError, match="extra_inputs: expected 3"):
        build_graph(_mlp(), splits, probs)


def test_graph_plain_module_and_several_fusers():
    block = te_ops.Sequential(te_ops.Bias(4), torch.nn.ReLU(), te_ops.Identity(), te_ops.Bias(4))
    graph = build_graph(block)
    assert graph.nodes["op1"]["type"] == "ReLU"
    assert graph.nodes["op1"]["fusible"] is False
    assert graph.nodes["op1"]["fuser"] is None
    assert [graph.nodes[f"op{i}"]["fuser"] for i in (0, 2, 3)] == [0, 1, 1]
    assert _edges(graph, "extra") == set()
    assert validate(graph) is None


class _Unnamed(te_ops.BasicOperation):
    num_extra_inputs = 1


def test_graph_unknown_op_channel_is_numbered():
    graph = build_graph(te_ops.Sequential(te_ops.Bias(4), _Unnamed()))
    assert ("extra0", "op1") in _edges(graph, "extra")
    assert graph.nodes["extra0"]["channel"] == "extra0"


def test_graph_of_fuser_and_single_op():
    fuser = te_ops.OperationFuser([te_ops.Bias(4), te_ops.Identity()])
    graph = build_graph(fuser)
    assert [graph.nodes[n]["type"] for n in ("op0", "op1")] == ["Bias", "Identity"]
    single = build_graph(te_ops.GroupedLinear(2, 4, 4))
    assert set(single.nodes) == {"input", "op0", "extra0:split_sizes", "output"}
    with pytest.raises(TypeError, match="module must be"):
        build_graph(torch.nn.Linear(2, 2))


# ---------------------------------------------------------------------------- validate
def _chain(*nodes: str) -> nx.DiGraph:
    graph = nx.DiGraph()
    for i, n in enumerate(nodes):
        graph.add_node(n, kind="op", index=i)
    path = ["input", *nodes, "output"]
    graph.add_node("input", kind="input")
    graph.add_node("output", kind="output")
    for u, v in zip(path, path[1:]):
        graph.add_edge(u, v, kind="main")
    return graph


def test_validate_accepts_hand_made_chain():
    graph = _chain("op0", "op1")
    graph.add_node("extra0:probs", kind="channel")
    graph.add_edge("extra0:probs", "op1", kind="extra", channel="probs")
    assert validate(graph) is None


def test_validate_raises_on_cycle():
    graph = _chain("op0", "op1")
    graph.add_edge("op1", "op0", kind="main")
    with pytest.raises(ValueError, match=r"cycle through node 'op[01]'"):
        validate(graph)


def test_validate_raises_on_consumer_without_producer():
    graph = _chain("op0")
    graph.add_node("op1", kind="op", index=1)
    graph.add_edge("op1", "output", kind="main")
    with pytest.raises(ValueError, match="'op1' has no producer"):
        validate(graph)


def test_validate_raises_on_extra_edge_from_non_channel():
    graph = _chain("op0", "op1")
    graph.add_edge("op0", "op1", kind="extra", channel="probs")  # replaces the main edge
    with pytest.raises(ValueError, match="'op0', which is not a channel node"):
        validate(graph)


def test_validate_raises_on_channel_with_producer():
    graph = _chain("op0", "op1")
    graph.add_node("extra0:probs", kind="channel")
    graph.add_edge("op0", "extra0:probs", kind="main")
    graph.add_edge("extra0:probs", "op1", kind="extra", channel="probs")
    with pytest.raises(ValueError, match="extra0:probs"):
        validate(graph)


def test_validate_raises_on_out_of_order_chain():
    graph = _chain("op0", "op1")
    graph.nodes["op1"]["index"] = 0
    with pytest.raises(ValueError, match="'op1'.*out of order"):
        validate(graph)


# ---------------------------------------------------------------------------- explain
def _rows(text: str) -> list[str]:
    table = text.split("fusions not applied:")[0]
    return [line for line in table.splitlines() if re.match(r"\s+\d+\s", line)]


def test_explain_lists_every_op_description():
    block = _mlp()
    text = explain(block)
    for op in block:
        assert op.describe() in text
    assert "fusions not applied:" in text
    assert "dispatch:" in text
    assert len(_rows(text)) == 3


def test_explain_unfused_when_fusion_disabled(monkeypatch):
    monkeypatch.setenv("TE_OPS_FUSION", "0")
    block = _mlp()
    x, splits, probs = _inputs()
    text = explain(block, x, splits, probs, splits)
    rows = _rows(text)
    assert len(rows) == 3
    for row in rows:
        assert row.split()[-2:] == ["unfused", "unfused"]
    assert "TE_OPS_FUSION=0" in text
    assert "grouped GEMM backend" in text
    assert block.explain(x, splits, probs, splits) == text


def test_explain_after_a_call_uses_its_plan(monkeypatch):
    monkeypatch.setenv("TE_OPS_FUSION", "0")
    block = _mlp()
    x, splits, probs = _inputs()
    block(x, splits, probs, splits).sum().backward()
    text = explain(block)
    assert "input float32 on cpu" in text
    assert "planned without a call" not in text


def test_explain_columns_are_aligned():
    text = explain(te_ops.Sequential(te_ops.Bias(4), torch.nn.ReLU(), te_ops.Identity()))
    lines = text.splitlines()
    header = next(line for line in lines if line.strip().startswith("#  key"))
    start = header.index("forward")
    for row in _rows(text):
        assert row[start - 2:start] == "  "
    assert "runs as is" in text


class _FusedBiasPair(te_ops.FusedOperation):
    pass


def _fuse_identity_bias(ops, *, recipe=None, info=None):
    out, i = [], 0
    while i < len(ops):
        window = ops[i:i + 2]
        if (len(window) == 2 and isinstance(window[0], te_ops.Identity)
                and isinstance(window[1], te_ops.Bias)):
            out.append(_FusedBiasPair(window))
            i += 2
            continue
        if isinstance(ops[i], te_ops.Identity):
            info.note(f"op {i}: Identity not followed by Bias")
        out.append(ops[i])
        i += 1
    return out


@pytest.fixture
def identity_bias_fusion():
    fusion = register_forward_fusion(_fuse_identity_bias, name="identity_bias_test")
    yield fusion
    unregister_fusion(fusion)


def test_explain_names_fused_op_and_notes(identity_bias_fusion):
    block = te_ops.Sequential(te_ops.Identity(), te_ops.Bias(4), te_ops.Identity())
    text = explain(block, torch.randn(2, 4))
    rows = _rows(text)
    assert "_FusedBiasPair (ops 0-1)" in rows[0]
    assert "_FusedBiasPair (ops 0-1)" in rows[1]
    assert rows[0].split()[-1] == "unfused"  # forward-only fusion: backward stays unfused
    assert rows[2].split()[-2:] == ["unfused", "unfused"]
    assert "identity_bias_test" in text
    assert "op 2: Identity not followed by Bias" in text


def test_explain_checks_sample_inputs():
    block = _mlp()
    x, splits, probs = _inputs()
    with pytest.raises(ValueError, match="sample_inputs: expected the main input and 3"):
        explain(block, x, splits)
    with pytest.raises(TypeError, match=r"sample_inputs\[0\]"):
        explain(block, splits.tolist(), splits, probs, splits)


# ---------------------------------------------------------------------------- to_dot
def test_explain_with_the_main_input_only_says_split_sizes_are_unknown():
    """``explain(x)`` without the extra inputs says the split sizes are unknown and what graph
    safety depends on, not "fc1 and fc2 split sizes are not the same source" and "not
    graph-safe" (faults of a call that was not described); with the extras those texts
    stay."""
    x, splits, probs = _inputs()
    text = explain(_mlp(), x)
    assert "split sizes not known (planned without the extra inputs" in text
    assert "not the same source" not in text
    assert text.count("graph-safe only with split sizes as a device tensor") == 2
    text = explain(_mlp().to(torch.float64), x.double())  # the loop: never graph-safe
    assert "only with split sizes" not in text and "not graph-safe" in text
    lists = explain(_mlp(), x, [3, 0, 4, 3], probs, [3, 0, 4, 3])
    assert "only with split sizes" not in lists and lists.count("; not graph-safe)") == 2
    assert explain(_mlp(), x, splits, probs, splits).count("; graph-safe)") == 2
    with pytest.warns(UserWarning, match="two different tensor objects"):
        two = explain(_mlp(), x, splits, probs, splits.clone())
    assert "fc1 and fc2 split sizes are not the same source" in two


def test_to_dot_text():
    block = _mlp()
    dot = to_dot(block)
    assert dot.startswith("digraph")
    assert dot.count("{") == dot.count("}")
    for i, op in enumerate(block):
        assert f'"op{i}"' in dot
        assert op.describe() in dot
    assert '"extra0:split_sizes" -> "op0" [style=dashed' in dot
    assert '"input" -> "op0";' in dot
    assert "subgraph cluster_fuser0" in dot
    assert block.to_dot() == dot


def test_to_dot_shared_channel_and_fused_cluster(identity_bias_fusion):
    x, splits, probs = _inputs()
    dot = to_dot(_mlp(), x, splits, probs, splits)
    assert '"extra0:split_sizes" -> "op2" [style=dashed' in dot
    fused = to_dot(te_ops.Sequential(te_ops.Identity(), te_ops.Bias(4), torch.nn.ReLU()))
    assert 'label="_FusedBiasPair"' in fused
    cluster = fused.split("subgraph cluster_fuser0_fwd0")[1].split("}")[0]
    assert '"op0"' in cluster and '"op1"' in cluster
    assert '"op2" [label="op2: ReLU()' in fused
