"""Training-framework integration: Megatron main_grad, delayed wgrad, checkpointing, DDP/FSDP2.

Every gradient is compared with the independent float64 per-expert loop of ``reference.py``
(plain ``.grad``), and fused with unfused paths bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import reference as ref
import torch
from torch.utils.checkpoint import checkpoint

import te_ops

E, H, F = 4, 16, 24
SIZES = [5, 0, 7, 6]  # 18 of 20 rows: a zero-token expert and two padding rows
ROWS = 20
FUSION_COMBOS = {  # (forward fused, backward fused) -> env
    "fwd1_bwd1": {},
    "fwd0_bwd0": {"TE_OPS_FUSION": "0"},
    "fwd1_bwd0": {"TE_OPS_FUSION_OFF": "grouped_mlp_backward"},
    "fwd0_bwd1": {"TE_OPS_FUSION_OFF": "grouped_mlp_forward"},
}


def make_block(*, single: bool = False, bias: bool = True, dtype=torch.float32, seed: int = 0,
               **kw) -> te_ops.Sequential:
    torch.manual_seed(seed)
    opts = {"bias": bias, "single_grouped_weight": single, "dtype": dtype, **kw}
    return te_ops.Sequential(te_ops.GroupedLinear(E, H, 2 * F, **opts), te_ops.ScaledSwiGLU(),
                             te_ops.GroupedLinear(E, F, H, **opts))


def attach_main_grads(block: torch.nn.Module, fill: float | None = None) -> dict:
    """Megatron-style fp32 main_grad on every parameter: one contiguous buffer, each parameter
    a slice of it (reverse order, as Megatron's buffer lays them out)."""
    params = list(block.parameters())
    buffer = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32,
                         device=params[0].device)
    if fill is not None:
        buffer.normal_()
    pos, out = 0, {}
    for name, p in reversed(list(block.named_parameters())):
        p.main_grad = buffer[pos:pos + p.numel()].view(p.shape)
        p.grad_added_to_main_grad = False
        out[name] = p.main_grad
        pos += p.numel()
    return out


def batch(seed: int, dtype=torch.float32, sizes=SIZES, kind: str = "tensor"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, H, generator=gen).to(dtype)
    probs = torch.rand(ROWS, generator=gen)
    dy = torch.randn(ROWS, H, generator=gen).to(dtype)
    return x, ref.split_arg(sizes, kind, "cpu"), probs, dy


def run(block, x, split, probs, dy):
    x = x.clone().requires_grad_()
    probs = probs.clone().requires_grad_()
    block(x, split, probs, split).backward(dy)
    return x.grad, probs.grad


def group_params(block, i: int, kind: str) -> list[torch.Tensor]:
    op = block[i]
    params = op.weights() if kind == "weight" else op.biases()
    return list(params[0].unbind(0)) if op.single_grouped_weight else params


def _per_group(leaves: dict, op: int, kind: str) -> list[torch.Tensor] | None:
    names = [f"{op}.{kind}{g}" for g in range(E)]
    return [leaves[n] for n in names if n in leaves] or None


def reference_grads(block, batches) -> dict[str, torch.Tensor]:
    """float64 gradients of every parameter, summed over ``batches``, named as
    ``block.named_parameters()``."""
    total: dict[str, torch.Tensor] = {}
    for x, split, probs, dy in batches:
        leaves = {f"{i}.{k}{g}": ref.leaf(t) for i in (0, 2) for k in ("weight", "bias")
                  for g, t in enumerate(group_params(block, i, k))}

        def fn(lv, x=x, split=split, probs=probs):
            return ref.grouped_mlp(ref.leaf(x), split, ref.leaf(probs),
                                   *(_per_group(lv, op, kind) for op in (0, 2)
                                     for kind in ("weight", "bias")))

        _, grads = ref.forward_backward(fn, leaves, dy)
        for k, g in grads.items():
            total[k] = total.get(k, 0) + g
    out = {}
    for name, _ in block.named_parameters():
        if block[int(name.split(".")[0])].single_grouped_weight:
            i, k = name.split(".")
            out[name] = torch.stack([total[f"{i}.{k}{g}"] for g in range(E)])
        else:
            out[name] = total[name]
    return out


