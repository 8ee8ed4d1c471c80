"""The warp-specialized Gluon grouped wgrad (``te_ops/gemm/grouped_wgrad_gluon.py``).

CPU (CI, with or without Triton): the config, argument errors, the gate's reasons, the fake
kernel of ``te_ops::grouped_wgrad_gluon`` and its trace under ``torch.compile(fullgraph=True)``;
where Triton with Gluon and an sm_90 assembler are installed, an
ahead-of-time sm_90 compile of the kernel (warp-specialized partitions with ``setmaxnreg``,
wgmma, TMA loads and stores, shared memory within SM90's 227 KiB, no register spills; the
subtiled epilogue's slice stores, their waits and its 4-stage ring within that shared memory).
CUDA (``@pytest.mark.cuda``, SM90): dW against an fp64 per-group reference at N(0, 1)
activations and gradient-scale dy (empty groups, offsets that stop short of the rows with NaN
padding, ragged groups, several tiles per program), bitwise equal to ``torch._grouped_mm``;
CUDA-graph replay with changed offsets and ``torch.compile(fullgraph=True)`` bitwise equal to
eager, for the default, ping-pong and subtiled-epilogue (``epi2``, ``epi4``) configs
(``experimental/gemm_kernel_ab/gluon_wgrad.py --check`` times the same cases per config).
"""

from __future__ import annotations

import re

import pytest
import torch

from te_ops.gemm import grouped_wgrad_gluon as G


CUDA = torch.device("cuda")
PINGPONG = {"CONSUMERS": 2, "num_warps": 4, "BLOCK_K": 128, "STAGES": 4}
#: the subtiled epilogue with a 4th ring stage: 2 x (128 x 128) and 4 x (128 x 64) slices
EPI2 = {"STAGES": 4, "EPI_SPLIT": 2, "EPI_BUFS": 1}
EPI4 = {"STAGES": 4, "EPI_SPLIT": 4, "EPI_BUFS": 2}
#: tile order in bands of GROUP_N dW row tiles (the default 8; 3: bands that do not divide
#: the row tiles; 1: a whole row of tiles at a time, the earlier order)
GN3 = {"GROUP_N": 3}
GN1 = {"GROUP_N": 1}


# ----------------------------------------------------------------------------------- CPU
def test_config_keys_and_default():
    cfg = G.gluon_wgrad_config()
    assert set(cfg) == {"BLOCK_M", "BLOCK_N", "BLOCK_K", "STAGES", "CONSUMERS", "EPI_SPLIT",
                        "EPI_BUFS", "LOADER_REGS", "CONSUMER_REGS", "GROUP_N", "num_warps",
                        "maxnreg"}
    assert (cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["CONSUMERS"], cfg["num_warps"]) == (
        128, 256, 1, 8)
    assert (cfg["STAGES"], cfg["EPI_SPLIT"], cfg["EPI_BUFS"]) == (3, 1, 1)  # whole-tile store
    assert cfg["GROUP_N"] == 8  # tile bands of 8 dW row tiles


@pytest.mark.parametrize("config, match", [
    ({"EPI_SPLIT": 3}, "config EPI_SPLIT must be 1, 2 or 4, got 3"),
    ({"EPI_SPLIT": 8}, "config EPI_SPLIT must be 1, 2 or 4, got 8"),
    ({"EPI_BUFS": 0}, "config EPI_BUFS must be 1 or 2, got 0"),
    ({"EPI_SPLIT": 4, "EPI_BUFS": 3}, "config EPI_BUFS must be 1 or 2, got 3"),
    ({"GROUP_N": 0}, "config GROUP_N must be an int >= 1, got 0"),
    ({"GROUP_N": 2.0}, "config GROUP_N must be an int >= 1, got 2.0"),
    ({"GROUP_N": True}, "config GROUP_N must be an int >= 1, got True"),
])
def test_epilogue_config_errors(config, match):
    with pytest.raises(ValueError, match=match):
        G.check_config(config)
    with pytest.raises(ValueError, match=match):  # checked before the launch's gate
        G.gluon_wgrad(*_ops(), config=config)


