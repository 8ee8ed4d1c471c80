"""Shared block runs of the test files: one eager fwd+bwd of a grouped MLP block
(``fwd_bwd_step`` on the caller's leaves, CPU or CUDA; ``run_block`` on fresh copies), and the
epilogue-kernel tests' CUDA check (``test_fc1_epilogue.py``, ``test_fc1_epilogue_large.py``):
a scaled-SwiGLU grouped MLP block captured in one CUDA graph
(forward + backward, replayed with new split sizes) and compiled with
``torch.compile(fullgraph=True)`` gives its eager values bit for bit; and the same compile
check for a ``te_ops.MoE`` layer (``assert_layer_compiles_bit_exact``) and its meta-device
forward and backward (``assert_meta_layer_step``)."""

from __future__ import annotations

import torch


def run_block(block, x: torch.Tensor, split: torch.Tensor, probs: torch.Tensor,
              dy: torch.Tensor) -> tuple[list[torch.Tensor], str]:
    """One eager fwd+bwd of ``block(x, split, probs, split)`` (``block(x, split, split)``
    when the activation is a plain SwiGLU, which takes no probs) on fresh leaf copies of
    ``x`` and ``probs``: ``[y, x.grad, probs.grad, *parameter grads]`` (``probs.grad`` is
    ``None`` without probs) and the output's grad_fn class name (which path ran); the grads
    are cleared."""
    import te_ops

    x = x.detach().clone().requires_grad_(True)
    probs = probs.detach().clone().requires_grad_(True)
    scaled = isinstance(block[1], te_ops.ScaledSwiGLU)
    y = block(x, split, probs, split) if scaled else block(x, split, split)
    y.backward(dy)
    out = [y.detach().clone(), x.grad.clone(), probs.grad.clone() if scaled else None,
           *[p.grad.clone() for p in block.parameters()]]
    block.zero_grad(set_to_none=True)
    return out, type(y.grad_fn).__name__


def block_args(block, x: torch.Tensor, probs: torch.Tensor, split: torch.Tensor) -> tuple:
    """The call's arguments: ``(x, split, probs, split)`` for a ScaledSwiGLU block,
    ``(x, split, split)`` for a plain SwiGLU one (which takes no probs)."""
    import te_ops

    return (x, split, probs, split) if isinstance(block[1], te_ops.ScaledSwiGLU) else (
        x, split, split)


def fwd_bwd_step(block, x: torch.Tensor, probs: torch.Tensor, split: torch.Tensor,
                 dy: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, list[torch.Tensor | None], str]:
    """One fwd+bwd of ``block`` on the caller's leaves ``x`` and ``probs`` (their ``.grad`` and
    the parameters' are cleared first), with output gradient ``dy`` (ones by default): the
    detached output, clones of the gradients of ``x``, ``probs`` and every parameter (None
    where there is none), and the output's grad_fn class name."""
    for t in (x, probs, *block.parameters()):
        t.grad = None
    out = block(*block_args(block, x, probs, split))
    node = type(out.grad_fn).__name__
    out.backward(torch.ones_like(out) if dy is None else dy)
    grads = [t.grad for t in (x, probs, *block.parameters())]
    return out.detach(), [None if g is None else g.clone() for g in grads], node


def run_block_params_first(block, x: torch.Tensor, split: torch.Tensor, probs: torch.Tensor,
                           dy: torch.Tensor) -> tuple[list[torch.Tensor], str]:
    """:func:`run_block` in the epilogue tests' order: ``[y, x.grad, *parameter grads]``
    then ``probs.grad`` when the block takes probs."""
    (y, gx, gp, *grads), name = run_block(block, x, split, probs, dy)
    return [y, gx, *grads, *([] if gp is None else [gp])], name