def set_env(monkeypatch, combo: str) -> None:
    for k, v in FUSION_COMBOS[combo].items():
        monkeypatch.setenv(k, v)


# --------------------------------------------------------------------------------- main_grad
@pytest.mark.parametrize("combo", list(FUSION_COMBOS))
@pytest.mark.parametrize("single", [False, True], ids=["per_expert", "single_weight"])
def test_main_grad_accumulates_three_micro_batches(monkeypatch, combo, single):
    set_env(monkeypatch, combo)
    block = make_block(single=single, accumulate_into_main_grad=True)
    main_grads = attach_main_grads(block)
    batches = [batch(s) for s in range(3)]
    for b in batches:
        run(block, *b)
    want = reference_grads(block, batches)
    for name, p in block.named_parameters():
        if "weight" in name:
            ref.assert_close(main_grads[name], want[name], torch.float32, f"{name}.main_grad")
            assert p.grad is None, f"{name}.grad must stay None with main_grad"
            assert p.grad_added_to_main_grad is True
        else:  # biases keep the .grad path
            ref.assert_close(p.grad, want[name], torch.float32, f"{name}.grad")
            assert not main_grads[name].any()


def test_main_grad_fused_and_unfused_bitwise(monkeypatch):
    results = []
    for combo in FUSION_COMBOS:
        with monkeypatch.context() as m:
            set_env(m, combo)
            block = make_block(accumulate_into_main_grad=True)
            main_grads = attach_main_grads(block)
            dx, dprobs = run(block, *batch(0))
            results.append((combo, dx, dprobs, main_grads))
    _, dx0, dp0, mg0 = results[0]
    for combo, dx, dp, mg in results[1:]:
        assert torch.equal(dx, dx0) and torch.equal(dp, dp0), combo
        for name in mg0:
            assert torch.equal(mg[name], mg0[name]), f"{combo}: {name}.main_grad"


def test_main_grad_bf16_weights_fp32_buffer():
    block = make_block(dtype=torch.bfloat16, accumulate_into_main_grad=True)
    main_grads = attach_main_grads(block)
    batches = [batch(s, torch.bfloat16) for s in range(2)]
    for b in batches:
        run(block, *b)
    want = reference_grads(block, batches)
    for name in ("0.weight0", "0.weight3", "2.weight2"):
        assert main_grads[name].dtype == torch.float32
        ref.assert_close(main_grads[name], want[name], torch.bfloat16, name)


@pytest.mark.parametrize("backend", ["grouped_mm", "loop"])
@pytest.mark.parametrize("single", [False, True], ids=["per_expert", "single_weight"])
def test_overwrite_and_zero_token_expert(monkeypatch, use_backend, backend, single):
    use_backend(backend, "cpu", torch.float32, (H, 2 * F), (F, H))
    block = make_block(single=single, accumulate_into_main_grad=True)
    main_grads = attach_main_grads(block, fill=1.0)
    before = {k: v.clone() for k, v in main_grads.items()}
    b = batch(3)
    run(block, *b)
    want = reference_grads(block, [b])
    for i in (0, 2):  # expert 1 has no tokens: its main_grad is exactly unchanged
        w = block[i].weights()[0]
        got = w.main_grad[1] if single else block[i].weight1.main_grad
        prev = before[f"{i}.weight"][1] if single else before[f"{i}.weight1"]
        assert torch.equal(got, prev), f"op {i}: zero-token expert's main_grad changed"
        name = f"{i}.weight" if single else f"{i}.weight0"
        ref.assert_close(main_grads[name] - before[name], want[name], torch.float32, name)
    # overwrite_main_grad: the buffer holds this micro-batch's gradient only
    for p in block.parameters():
        p.overwrite_main_grad = True
    run(block, *b)
    for name in main_grads:
        if "weight" in name:
            ref.assert_close(main_grads[name], want[name], torch.float32, f"{name} overwritten")