@pytest.mark.parametrize("config", [None, {}, EPI2, EPI4, {"EPI_SPLIT": 2, "EPI_BUFS": 2}])
def test_epilogue_configs_accepted(config):
    G.check_config(config)


def _ops(m=8, n=128, k=64, dtype=torch.bfloat16):
    return (torch.zeros(m, k, dtype=dtype), torch.zeros(m, n, dtype=dtype),
            torch.tensor([3, 8], dtype=torch.int32))


@pytest.mark.parametrize("change, match", [
    ({"x": torch.zeros(8, 4, 1)}, r"x must be 2-D \(rows, in_features\), got shape \(8, 4, 1\)"),
    ({"dy": torch.zeros(7, 128, dtype=torch.bfloat16)},
     r"dy must be 2-D \(8, out_features\) torch.bfloat16 on cpu, got shape \(7, 128\)"),
    ({"dy": torch.zeros(8, 128)}, r"dy must be .* got shape \(8, 128\) torch.float32"),
    ({"offs": torch.tensor([[3, 8]])}, r"offsets must be 1-D int32/int64 \(G,\) on cpu, got "
                                       r"torch.int64 \(1, 2\)"),
    ({"offs": torch.tensor([3.0, 8.0])}, "offsets must be 1-D int32/int64 .* got torch.float32"),
])
def test_argument_errors_name_the_argument(change, match):
    x, dy, offs = _ops()
    with pytest.raises(ValueError, match=match):
        G.gluon_wgrad(change.get("x", x), change.get("dy", dy), change.get("offs", offs))


def test_unknown_config_key_raises():
    with pytest.raises(ValueError, match=r"config keys must be among .* unknown \['FLAT'\]"):
        G.gluon_wgrad(*_ops(), config={"FLAT": True})


def test_cpu_call_raises_with_the_reason():
    with pytest.raises(RuntimeError, match="the Gluon grouped wgrad cannot run: "
                       "(Gluon kernels need a CUDA device, got cpu|the installed Triton has "
                       r"no Gluon)"):
        G.gluon_wgrad(*_ops())


@pytest.mark.parametrize("make, match", [
    (lambda: (torch.zeros(8, 64), torch.zeros(8, 128)), "must both be bf16 or fp16"),
    (lambda: (torch.zeros(64, 8, dtype=torch.bfloat16).t(), torch.zeros(8, 128,
                                                                        dtype=torch.bfloat16)),
     "x is not contiguous"),
    (lambda: (torch.zeros(8, 60, dtype=torch.bfloat16), torch.zeros(8, 128,
                                                                    dtype=torch.bfloat16)),
     r"x's rows or base are not 16-byte aligned"),
    (lambda: (torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(8, 192,
                                                                    dtype=torch.bfloat16)),
     r"out_features \(192\) is not a multiple of BLOCK_N \(128\)"),
])
def test_gate_reasons(make, match):
    x, dy = make()
    assert re.search(match, G.gluon_unsupported_reason(x, dy))


def test_gate_block_n_follows_the_config():
    x, dy, _ = _ops(n=192)
    assert "out_features" in G.gluon_unsupported_reason(x, dy)
    assert "out_features" not in (G.gluon_unsupported_reason(x, dy, {"BLOCK_N": 64}) or "")


def test_fake_kernel_shape_and_dtype():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(100, 256, dtype=torch.bfloat16)
        dy = torch.empty(100, 384, dtype=torch.bfloat16)
        offs = torch.empty(5, dtype=torch.int32)
        out = torch.ops.te_ops.grouped_wgrad_gluon(x, dy, offs)
        assert tuple(out.shape) == (5, 384, 256) and out.dtype == torch.bfloat16
        out = G.gluon_wgrad(x, dy, offs)  # traced: the op, not a launch
        assert tuple(out.shape) == (5, 384, 256)


def test_compile_fullgraph_traces_the_op():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(G.gluon_wgrad, fullgraph=True, backend=backend)
    with pytest.raises(RuntimeError, match="the Gluon grouped wgrad cannot run"):
        fn(*_ops())  # CPU: the op runs and raises with the reason
    assert len(graphs) == 1 and "te_ops.grouped_wgrad_gluon" in graphs[0].code


