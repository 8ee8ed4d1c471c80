"""Saved tensors die with the backward, not with the autograd graph.

After ``loss.backward()`` (no ``retain_graph``) autograd frees every saved tensor, while the
graph's nodes live on as long as an output is referenced (``y.grad_fn``). A block whose op
contexts kept a reference to a saved tensor outside autograd's saved variables would hold
it, here the intermediate activation between two blocks, until the output is freed: in a
stack of blocks that adds every block's input to the end of backward (rc8 measured 384 MiB of
peak on four E8 blocks on the H200). Checked for every fused / unfused forward x backward
pairing, with and without a bias, probs, a recipe (FP8 current scaling and MXFP8, emulated on
the CPU: quantized copies of the input and the weights are saved) and the fc1 recompute.

A training step also leaves no reference cycle (block and MoE layer): its buffers are freed
by reference counting when the step drops them, not at Python's next cycle collection.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from fusion_env import set_grouped_mlp

import te_ops
from te_ops.quantization import Float8CurrentScaling, MXFP8BlockScaling

PAIRINGS = [(f, b) for f in (False, True) for b in (False, True)]
RECIPES = {"none": None, "fp8": Float8CurrentScaling, "mxfp8": MXFP8BlockScaling}


def _block(bias: bool, recompute: bool) -> te_ops.Sequential:
    return te_ops.Sequential(
        te_ops.GroupedLinear(4, 32, 64, bias=bias),
        te_ops.ScaledSwiGLU(recompute_input=recompute),
        te_ops.GroupedLinear(4, 32, 32, bias=bias),
    )


def _intermediate_alive(monkeypatch: pytest.MonkeyPatch, fwd: bool, bwd: bool, bias: bool,
                        recipe: str, recompute: bool) -> bool:
    """Two blocks; after backward with the output still held, is the tensor between them
    alive?"""
    torch.manual_seed(0)
    blocks = [_block(bias, recompute), _block(bias, recompute)]
    splits = torch.tensor([10, 0, 14, 8])
    probs = torch.rand(32, requires_grad=True)
    x = torch.randn(32, 32, requires_grad=True)
    rec = RECIPES[recipe]
    set_grouped_mlp(monkeypatch, fwd, bwd)
    with te_ops.autocast(enabled=rec is not None, recipe=rec() if rec else None):
        mid = blocks[0](x, splits, probs, splits)
        ref = weakref.ref(mid)
        y = blocks[1](mid, splits, probs, splits)
        del mid
        y.sum().backward()
    gc.collect()
    alive = ref() is not None
    assert y.grad_fn is not None and x.grad is not None  # the graph is still referenced
    return alive


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("fwd,bwd", PAIRINGS)
def test_intermediate_freed_after_backward(monkeypatch, fwd, bwd, bias, recipe):
    assert not _intermediate_alive(monkeypatch, fwd, bwd, bias, recipe, recompute=False)


@pytest.mark.filterwarnings("ignore:ScaledSwiGLU\\(recompute_input=True\\)")
@pytest.mark.parametrize("fwd,bwd", PAIRINGS)
def test_intermediate_freed_with_fc1_recompute(monkeypatch, fwd, bwd):
    assert not _intermediate_alive(monkeypatch, fwd, bwd, False, "none", recompute=True)


def _tensors_held(root: object) -> list[torch.Tensor]:
    """Tensors reachable from ``root`` through Python containers and objects' attributes
    (not through tensors or modules)."""
    seen, found, todo = set(), [], [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (torch.nn.Module, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            continue
        if isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            todo.extend(obj)
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("te_ops"):
            todo.extend(vars(obj).values())
    return found


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("fwd,bwd", PAIRINGS)
def test_node_holds_no_saved_tensor_after_backward(monkeypatch, fwd, bwd, recipe):
    """The op contexts of a backward-run node reference no activation or quantized copy (the
    weights' own storage, e.g. a stacked view of them, may stay)."""
    set_grouped_mlp(monkeypatch, fwd, bwd)
    torch.manual_seed(0)
    block = _block(True, False)
    splits = torch.tensor([10, 0, 14, 8])
    probs = torch.rand(32, requires_grad=True)
    x = torch.randn(32, 32, requires_grad=True)
    rec = RECIPES[recipe]
    with te_ops.autocast(enabled=rec is not None, recipe=rec() if rec else None):
        y = block(x, splits, probs, splits)
        y.sum().backward()
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    held = [t for t in _tensors_held(y.grad_fn.op_ctxs)
            if t.untyped_storage().data_ptr() not in params and t.numel() > 0]
    assert held == [], [(tuple(t.shape), t.dtype) for t in held]


def _cyclic_garbage_of_one_step(step) -> list[str]:
    """The types of the objects that only the cycle collector could free after ``step``
    (a reference cycle keeps a step's buffers alive until the next collection)."""
    step()
    step()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        step()
        gc.collect()
        return sorted({type(o).__name__ for o in gc.garbage})
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        gc.enable()


@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "fused"])
def test_a_block_step_leaves_no_reference_cycles(monkeypatch, fuse):
    set_grouped_mlp(monkeypatch, fuse, fuse)
    torch.manual_seed(0)
    block = _block(bias=False, recompute=False)
    x = torch.randn(40, 32, requires_grad=True)
    splits = torch.tensor([10, 0, 25, 5])
    probs = torch.rand(40, requires_grad=True)

    def step():
        block(x, splits, probs, splits).sum().backward()

    assert _cyclic_garbage_of_one_step(step) == []


@pytest.mark.parametrize("kw", [{}, {"capacity_factor": 1.0, "shared_ffn_hidden_size": 8}],
                         ids=["dropless", "capacity_shared"])
def test_a_moe_layer_step_leaves_no_reference_cycles(kw):
    torch.manual_seed(0)
    moe = te_ops.MoE(32, 16, 8, 2, aux_loss_coeff=0.01, **kw)
    x = torch.randn(64, 32, requires_grad=True)

    def step():
        y, aux = moe(x)
        (y.sum() + aux).backward()

    assert _cyclic_garbage_of_one_step(step) == []