@pytest.mark.parametrize("backend", ["grouped_mm", "loop"])
def test_non_contiguous_main_grad_works(use_backend, backend):
    use_backend(backend, "cpu", torch.float32, (H, 2 * F), (F, H))
    block = make_block(accumulate_into_main_grad=True)
    for p in block.parameters():  # every other column of a wider buffer: strided views
        wide = torch.zeros(*p.shape[:-1], 2 * p.shape[-1]) if p.dim() == 2 else None
        p.main_grad = wide[:, ::2] if wide is not None else torch.zeros(p.shape)
        assert p.dim() == 1 or not p.main_grad.is_contiguous()
    b = batch(4)
    run(block, *b)
    want = reference_grads(block, [b])
    for name, p in block.named_parameters():
        if "weight" in name:
            ref.assert_close(p.main_grad, want[name], torch.float32, name)


def test_main_grad_errors_name_the_parameter():
    block = make_block(single=True, accumulate_into_main_grad=True)
    attach_main_grads(block)
    w = block[2].weight
    # (E, F, H) transposed: the right number of elements, but no view as (E, H, F) exists
    w.main_grad = torch.zeros(E, H, F).transpose(1, 2)
    with pytest.raises(ValueError, match=r"weight\.main_grad of shape \(4, 24, 16\) and "
                                         r"strides \(384, 1, 24\) cannot be viewed as "
                                         r"weight's shape \(4, 16, 24\)"):
        run(block, *batch(0))
    w.main_grad = torch.zeros(3)
    with pytest.raises(ValueError, match=r"weight\.main_grad must have shape \(4, 16, 24\)"):
        run(block, *batch(0))
    del w.main_grad
    with pytest.raises(AttributeError, match=r"GroupedLinear\(groups=4, 24->16, "
                                             r"main_grad\): accumulate_into_main_grad=True "
                                             r"needs weight\.main_grad"):
        run(block, *batch(0))
    per_expert = make_block(accumulate_into_main_grad=True)
    attach_main_grads(per_expert)
    per_expert[0].weight2.main_grad = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(TypeError, match=r"weight2\.main_grad must be a floating-point"):
        run(per_expert, *batch(0))


def test_main_grad_keeps_megatron_hooks_firing():
    """autograd gets None for the weights, yet the AccumulateGrad hooks Megatron registers
    (and post-accumulate hooks) still run, and grad_added_to_main_grad is set."""
    block = make_block(accumulate_into_main_grad=True)
    attach_main_grads(block)
    fired: list[str] = []
    keep = []
    for name, p in block.named_parameters():
        acc = p.expand_as(p).grad_fn.next_functions[0][0]
        acc.register_hook(lambda *_, name=name: fired.append(name))
        keep.append(acc)
    run(block, *batch(0))
    assert sorted(fired) == sorted(n for n, _ in block.named_parameters())
    assert [n for n, p in block.named_parameters() if "weight" in n and p.grad is not None] == []


def test_frozen_expert_gets_no_main_grad():
    block = make_block(accumulate_into_main_grad=True)
    main_grads = attach_main_grads(block)
    block[0].weight2.requires_grad_(False)
    del block[0].weight2.main_grad  # frozen: not read at all
    b = batch(5)
    run(block, *b)
    want = reference_grads(block, [b])
    ref.assert_close(main_grads["0.weight0"], want["0.weight0"], torch.float32, "weight0")
    assert not main_grads["0.weight2"].any()


def test_main_grad_meta_device_reads_no_device_value(monkeypatch):
    """The graph-safety proof of docs/graph_safety.md with main_grad on: all on ``meta``."""
    for fusion in ("0", "1"):
        monkeypatch.setenv("TE_OPS_FUSION", fusion)
        block = make_block(dtype=torch.bfloat16, accumulate_into_main_grad=True).to("meta")
        for p in block.parameters():
            p.main_grad = torch.empty(p.shape, device="meta", dtype=torch.float32)
        x = torch.empty(ROWS, H, device="meta", dtype=torch.bfloat16, requires_grad=True)
        split = torch.empty(E, device="meta", dtype=torch.int64)
        probs = torch.empty(ROWS, device="meta", requires_grad=True)
        block(x, split, probs, split).sum().backward()
        assert x.grad.shape == x.shape
        assert all(p.grad_added_to_main_grad for n, p in block.named_parameters()
                   if "weight" in n)