# -------------------------------------------------------------- sm_90 compile, on the CPU
def _compile_sm90(config: dict):
    triton = pytest.importorskip("triton")
    pytest.importorskip("triton.experimental.gluon")
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {"x_ptr": "*bf16", "dy_ptr": "*bf16", "out_ptr": "*bf16", "offs_ptr": "*i32",
           "order_ptr": "*i64", "M": "i32", "N": "i32", "K": "i32", "G": "i32", "P": "i32"}
    cfg = {**G.gluon_wgrad_config(), **config}
    consts = {k: v for k, v in cfg.items() if k != "maxnreg"}
    src = GluonASTSource(G._gluon_wgrad_kernel, {**sig, **{k: "constexpr" for k in consts}},
                         constexprs=consts)
    try:
        return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": cfg["num_warps"],
                                       "maxnreg": cfg["maxnreg"]})
    except RuntimeError as exc:  # pragma: no cover - e.g. no ptxas in this install
        if "ptxas" in str(exc).lower():
            pytest.skip(f"cannot assemble for sm_90 here: {str(exc)[:200]}")
        raise


@pytest.mark.parametrize("config, partitions, wgmma", [
    ({}, 1, "m64n256k16"), (PINGPONG, 2, "m64n128k16"), (EPI2, 1, "m64n256k16"),
    (EPI4, 1, "m64n256k16"), (GN1, 1, "m64n256k16")],
    ids=["default", "pingpong", "epi2_stages4", "epi4_stages4", "group_n1"])
def test_sm90_compile_has_warp_specialized_partitions(config, partitions, wgmma):
    kernel = _compile_sm90(config)
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    assert "ttg.warp_specialize" in ttgir
    assert len(re.findall(r"^\s*partition\d+\(", ttgir, re.M)) == partitions
    assert ".reqntid 384" in ptx and ".maxnreg 168" in ptx  # 8 + 4 or 4 + 4 + 4 warps
    assert "setmaxnreg.inc.sync.aligned.u32" in ptx and "setmaxnreg.dec.sync.aligned.u32" in ptx
    assert f"wgmma.mma_async.sync.aligned.{wgmma}.f32.bf16.bf16" in ptx
    assert "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier" in ptx  # TMA loads
    assert "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group" in ptx  # TMA stores
    assert kernel.metadata.shared <= 232448  # SM90's 227 KiB of shared memory per block
    assert ".local" not in ptx  # no local-memory (stack) arrays in the PTX


@pytest.mark.parametrize("config, stores, waits", [
    ({}, 1, {0}), (EPI2, 2, {0}), (EPI4, 4, {1})], ids=["default", "epi2", "epi4"])
def test_sm90_compile_subtiled_epilogue(config, stores, waits):
    """EPI_SPLIT TMA stores per tile, each waiting only for the store that last used its
    buffer (``wait_group.read EPI_BUFS - 1``); the slices come straight from the accumulator's
    registers (no layout conversion through shared memory); the 4-stage ring plus the 32 KiB
    of slice buffers fit SM90's shared memory where the whole 64 KiB tile would not."""
    kernel = _compile_sm90(config)
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    assert ptx.count("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group") == stores
    pend = {int(p) for p in re.findall(r"async_tma_store_wait \{pendings = (\d+)", ttgir)}
    assert pend == waits | {0}  # the consumer's last wait (all stores out) is 0
    assert "convert_layout" not in ttgir
    cfg = {**G.gluon_wgrad_config(), **config}
    ring = cfg["STAGES"] * cfg["BLOCK_M"] * (cfg["BLOCK_N"] + cfg["BLOCK_K"]) * 2
    c_tiles = cfg["EPI_BUFS"] * cfg["BLOCK_N"] * cfg["BLOCK_K"] // cfg["EPI_SPLIT"] * 2
    assert ring + c_tiles <= kernel.metadata.shared <= 232448
    assert ".local" not in ptx


# ----------------------------------------------------------------------------------- CUDA
def _cuda_sm90():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon wgrad is written for SM90")
    if G.gluon is None:
        pytest.skip("no Gluon in the installed Triton")