def assert_graph_and_compile_match_eager(block, x: torch.Tensor, split: torch.Tensor,
                                         probs: torch.Tensor, dy: torch.Tensor,
                                         new_sizes: list[int], explain: str) -> None:
    """Capture ``block``'s fwd+bwd at ``split`` (a CUDA int tensor, refilled in place),
    check ``explain`` is in ``block.explain()``, replay at ``new_sizes`` and compare with an
    eager run; then compile ``block`` (inductor, fullgraph) and compare at the original and
    the new sizes; one frame, no graph break. Every comparison is ``torch.equal``."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    sizes = split.tolist()
    run_block(block, x, split, probs, dy)  # compile the kernels outside the capture
    xs = x.detach().clone().requires_grad_(True)
    ps = probs.detach().clone().requires_grad_(True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = block(xs, split, ps, split)
        y.backward(dy)
    assert explain in block.explain()
    split.copy_(torch.tensor(new_sizes, device=split.device))
    graph.replay()
    got = [y.detach().clone(), xs.grad.clone(), ps.grad.clone(),
           *[p.grad.clone() for p in block.parameters()]]
    block.zero_grad(set_to_none=True)
    want = run_block(block, x, torch.tensor(new_sizes, device=split.device), probs, dy)[0]
    assert all(torch.equal(a, b) for a, b in zip(got, want)), "graph replay"

    def fn(x, s, p):
        return block(x, s, p, s)

    torch._dynamo.reset()
    counters.clear()
    cnt = CompileCounterWithBackend("inductor")
    compiled = torch.compile(fn, fullgraph=True, backend=cnt)
    with torch._inductor.config.patch(emulate_precision_casts=True):
        for sizes_ in (sizes, new_sizes):
            s = torch.tensor(sizes_, device=split.device)
            xc = x.detach().clone().requires_grad_(True)
            pc = probs.detach().clone().requires_grad_(True)
            yc = compiled(xc, s, pc)
            yc.backward(dy)
            got = [yc.detach(), xc.grad, pc.grad, *[p.grad.clone() for p in block.parameters()]]
            block.zero_grad(set_to_none=True)
            want = run_block(block, x, s, probs, dy)[0]
            assert all(torch.equal(a, b) for a, b in zip(got, want)), sizes_
    assert cnt.frame_count == 1 and not counters["graph_break"]


def assert_block_matches_reference(block, x: torch.Tensor, probs: torch.Tensor,
                                   sizes: list[int], dy: torch.Tensor,
                                   got: list[torch.Tensor]) -> None:
    """``got`` (``run_block``'s ``[y, x.grad, probs.grad, *parameter grads]`` of a
    GroupedLinear - ScaledSwiGLU - GroupedLinear block with ``block``'s weights, no bias)
    against the fp64 per-expert reference (``tests/reference.py``) on the rows the split
    ``sizes`` cover, at the tolerance of ``x``'s dtype; the padding rows of y and x.grad
    must be zero."""
    import reference as ref

    total = sum(sizes)
    y, gx, gp, *grads = got
    assert not y[total:].any() and not gx[total:].any(), "padding rows not zero"
    fc1, _, fc2 = block
    leaves = {"x": ref.leaf(x[:total].clone()), "probs": ref.leaf(probs[:total].clone())}
    w1 = [ref.leaf(p) for p in fc1.parameters()]
    w2 = [ref.leaf(p) for p in fc2.parameters()]
    h = ref.grouped_linear(leaves["x"], w1, None, sizes)
    want = ref.grouped_linear(ref.scaled_swiglu(h, leaves["probs"]), w2, None, sizes)
    ref.assert_close(y[:total], want, x.dtype, "output")
    want.backward(dy[:total].double())
    ref.assert_close(gx[:total], leaves["x"].grad, x.dtype, "x.grad")
    ref.assert_close(gp[:total], leaves["probs"].grad, x.dtype, "probs.grad")
    assert len(grads) == len(w1) + len(w2)
    for i, leaf in enumerate(w1 + w2):
        ref.assert_close(grads[i], leaf.grad, x.dtype, f"weight grad {i}")


def count_launches(monkeypatch, module, name: str = "_launch") -> list[int]:
    """Wrap ``module.<name>`` so every call appends 1 to the returned list (the calls still
    run); for tests that a dispatch rule really reached a kernel's launch."""
    launches: list[int] = []
    launch = getattr(module, name)

    def counted(*args, **kwargs):
        launches.append(1)
        return launch(*args, **kwargs)
    monkeypatch.setattr(module, name, counted)
    return launches


def summarize_record(bench, rec: dict, path, capsys) -> str:
    """Write one benchmark record to ``path`` (JSON lines), run the benchmark's
    ``--summarize`` on it and return what it printed (the records' own echo dropped)."""
    out = bench.JsonLines(str(path))
    out.write(rec)
    out.close()
    capsys.readouterr()
    assert bench.main(["--summarize", str(path)]) == 0
    return capsys.readouterr().out



def assert_layer_compiles_bit_exact(moe, x: torch.Tensor) -> None:
    """``torch.compile(moe, backend="aot_eager", fullgraph=True)``: output, aux loss, input
    and parameter gradients of ``y.square().sum() + aux`` bit for bit the eager ones."""

    def step(fn):
        moe.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        y, aux = fn(xi)
        (y.square().sum() + aux).backward()
        return [y, aux, xi.grad] + [p.grad for p in moe.parameters() if p.requires_grad]

    eager = step(moe)
    torch._dynamo.reset()
    compiled = step(torch.compile(moe, backend="aot_eager", fullgraph=True))
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


def assert_meta_layer_step(moe, x: torch.Tensor) -> None:
    """A ``te_ops.MoE`` forward and backward with every tensor on ``meta`` (any host read of
    a device value raises there): the output, dropped count and gradients come out with
    their shapes, on ``meta``."""
    y, aux, dropped = moe(x, return_dropped=True)
    (y.sum() + aux).backward()
    assert y.shape == x.shape and y.device.type == "meta" and dropped.device.type == "meta"
    assert x.grad is not None and x.grad.device.type == "meta"
    for name, p in moe.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.shape == p.shape, name