# --------------------------------------------------------------------------- delayed wgrad
@pytest.mark.parametrize("combo", list(FUSION_COMBOS))
@pytest.mark.parametrize("main_grad", [False, True], ids=["grad", "main_grad"])
def test_delayed_wgrad_matches_reference(monkeypatch, combo, main_grad):
    set_env(monkeypatch, combo)
    block = make_block(delay_wgrad_compute=True, accumulate_into_main_grad=main_grad)
    twin = make_block()  # same weights, ordinary backward
    main_grads = attach_main_grads(block) if main_grad else {}
    batches = [batch(s) for s in range(2)]
    for b in batches:
        dx, dprobs = run(block, *b)
        want_dx, want_dprobs = run(twin, *b)
        assert torch.equal(dx, want_dx) and torch.equal(dprobs, want_dprobs)
    assert all(p.grad is None for p in block.parameters()), "backward must not write grads"
    block.backward_dw()
    want = reference_grads(block, batches)
    for name, p in block.named_parameters():
        got = main_grads[name] if main_grad and "weight" in name else p.grad
        ref.assert_close(got, want[name], torch.float32, name)
        assert torch.allclose(got, twin.get_parameter(name).grad, rtol=1e-6, atol=1e-6)
    block.backward_dw()  # nothing queued: no change
    for name, p in block.named_parameters():
        got = main_grads[name] if main_grad and "weight" in name else p.grad
        ref.assert_close(got, want[name], torch.float32, f"{name} after a second backward_dw")