def _problem(m, n, k, sizes, seed=0):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    x = torch.randn(m, k, device=CUDA, generator=gen).to(torch.bfloat16)  # activations
    dy = (torch.randn(m, n, device=CUDA, generator=gen) * 1e-2).to(torch.bfloat16)  # grads
    offs = torch.tensor(sizes, device=CUDA).cumsum(0).to(torch.int32)
    used = int(offs[-1])
    x[used:] = float("nan")  # padding rows: never read
    dy[used:] = float("nan")
    return x, dy, offs


def _reference(x, dy, offs):
    out = torch.zeros(offs.numel(), dy.shape[1], x.shape[1], dtype=torch.float64, device=CUDA)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[g] = dy[start:end].double().t() @ x[start:end].double()
        start = end
    return out


CASES = {  # name: (rows M, N, K, group sizes)
    "empty_groups": (1000, 256, 384, [0, 300, 0, 517, 0, 183]),
    "short_offsets_nan_pad": (1200, 384, 256, [129, 64, 1, 300, 250]),
    "ragged": (2053, 512, 640, [700, 3, 1000, 350]),
    "many_tiles_per_program": (4200, 1024, 1024, [2000, 0, 1500, 596, 1]),
    "all_empty": (64, 128, 256, [0, 0, 0]),
}


@pytest.mark.cuda
@pytest.mark.parametrize("config", [None, PINGPONG, EPI2, EPI4, GN3, GN1],
                         ids=["default", "pingpong", "epi2", "epi4", "group_n3", "group_n1"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_against_fp64_reference_and_grouped_mm(case, config):
    _cuda_sm90()
    m, n, k, sizes = CASES[case]
    x, dy, offs = _problem(m, n, k, sizes)
    out = G.gluon_wgrad(x, dy, offs, config)
    ref = _reference(x, dy, offs)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    # bf16 rounding of the fp32 sum (at most 2^-9 relative) dominates; the fp32 accumulation
    # error (about sqrt(rows) * 2^-24 of the partial sums, ~1e-6 here) sits in atol
    torch.testing.assert_close(out.double(), ref, rtol=2 ** -7,
                               atol=1e-4 * max(ref.abs().max().item(), 1.0))
    for g, size in enumerate(sizes):
        if size == 0:
            assert torch.count_nonzero(out[g]) == 0
    assert torch.equal(out, torch._grouped_mm(dy.t(), x, offs=offs))


@pytest.mark.cuda
def test_cuda_graph_replay_with_changed_offsets_equals_eager():
    _cuda_sm90()
    m, n, k, sizes = CASES["many_tiles_per_program"]
    x, dy, offs = _problem(m, n, k, sizes)
    x, dy = x.nan_to_num(), dy.nan_to_num()  # offsets grow below: every row may be read
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        G.gluon_wgrad(x, dy, offs)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = G.gluon_wgrad(x, dy, offs)
    for new in ([0, 2500, 1500, 0, 200], [4200, 0, 0, 0, 0], [1, 1, 1, 1, 4196]):
        offs.copy_(torch.tensor(new, device=CUDA).cumsum(0).to(torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, G.gluon_wgrad(x, dy, offs)), new


@pytest.mark.cuda
def test_compile_fullgraph_equals_eager():
    _cuda_sm90()
    m, n, k, sizes = CASES["ragged"]
    x, dy, offs = _problem(m, n, k, sizes)
    compiled = torch.compile(G.gluon_wgrad, fullgraph=True)
    assert torch.equal(compiled(x, dy, offs), G.gluon_wgrad(x, dy, offs))


@pytest.mark.parametrize("config", [{}, EPI4], ids=["default", "epi4_stages4"])
def test_sm90_compile_takes_three_descriptor_slots(config):
    """Global scratch per program: x's and dy's per-group descriptors (made in the loader's
    per-group loop, carried by no loop) and the output's, 128 bytes each. Triton's launcher
    takes programs x this from the torch allocator; it is live at the step's memory peak when
    this wgrad is the last GEMM of the backward."""
    kernel = _compile_sm90(config)
    assert kernel.metadata.global_scratch_size == 3 * 128
