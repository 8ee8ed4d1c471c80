"""The eager launch of te_ops' Triton kernels (te_ops/kernels/triton_launch.py).

CPU tests drive :class:`DirectLauncher` with a stand-in kernel and runtime that record what
the normal launch (``kernel[grid](...)``) and the direct one (``compiled.run(...)``) receive;
the grid helpers are checked against their definitions, the launch is made on the tensors'
device (CPU stand-ins for the device calls), and on two GPUs a block whose tensors live on the
non-current device launches there.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from te_ops.kernels import triton_launch
from te_ops.kernels.triton_launch import DirectLauncher

NAMES = ("x_ptr", "out_ptr", "n", "BLOCK", "FLAG")


class _Compiled:
    function = "fn-handle"
    packed_metadata = "packed"

    def __init__(self, log: list) -> None:
        self.log = log

    def run(self, *a):
        self.log.append(("direct", a))


class _Kernel:
    """A stand-in ``JITFunction``: ``kernel[grid](...)`` records a normal launch and returns
    its compiled kernel (a new one per launch, as a compile would)."""

    def __init__(self, names=NAMES) -> None:
        self.arg_names = list(names)
        self.pre_run_hooks: list = []
        self.used_global_vals: dict = {}
        self.log: list = []
        self.compiled: list[_Compiled] = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("normal", grid, args, kwargs))
            c = _Compiled(self.log)
            self.compiled.append(c)
            return c
        return run


class _Runtime:
    def __init__(self) -> None:
        self.rt = SimpleNamespace(debug=False, launch_enter_hook=SimpleNamespace(calls=[]),
                                  launch_exit_hook=SimpleNamespace(calls=[]),
                                  add_stages_inspection_hook=None)
        self.comp = SimpleNamespace(instrumentation_mode="")

    def knobs(self):
        return SimpleNamespace(runtime=self.rt, compilation=self.comp)

    def device(self) -> int:
        return 0

    def stream(self, device: int) -> int:
        return 1234 + device


def _launcher():
    kernel = _Kernel()
    return kernel, DirectLauncher(kernel, runtime=_Runtime())


def _call(launcher, x, out, n=7, grid=(3, 2), **kw):
    kw = {"BLOCK": 16, "FLAG": True, "num_warps": 4, **kw}
    launcher(grid, x, out, n, **kw)


def test_second_call_launches_the_cached_kernel_with_the_bound_arguments():
    kernel, launcher = _launcher()
    x, out = torch.zeros(8), torch.zeros(8)
    _call(launcher, x, out)
    assert [e[0] for e in kernel.log] == ["normal"]
    _call(launcher, x, out)
    assert [e[0] for e in kernel.log] == ["normal", "direct"]
    _, a = kernel.log[1]
    # grid padded to 3-D, the runtime's stream, the compiled handles, no launch metadata or
    # hooks, then every parameter in signature order (constexprs included; options not)
    assert a[:9] == (3, 2, 1, 1234, "fn-handle", "packed", None, None, None)
    assert a[9] is x and a[10] is out and a[11:] == (7, 16, True)
    assert launcher.stats() == {"direct": 1, "normal": 1, "keys": 1,
                                "last_fallback": "first launch of this key"}


@pytest.mark.parametrize("change", ["dtype", "misaligned", "int", "grid", "constexpr", "option",
                                    "debug", "same_values_other_tensors"])
def test_a_call_with_another_key_launches_normally(change):
    kernel, launcher = _launcher()
    x, out = torch.zeros(8), torch.zeros(8)
    _call(launcher, x, out)
    kwargs = {}
    if change == "dtype":
        x = torch.zeros(8, dtype=torch.float64)
    elif change == "misaligned":
        x = torch.zeros(9)[1:]  # 4 bytes past a 16-byte aligned start
    elif change == "int":
        kwargs["n"] = 8
    elif change == "grid":
        kwargs["grid"] = (3, 2, 1)  # the same launch, another key: compiles nothing new
    elif change == "constexpr":
        kwargs["BLOCK"] = 32
    elif change == "option":
        kwargs["num_warps"] = 8
    elif change == "debug":
        launcher.runtime.rt.debug = True
    else:
        x, out = torch.ones(8), torch.ones(8)
    _call(launcher, x, out, **kwargs)
    expected = "direct" if change == "same_values_other_tensors" else "normal"
    assert kernel.log[-1][0] == expected
    if expected == "direct":
        assert kernel.log[-1][1][9] is x
    elif change == "misaligned":  # never cached: every such call launches normally
        assert launcher.last_fallback == "a tensor not 16-byte aligned"
        _call(launcher, x, out)
        assert kernel.log[-1][0] == "normal" and launcher.stats()["keys"] == 1
    else:  # a new key: cached from its first launch on
        _call(launcher, x, out, **kwargs)
        assert kernel.log[-1][0] == "direct" and launcher.stats()["keys"] == 2


def test_parameters_are_tensors_and_other_scalar_types_are_other_keys():
    kernel, launcher = _launcher()
    w = torch.nn.Parameter(torch.zeros(8))
    out = torch.zeros(8)
    for n in (1, True, 1, True):  # True == 1, but another type: another key
        _call(launcher, w, out, n=n)
    assert [e[0] for e in kernel.log] == ["normal", "normal", "direct", "direct"]
    assert kernel.log[2][1][9] is w and kernel.log[3][1][11] is True


def test_fallbacks_launch_normally_and_say_why():
    kernel, launcher = _launcher()
    x, out = torch.zeros(8), torch.zeros(8)
    _call(launcher, x, out)
    _call(launcher, x, out)
    assert launcher.direct == 1
    for setup, why in [
        (lambda: launcher.runtime.rt.launch_enter_hook.calls.append(print),
         "a launch hook is installed"),
        (lambda: kernel.pre_run_hooks.append(print), "pre-run hooks"),
    ]:
        setup()
        _call(launcher, x, out)
        assert kernel.log[-1][0] == "normal" and launcher.last_fallback == why
        launcher.runtime.rt.launch_enter_hook.calls.clear()
        kernel.pre_run_hooks.clear()
        _call(launcher, x, out)
        assert kernel.log[-1][0] == "direct"


def test_a_changed_global_takes_the_normal_launch_and_its_error():
    kernel, launcher = _launcher()
    x, out = torch.zeros(8), torch.zeros(8)
    g = {"SCALE": 2}
    kernel.used_global_vals = {("SCALE", id(g)): (2, g)}
    _call(launcher, x, out)
    _call(launcher, x, out)
    assert kernel.log[-1][0] == "direct"
    g["SCALE"] = 3
    _call(launcher, x, out)
    assert kernel.log[-1][0] == "normal" and launcher.last_fallback == "a global value changed"


@pytest.mark.parametrize("case", ["default_param", "unknown_keyword", "async", "scalar_kind"])
def test_keys_that_cannot_be_launched_directly_always_launch_normally(case):
    kernel, launcher = _launcher()
    x, out = torch.zeros(8), torch.zeros(8)
    kw: dict = {}
    if case == "default_param":
        kw = {"BLOCK": 16, "num_warps": 4}  # FLAG left to a default
    elif case == "unknown_keyword":
        kw = {"BLOCK": 16, "FLAG": True, "enable_fp_fusion": False}
    elif case == "async":
        kernel.__class__ = type("_AsyncKernel", (_Kernel,), {
            "__getitem__": lambda self, grid: lambda *a, **k: SimpleNamespace(result=None)})
        kw = {"BLOCK": 16, "FLAG": True}
    for _ in range(3):
        if case == "scalar_kind":
            launcher((3,), x, out, [7], BLOCK=16, FLAG=True)
        else:
            launcher((3,), x, out, 7, **kw)
    assert launcher.direct == 0 and launcher.normal == 3
    assert launcher.last_fallback in ("this key cannot be launched directly",
                                      "an argument of another kind")


def test_other_kernel_objects_launch_normally():
    kernel = _Kernel()  # not a triton JITFunction (as wrap_triton's or the interpreter's)
    triton_launch.launch(kernel, (2,), torch.zeros(4), torch.zeros(4), 3, BLOCK=16, FLAG=False)
    assert [e[0] for e in kernel.log] == ["normal"]
    assert DirectLauncher(kernel).reason is not None
    assert DirectLauncher(kernel).stats()["last_fallback"] == triton_launch.unsupported_reason(
        kernel)


def test_launch_of_another_kernel_object_is_the_plain_triton_launch():
    """``launch(kernel, grid, *args, **kwargs)`` of a kernel object that is not a plain
    ``JITFunction`` (``wrap_triton``'s, the interpreter's) is ``kernel[grid](*args,
    **kwargs)``, every time."""
    kernel = _Kernel()
    x = torch.zeros(4)
    for _ in range(2):
        triton_launch.launch(kernel, (3, 2), x, 7, BLOCK=16, num_warps=4)
    assert [e[:3] for e in kernel.log] == [("normal", (3, 2), (x, 7))] * 2
    assert kernel.log[-1][3] == {"BLOCK": 16, "num_warps": 4}


def test_launch_of_a_jit_function_goes_through_its_shared_direct_launcher(monkeypatch):
    """``launch`` of a plain ``JITFunction`` (the stand-in, as Triton's type): the first call
    of a key launches normally, repeats launch the cached compiled kernel, through one
    launcher per kernel."""
    monkeypatch.setattr(triton_launch, "JITFunction", _Kernel)
    monkeypatch.setattr(triton_launch, "_Runtime", _Runtime)
    monkeypatch.setattr(triton_launch, "_LAUNCHERS", {})
    kernel = _Kernel()
    x, out = torch.zeros(8), torch.zeros(8)
    for _ in range(3):
        triton_launch.launch(kernel, (3, 2), x, out, 7, BLOCK=16, FLAG=True, num_warps=4)
    assert [e[0] for e in kernel.log] == ["normal", "direct", "direct"]
    launcher = triton_launch.direct_launcher(kernel)
    assert launcher.stats()["direct"] == 2 and launcher.reason is None


@pytest.mark.cuda
@pytest.mark.parametrize("epilogue", [False, True])
def test_block_step_launches_from_the_cache_with_the_normal_launchs_bits(monkeypatch, epilogue):
    """A block's Triton kernels (GEMMs, SwiGLU or fc1 with the SwiGLU epilogue, split table)
    launch from the cache after their first call, with the same bits as ``JITFunction.run``'s
    launches (forced by a launch hook, the Triton profiler's kind)."""
    triton = pytest.importorskip("triton")
    import te_ops
    from gemm_force import FC1_FUSED_ANY, NO_FC1_FUSED, with_rows
    from te_ops.gemm import grouped_gemm_triton, grouped_mlp_triton
    from te_ops.kernels import split_table, swiglu_triton

    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "triton")
    with_rows(monkeypatch, first=FC1_FUSED_ANY if epilogue else NO_FC1_FUSED)
    torch.manual_seed(0)
    groups, hidden, ffn, rows = 8, 64, 32, 32
    kw = {"bias": False, "device": "cuda", "dtype": torch.bfloat16}
    block = te_ops.Sequential(te_ops.GroupedLinear(groups, hidden, 2 * ffn, **kw),
                              te_ops.ScaledSwiGLU(),
                              te_ops.GroupedLinear(groups, ffn, hidden, **kw))
    split = torch.full((groups,), rows // groups, device="cuda", dtype=torch.int64)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(rows, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)

    def step():
        x.grad = probs.grad = None
        for p in block.parameters():
            p.grad = None
        out = block(x, split, probs, split)
        out.backward(dy)
        return [t.clone() for t in (out, x.grad, probs.grad, *[p.grad for p in
                                                               block.parameters()])]

    forward_kernel = (grouped_mlp_triton._fc1_swiglu_kernel if epilogue
                      else swiglu_triton._fwd_kernel)
    kernels = (grouped_gemm_triton._rows_kernel, grouped_gemm_triton._wgrad_kernel,
               forward_kernel, swiglu_triton._bwd_kernel, split_table._split_table_kernel)
    first = [step() for _ in range(2)][-1]
    direct = {k: triton_launch.direct_launcher(k).direct for k in kernels}
    got = [step() for _ in range(2)][-1]
    torch.cuda.synchronize()
    for k in kernels:
        assert triton_launch.direct_launcher(k).direct > direct[k], (
            triton_launch.direct_launcher(k).stats())
    rt = triton.knobs.runtime
    saved = rt.launch_enter_hook
    seen: list = []
    chain = hasattr(saved, "add") and hasattr(saved, "remove")  # Triton's HookChain
    if chain:
        saved.add(seen.append)
    else:
        rt.launch_enter_hook = seen.append
    try:
        normal = step()
    finally:
        if chain:
            saved.remove(seen.append)
        else:
            rt.launch_enter_hook = saved
    assert len(seen) >= len(kernels)
    assert all(torch.equal(a, b) for a, b in zip(first, got))
    assert all(torch.equal(a, b) for a, b in zip(normal, got))


def test_grid_helpers_match_their_definitions():
    """cdiv / next_power_of_2 (the launch wrappers' plain-Python grid helpers) against
    independent definitions."""
    for x in range(0, 300):
        for y in (1, 2, 3, 16, 32, 64, 128, 1024):
            assert triton_launch.cdiv(x, y) == -(-x // y) == (x // y + (x % y > 0))
    for n in list(range(1, 3000)) + [2**20 - 1, 2**20, 2**20 + 1, 2**40 + 3]:
        p = 1
        while p < n:
            p *= 2
        assert triton_launch.next_power_of_2(n) == p


@pytest.mark.parametrize("first, then", [(True, 1), (1, 1.0), (1, True), (0, False)])
def test_keyword_values_equal_in_python_but_of_another_type_are_another_key(first, then):
    """``True == 1 == 1.0`` (same hash), but Triton compiles a constexpr ``True`` and ``1`` (or
    a keyword-passed ``i32`` and ``fp32`` argument) apart: a keyword's type is part of the
    key, as a positional argument's is."""
    kernel, launcher = _launcher()
    x, out = torch.zeros(8), torch.zeros(8)
    _call(launcher, x, out, FLAG=first)
    _call(launcher, x, out, FLAG=then)
    assert [e[0] for e in kernel.log] == ["normal", "normal"]
    _call(launcher, x, out, FLAG=then)
    assert kernel.log[-1][0] == "direct" and kernel.log[-1][1][-1] is then


@pytest.mark.parametrize("kind", ["tensor", "list", "tuple"])
def test_keyword_values_of_other_kinds_launch_normally_and_are_not_kept(kind):
    """A tensor passed by keyword (its dtype and alignment are not in the key) or an
    unhashable value: the normal launch every time, and the cache keeps no reference (a
    cached key holding the tensor would keep its memory alive for the process)."""
    import gc
    import weakref

    value = {"tensor": torch.zeros(8), "list": [1, 2], "tuple": (16,)}[kind]
    kernel, launcher = _launcher()
    x, out = torch.zeros(8), torch.zeros(8)
    for _ in range(2):
        _call(launcher, x, out, FLAG=value)
    assert [e[0] for e in kernel.log] == ["normal", "normal"]
    assert launcher.stats()["keys"] == 0
    assert launcher.last_fallback == "a keyword argument of another kind"
    if isinstance(value, torch.Tensor):
        ref = weakref.ref(value)
        del value
        kernel.log.clear()
        gc.collect()
        assert ref() is None


def test_the_cache_stays_bounded_over_many_distinct_values():
    """Every distinct integer value (e.g. each row count of a run with varying token counts)
    or NaN float is its own key: the cache is bounded (emptied when full) instead of growing
    for the life of the process, and keeps launching correctly after."""
    kernel, launcher = _launcher()
    x, out = torch.zeros(8), torch.zeros(8)
    limit = triton_launch.MAX_KEYS
    for n in range(limit + 10):
        _call(launcher, x, out, n=n)
    for _ in range(3):
        launcher((3, 2), x, out, float("nan"), BLOCK=16, FLAG=True, num_warps=4)
    assert launcher.stats()["keys"] <= limit
    _call(launcher, x, out, n=limit + 5)
    assert kernel.log[-1][0] == "direct" and kernel.log[-1][1][11] == limit + 5


@pytest.mark.parametrize("kind", ["callable", "list"])
def test_grids_other_than_tuples_launch_normally(kind):
    """``kernel[grid]`` also takes a callable (``grid(meta)``, the usual Triton idiom) or a
    list: the normal launch every time (a cached callable grid would be indexed as a tuple,
    a list is unhashable)."""
    kernel, launcher = _launcher()
    x, out = torch.zeros(8), torch.zeros(8)
    grid = (lambda meta: (3,)) if kind == "callable" else [3, 2]
    for _ in range(3):
        _call(launcher, x, out, grid=grid)
    assert [e[0] for e in kernel.log] == ["normal"] * 3 and kernel.log[-1][1] is grid
    assert launcher.last_fallback == "a grid that is not a tuple"


def test_a_launch_runs_with_the_tensors_device_current(monkeypatch):
    """Triton launches on the current device: a call whose tensors live on another CUDA
    device makes theirs current around the launch (CPU stand-ins for the device calls)."""
    events = []

    class Guard:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            events.append(("enter", self.index))

        def __exit__(self, *exc):
            events.append(("exit", self.index))

    kernel = _Kernel()

    def record(grid):
        events.append(("launch", grid))
        return lambda *a, **k: None

    monkeypatch.setattr(type(kernel), "__getitem__", lambda self, grid: record(grid))
    monkeypatch.setattr(triton_launch.torch.cuda, "device", Guard)
    monkeypatch.setattr(triton_launch, "_current_device", lambda: 0)
    monkeypatch.setattr(triton_launch, "_cuda_index", lambda args: 1)
    triton_launch.launch(kernel, (2,), torch.zeros(4), 3, BLOCK=16)
    assert events == [("enter", 1), ("launch", (2,)), ("exit", 1)]
    events.clear()
    monkeypatch.setattr(triton_launch, "_cuda_index", lambda args: 0)
    triton_launch.launch(kernel, (2,), torch.zeros(4), 3, BLOCK=16)
    assert events == [("launch", (2,))]


def test_cuda_index_of_cpu_tensors_is_none():
    assert triton_launch._cuda_index((torch.zeros(2), 3)) is None
    assert triton_launch._cuda_index((3, 4.0)) is None


def _two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.cuda
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA GPUs")
def test_tensors_on_another_device_launch_there_on_its_current_stream():
    """With cuda:0 current, te_ops' Triton kernels (a block's first and repeated calls) given
    tensors on cuda:1 launch on cuda:1 and on cuda:1's current stream: inputs written on a side
    stream of cuda:1 behind a long sleep are read only after it (a launch on another stream
    would read them before); results equal a run with cuda:1 current."""
    pytest.importorskip("triton")
    import te_ops
    from te_ops.gemm import grouped_gemm_triton

    torch.manual_seed(0)
    groups, hidden, ffn, rows = 8, 64, 32, 32
    dev = torch.device("cuda", 1)
    kw = {"bias": False, "single_grouped_weight": True, "device": dev, "dtype": torch.bfloat16}

    def make():
        torch.manual_seed(0)
        return te_ops.Sequential(te_ops.GroupedLinear(groups, hidden, 2 * ffn, **kw),
                                 te_ops.ScaledSwiGLU(),
                                 te_ops.GroupedLinear(groups, ffn, hidden, **kw))

    split = torch.full((groups,), rows // groups, device=dev, dtype=torch.int64)
    src = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16)
    probs = torch.rand(rows, device=dev, dtype=torch.bfloat16)
    w = torch.randn(groups, 2 * ffn, hidden, device=dev, dtype=torch.bfloat16)
    offsets = torch.cumsum(split, 0).to(torch.int32)

    def run(block, make_x=src.clone):
        x = make_x().requires_grad_()
        out = block(x, split, probs, split)
        out.backward(torch.ones_like(out))
        return [out.detach(), x.grad, *[p.grad for p in block.parameters()]]

    with torch.cuda.device(1):
        want_gemm = grouped_gemm_triton.triton_fprop(src, w, offsets)
        ref_block = make()
        want = [run(ref_block) for _ in range(3)][-1]
    torch.cuda.synchronize(dev)

    torch.cuda.set_device(0)
    side = torch.cuda.Stream(dev)
    torch.cuda.set_stream(side)  # cuda:1's current stream (this may make cuda:1 current)
    torch.cuda.set_device(0)
    try:
        assert torch.cuda.current_device() == 0
        assert torch.cuda.current_stream(dev) == side

        def late():
            """src, copied on cuda:1's side stream behind a long sleep (cuda:0 current
            again after)."""
            with torch.cuda.stream(side):
                buf = torch.full_like(src, float("nan"))
                torch.cuda._sleep(100_000_000)  # ~50 ms on an H200 before the copy
                return buf.copy_(src)

        got_gemm = grouped_gemm_triton.triton_fprop(late(), w, offsets)
        assert torch.cuda.current_device() == 0
        block = make()
        got = [run(block, late) for _ in range(3)][-1]  # the third call: the cached plan
        torch.cuda.synchronize(dev)
    finally:
        torch.cuda.set_stream(torch.cuda.default_stream(dev))
        torch.cuda.set_device(0)
    assert torch.equal(got_gemm, want_gemm)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