@pytest.mark.parametrize("delay", [False, True], ids=["immediate", "delayed"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("main_grad", [False, True], ids=["grad", "main_grad"])
def test_tied_weights_accumulate_both_contributions(delay, bias, main_grad):
    """Two GroupedLinear ops share their weights (and biases): both contributions add up."""
    torch.manual_seed(0)
    kw = {"bias": bias, "delay_wgrad_compute": delay, "accumulate_into_main_grad": main_grad}
    fc_a = te_ops.GroupedLinear(E, H, H, single_grouped_weight=False, **kw)
    fc_b = te_ops.GroupedLinear(E, H, H, single_grouped_weight=False, **kw)
    for g in range(E):
        fc_b.register_parameter(f"weight{g}", fc_a.get_parameter(f"weight{g}"))
        if bias:
            fc_b.register_parameter(f"bias{g}", fc_a.get_parameter(f"bias{g}"))
    block = te_ops.Sequential(fc_a, fc_b)
    if main_grad:
        attach_main_grads(fc_a)
    x, split, _, dy = batch(6)
    dx, _ = run_two(block, x, split, dy)
    if delay:
        assert fc_a.weight0.grad is None
        block.backward_dw()
    ws = [ref.leaf(w) for w in fc_a.weights()]
    bs = [ref.leaf(b) for b in fc_a.biases()] or None
    xr = ref.leaf(x)
    out = ref.grouped_linear(ref.grouped_linear(xr, ws, bs, split), ws, bs, split)
    out.backward(dy.double())
    for g in range(E):
        w = fc_a.get_parameter(f"weight{g}")
        ref.assert_close(w.main_grad if main_grad else w.grad, ws[g].grad, torch.float32,
                         f"weight{g}")
        if bias:
            ref.assert_close(fc_a.get_parameter(f"bias{g}").grad, bs[g].grad, torch.float32,
                             f"bias{g}")
    ref.assert_close(dx, xr.grad, torch.float32, "x.grad")


def run_two(block, x, split, dy):
    x = x.clone().requires_grad_()
    block(x, split, split).backward(dy)
    return x.grad, None


def test_sequential_backward_dw_runs_each_op_once():
    fc = te_ops.GroupedLinear(E, H, H, delay_wgrad_compute=True)
    block = te_ops.Sequential(fc, fc)  # a repeated op: two fusers, one queue with two jobs
    fc_twin = te_ops.GroupedLinear(E, H, H)
    fc_twin.load_state_dict(fc.state_dict())
    twin = te_ops.Sequential(fc_twin, fc_twin)
    x, split, _, dy = batch(7)
    run_two(block, x, split, dy)
    assert len(fc.wgrad_policy().pending) == 2
    block.backward_dw()
    assert not fc.wgrad_policy().pending
    run_two(twin, x, split, dy)
    for name, p in fc.named_parameters():
        torch.testing.assert_close(p.grad, fc_twin.get_parameter(name).grad)


# ---------------------------------------------------------------- activation checkpointing
@pytest.mark.parametrize("combo", ["fwd1_bwd1", "fwd0_bwd0"])
@pytest.mark.parametrize("kind", ["list", "tensor"])
def test_checkpoint_gives_the_same_grads(monkeypatch, combo, kind):
    set_env(monkeypatch, combo)
    plain, ckpt = make_block(), make_block()
    x, split, probs, dy = batch(8, kind=kind)
    want = run(plain, x, split, probs, dy)
    xc, pc = x.clone().requires_grad_(), probs.clone().requires_grad_()
    y = checkpoint(ckpt, xc, split, pc, split, use_reentrant=False)
    y.backward(dy)
    assert torch.equal(xc.grad, want[0]) and torch.equal(pc.grad, want[1])
    for (name, p), q in zip(ckpt.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_checkpoint_with_main_grad_and_delayed_wgrad():
    block = make_block(accumulate_into_main_grad=True, delay_wgrad_compute=True)
    twin = make_block(accumulate_into_main_grad=True)
    mg, mg_twin = attach_main_grads(block), attach_main_grads(twin)
    x, split, probs, dy = batch(9)
    run(twin, x, split, probs, dy)
    xc, pc = x.clone().requires_grad_(), probs.clone().requires_grad_()
    checkpoint(block, xc, split, pc, split, use_reentrant=False).backward(dy)
    block.backward_dw()
    for name in mg:
        assert torch.equal(mg[name], mg_twin[name]), name


# ------------------------------------------------------------------------- DDP and FSDP2
def test_ddp_and_fsdp2_match_one_process_gloo():
    """2 processes on gloo: DDP and FSDP2 (fully_shard) grads and SGD updates equal one
    process's on the concatenated batch (tests/dist_check.py)."""
    script = Path(__file__).with_name("dist_check.py")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
           "OMP_NUM_THREADS": "1"}
    env = {k: v for k, v in env.items() if not k.startswith("TE_OPS_")}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--standalone", str(script), "--backend", "gloo"],
        capture_output=True, text=True, env=env, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("dist_check OK") == 2, proc.stdout


# ------------------------------------------------------------------------------ CUDA graphs
def test_capture_helper_with_main_grad_emulated(monkeypatch):
    """make_graphed_callable's plumbing with main_grad, on the CPU (torch's graph machinery
    replaced by the eager emulation of test_graph_safety): weights get no autograd gradient
    (allow_unused_input), warm-up runs leave main_grad as it was, replays add into it."""
    from test_graph_safety import _emulated_make_graphed_callables

    import te_ops.graphs as graphs

    monkeypatch.setattr(graphs, "_check_sample_inputs", lambda s: tuple(s))
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", _emulated_make_graphed_callables)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    block = make_block(accumulate_into_main_grad=True)
    twin = make_block(accumulate_into_main_grad=True)
    mg, mg_twin = attach_main_grads(block, fill=1.0), attach_main_grads(twin)
    for k in mg:
        mg_twin[k].copy_(mg[k])
    before = {k: v.clone() for k, v in mg.items()}
    x, split, probs, _ = batch(0)
    graphed = graphs.make_graphed_callable(
        block, (x.requires_grad_(), split, probs.requires_grad_(), split), check_sync=False)
    for k in mg:
        assert torch.equal(mg[k], before[k]), f"capture changed {k}.main_grad"
    for seed in (1, 2):
        b = batch(seed)
        run(graphed, *b)
        run(twin, *b)
    for k in mg:
        assert torch.equal(mg[k], mg_twin[k]), k
    assert [n for n, p in block.named_parameters() if "weight" in n and p.grad is not None] == []


@pytest.mark.cuda
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per_expert"])
@pytest.mark.parametrize("fusion", ["0", "1"])
def test_cuda_graph_capture_with_main_grad(monkeypatch, fusion, packed):
    """Capture fwd+bwd with main_grad on; replays add into main_grad exactly as eager runs do,
    capture leaves main_grad as it was, and a zero-token expert's main_grad is untouched."""
    from te_ops.graphs import graph_safe_unsupported_reason, make_graphed_callable

    monkeypatch.setenv("TE_OPS_FUSION", fusion)
    dev, dtype, e, h, f, t = torch.device("cuda"), torch.bfloat16, 4, 64, 128, 256

    def block_on_gpu() -> te_ops.Sequential:
        torch.manual_seed(0)
        kw = {"device": dev, "dtype": dtype, "accumulate_into_main_grad": True,
              "single_grouped_weight": packed}
        return te_ops.Sequential(te_ops.GroupedLinear(e, h, 2 * f, **kw), te_ops.ScaledSwiGLU(),
                                 te_ops.GroupedLinear(e, f, h, **kw))

    def expert(grads: dict, i: int, g: int) -> torch.Tensor:
        """Layer ``i``'s expert-``g`` weight main_grad in either layout."""
        return grads[f"{i}.weight"][g] if packed else grads[f"{i}.weight{g}"]

    block, twin = block_on_gpu(), block_on_gpu()
    mg, mg_twin = attach_main_grads(block, fill=1.0), attach_main_grads(twin)
    for k in mg:
        mg_twin[k].copy_(mg[k])
    before = {k: v.clone() for k, v in mg.items()}

    def inputs(sizes, seed):
        gen = torch.Generator(device=dev).manual_seed(seed)
        x = torch.randn(t, h, generator=gen, device=dev).to(dtype)
        probs = torch.rand(t, generator=gen, device=dev)
        dy = torch.randn(t, h, generator=gen, device=dev).to(dtype)
        return x, torch.tensor(sizes, device=dev), probs, dy

    x, split, probs, _ = inputs([64] * e, 0)
    reason = graph_safe_unsupported_reason(block, x, split, probs, split)
    if reason is not None:
        pytest.skip(f"not graph-safe here: {reason}")
    graphed = make_graphed_callable(block, (x.requires_grad_(), split,
                                            probs.requires_grad_(), split))
    for k in mg:
        assert torch.equal(mg[k], before[k]), f"capture changed {k}.main_grad"
    routings = [[100, 0, 56, 90], [0, 256, 0, 0], [10, 0, 20, 30]]  # expert 1: zero tokens twice
    for seed, sizes in enumerate(routings):
        x, split, probs, dy = inputs(sizes, seed + 1)
        for fn in (graphed, twin):
            xg, pg = x.clone().requires_grad_(), probs.clone().requires_grad_()
            fn(xg, split, pg, split).backward(dy)
    torch.cuda.synchronize()
    for k in mg:
        assert torch.equal(mg[k], mg_twin[k]), f"{k}.main_grad: graph replay != eager"
    for name, p in block.named_parameters():
        if "weight" in name:
            assert p.grad is None, name
    for i in (0, 2):
        # expert 1 got tokens only in the second routing: compare the other two experts' sums
        assert not torch.equal(expert(mg, i, 1), expert(before, i, 1))
    x, split, probs, dy = inputs([100, 0, 56, 90], 9)
    snap = {k: v.clone() for k, v in mg.items()}
    graphed(x.clone().requires_grad_(), split, probs.clone().requires_grad_(), split).backward(dy)
    torch.cuda.synchronize()
    for i in (0, 2):
        assert torch.equal(expert(mg, i, 1), expert(snap, i, 1)), "zero-token expert changed"
        assert not torch.equal(expert(mg, i, 0), expert(snap, i, 0))


# ----------------------------------------------------------------- the GEMM into main_grad
@pytest.mark.parametrize("layout", ["adjacent", "reversed", "scattered", "strided"])
@pytest.mark.parametrize("backend", ["grouped_mm", "loop"])
def test_grouped_wgrad_into_layouts(use_backend, backend, layout):
    """``grouped_wgrad_into`` against per-expert ``dy_g^T @ x_g`` in float64, for target
    buffers laid out as one stacked tensor, in reverse order (Megatron), apart, or strided."""
    from te_ops.gemm import select_backend
    from te_ops.gemm.wgrad_into import grouped_wgrad_into
    from te_ops.splits import make_splits

    use_backend(backend, "cpu", torch.float32, (H, F))
    n, k = F, H
    x, dy = torch.randn(ROWS, k), torch.randn(ROWS, n)
    split = torch.tensor(SIZES)
    splits = make_splits(split, E, ROWS, x.device)
    choice = select_backend(x.device, x.dtype, k, n, device_split_sizes=True)
    buf = torch.randn(2 * E, n, k)
    if layout == "adjacent":
        targets = list(buf[:E].unbind(0))
    elif layout == "reversed":
        targets = list(buf[:E].unbind(0))[::-1]
    elif layout == "scattered":
        targets = list(buf[::2].unbind(0))
    else:
        targets = list(torch.randn(E, n, 2 * k)[:, :, ::2].unbind(0))
    before = [t.clone() for t in targets]
    grouped_wgrad_into(targets, x, dy, splits, choice, [True] * E)
    start = 0
    for g, m in enumerate(SIZES):
        want = dy[start:start + m].double().t() @ x[start:start + m].double()
        ref.assert_close(targets[g] - before[g], want, torch.float32, f"{layout} group {g}")
        start += m
    assert torch.equal(targets[1], before[1]), "zero-token group changed"


@pytest.mark.parametrize("change", ["shape", "dtype"])
def test_grouped_wgrad_into_refuses_a_re_viewed_middle_target(use_backend, change):
    """Adjacent targets but one re-viewed at its address (another shape, or another dtype
    of the same size): no stacked write through target 0's layout; each target is written
    alone, so the shape mismatch raises and a bf16 target gets its own values."""
    from te_ops.gemm import select_backend
    from te_ops.gemm.wgrad_into import grouped_wgrad_into
    from te_ops.splits import make_splits

    use_backend("grouped_mm", "cpu", torch.float32, (H, F))
    n, k = F, H
    x, dy = torch.randn(ROWS, k), torch.randn(ROWS, n)
    splits = make_splits(torch.tensor(SIZES), E, ROWS, x.device)
    choice = select_backend(x.device, x.dtype, k, n, device_split_sizes=True)
    dtype = torch.float16 if change == "dtype" else torch.float32
    targets = list(torch.zeros(E, n, k, dtype=dtype).unbind(0))
    targets[2] = targets[2].view(k, n) if change == "shape" else targets[2].view(torch.bfloat16)
    if change == "shape":
        with pytest.raises(RuntimeError, match="size"):
            grouped_wgrad_into(targets, x, dy, splits, choice, [True] * E)
        return
    grouped_wgrad_into(targets, x, dy, splits, choice, [True] * E)
    start = sum(SIZES[:2])
    want = dy[start:start + SIZES[2]].double().t() @ x[start:start + SIZES[2]].double()
    ref.assert_close(targets[2], want, torch.bfloat16, "re-viewed bf16 target")


def test_block_output_is_not_a_view():
    """FSDP2 warns about view outputs (an in-place op on one skips its pre-backward hook)."""
    x, split, probs, _ = batch(0)
    for block in (make_block(), te_ops.Sequential(te_ops.Identity())):
        extra = (split, probs, split) if len(block) == 3 else ()
        y = block(x.clone().requires_grad_(), *extra)
        assert y._base is None and not y._is_view()


def test_megatron_fsdp_get_main_grad_is_used():
    """Megatron-FSDP parameters carry ``__fsdp_param__`` and allocate main_grad on demand."""
    block = make_block(accumulate_into_main_grad=True)
    buffers = {}
    for name, p in block.named_parameters():
        buffers[name] = torch.zeros(p.numel())  # flat: viewed as the weight's shape
        p.__fsdp_param__ = True
        p.get_main_grad = lambda name=name: buffers[name]
    b = batch(10)
    run(block, *b)
    want = reference_grads(block, [b])
    for name in ("0.weight0", "2.weight3"):
        ref.assert_close(buffers[name].view(want[name].shape), want[name], torch.float32, name)


def test_graph_gate_refuses_delayed_wgrad():
    from te_ops.graphs import graph_safe_unsupported_reason

    block = make_block(delay_wgrad_compute=True)
    x, split, probs, _ = batch(0)
    reason = graph_safe_unsupported_reason(block, x, split, probs, split)
    assert reason is not None and "delay_wgrad_compute=True" in reason and reason.startswith("op 0")
    assert graph_safe_unsupported_reason(make_block(accumulate_into_main_grad=True),
                                         x, split, probs, split) is None


@pytest.mark.parametrize("single", [False, True], ids=["per_expert", "single_weight"])
def test_delayed_wgrad_scale_bias_and_main_grad(single):
    """scale_bias: the probs gradient comes in backward, the bias gradient (weighted by probs)
    and the weight gradient (into main_grad) in backward_dw."""
    torch.manual_seed(0)
    fc = te_ops.GroupedLinear(E, H, F, scale_bias=True, single_grouped_weight=single,
                              delay_wgrad_compute=True, accumulate_into_main_grad=True)
    attach_main_grads(fc)
    x, split, probs, _ = batch(11)
    dy = torch.randn(ROWS, F)
    xl, pl = x.clone().requires_grad_(), probs.clone().requires_grad_()
    fc(xl, split, pl).backward(dy)
    assert pl.grad is not None and all(p.grad is None for p in fc.parameters())
    fc.backward_dw()
    ws = [ref.leaf(w) for w in (fc.weight.unbind(0) if single else fc.weights())]
    bs = [ref.leaf(b) for b in (fc.bias.unbind(0) if single else fc.biases())]
    xr, pr = ref.leaf(x), ref.leaf(probs)
    ref.grouped_linear(xr, ws, bs, split, pr).backward(dy.double())
    got_w = list(fc.weight.main_grad) if single else [w.main_grad for w in fc.weights()]
    got_b = list(fc.bias.grad) if single else [b.grad for b in fc.biases()]
    for g in range(E):
        ref.assert_close(got_w[g], ws[g].grad, torch.float32, f"weight {g}")
        ref.assert_close(got_b[g], bs[g].grad, torch.float32, f"bias {g}")
    ref.assert_close(pl.grad, pr.grad, torch.float32, "probs")
    ref.assert_close(xl.grad, xr.grad, torch.float32, "x")


@pytest.mark.parametrize("recipe_name", ["fp8", "mxfp8"])
@pytest.mark.parametrize("mode", ["main_grad", "delayed", "delayed_main_grad"])
def test_training_paths_under_a_recipe_match_plain_grads(recipe_name, mode):
    """Under ``te_ops.autocast`` the main_grad and delayed wgrad paths run the recipe's wgrad
    GEMM (quantized dy and saved quantized x), so they equal the plain ``.grad`` path under the
    same recipe (which is checked against a dequantized reference in test_quantization.py); a
    main_grad path that silently used the high-precision input would differ."""
    recipe = {"fp8": te_ops.recipe.Float8CurrentScaling(),
              "mxfp8": te_ops.recipe.MXFP8BlockScaling()}[recipe_name]
    opts = {"accumulate_into_main_grad": "main_grad" in mode,
            "delay_wgrad_compute": "delayed" in mode}
    block, twin = make_block(**opts), make_block()
    main_grads = attach_main_grads(block) if opts["accumulate_into_main_grad"] else {}
    gen = torch.Generator().manual_seed(0)  # 160 rows: 32-row MX blocks, a zero-token expert
    b = (torch.randn(160, H, generator=gen), ref.split_arg([32, 0, 64, 32], "tensor", "cpu"),
         torch.rand(160, generator=gen), torch.randn(160, H, generator=gen))
    with te_ops.autocast(recipe=recipe):
        got_dx, _ = run(block, *b)
        want_dx, _ = run(twin, *b)
    assert torch.equal(got_dx, want_dx)
    if opts["delay_wgrad_compute"]:
        block.backward_dw()
    with te_ops.autocast(recipe=None, enabled=False):
        plain = make_block()
        run(plain, *b)
    differs = False
    for name, _ in block.named_parameters():
        got = (main_grads[name] if "weight" in name and main_grads
               else block.get_parameter(name).grad)
        want = twin.get_parameter(name).grad
        assert torch.equal(got, want), name
        differs |= "weight" in name and not torch.equal(got, plain.get_parameter(name).grad)
    assert differs, "the recipe's quantization must show in the weight grads"
