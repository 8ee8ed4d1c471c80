"""The direct launch of cached compiled Triton kernels (te_ops/kernels/triton_launch.py).

CPU tests drive :class:`DirectLauncher` with a stand-in kernel and runtime that record what
the normal launch (``kernel[grid](...)``) and the direct one (``compiled.run(...)``) receive;
the CUDA test runs the real kernels of a fast-path step and compares the results bit for bit
with ``TE_OPS_TRITON_DIRECT_LAUNCH=0``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from gemm_force import NO_FC1_FUSED, FC1_FUSED_ANY, with_rows

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
    assert launcher.stats() == {"direct": 1, "normal": 1, "bound": 0, "keys": 1,
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


def test_fallbacks_launch_normally_and_say_why(monkeypatch):
    kernel, launcher = _launcher()
    x, out = torch.zeros(8), torch.zeros(8)
    _call(launcher, x, out)
    _call(launcher, x, out)
    assert launcher.direct == 1
    for setup, why in [
        (lambda: launcher.runtime.rt.launch_enter_hook.calls.append(print),
         "a launch hook is installed"),
        (lambda: kernel.pre_run_hooks.append(print), "pre-run hooks"),
        (lambda: monkeypatch.setenv("TE_OPS_TRITON_DIRECT_LAUNCH", "0"),
         "TE_OPS_TRITON_DIRECT_LAUNCH=0"),
    ]:
        setup()
        _call(launcher, x, out)
        assert kernel.log[-1][0] == "normal" and launcher.last_fallback == why
        launcher.runtime.rt.launch_enter_hook.calls.clear()
        kernel.pre_run_hooks.clear()
        monkeypatch.delenv("TE_OPS_TRITON_DIRECT_LAUNCH", raising=False)
        _call(launcher, x, out)
        assert kernel.log[-1][0] == "direct"
    monkeypatch.setenv("TE_OPS_TRITON_DIRECT_LAUNCH", "2")
    with pytest.raises(ValueError, match="TE_OPS_TRITON_DIRECT_LAUNCH"):
        _call(launcher, x, out)


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


@pytest.mark.cuda
@pytest.mark.parametrize("epilogue", ["0", "1"])
def test_fast_step_uses_direct_launches_and_matches_normal_launches(monkeypatch, epilogue):
    """The fast path's Triton kernels (GEMMs, SwiGLU or fc1 with the SwiGLU epilogue, split
    table) launch from the cache, with the same bits as JITFunction.run's launches."""
    triton = pytest.importorskip("triton")
    import te_ops
    from te_ops.gemm import grouped_gemm_triton, grouped_mlp_triton, split_table, swiglu_triton

    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "triton")
    with_rows(monkeypatch, first=NO_FC1_FUSED if epilogue == "0" else (),
              last=FC1_FUSED_ANY if epilogue == "1" else ())
    torch.manual_seed(0)
    groups, hidden, ffn, rows = 8, 64, 32, 32
    kw = {"bias": False, "single_grouped_weight": True, "device": "cuda",
          "dtype": torch.bfloat16}
    block = te_ops.Sequential(te_ops.GroupedLinear(groups, hidden, 2 * ffn, **kw),
                              te_ops.ScaledSwiGLU(), te_ops.GroupedLinear(groups, ffn, hidden,
                                                                          **kw))
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

    forward_kernel = (grouped_mlp_triton._fc1_swiglu_kernel if epilogue == "1"
                      else swiglu_triton._fwd_kernel)
    kernels = (grouped_gemm_triton._rows_kernel, grouped_gemm_triton._wgrad_kernel,
               forward_kernel, swiglu_triton._bwd_kernel)
    kernels = (*kernels, split_table._split_table_kernel)
    monkeypatch.setenv("TE_OPS_TRITON_DIRECT_LAUNCH", "0")
    ref = [step() for _ in range(2)][-1]
    bound = {k: triton_launch.direct_launcher(k).bound for k in kernels}
    ref_again = [step() for _ in range(2)][-1]  # the fast path, bound sites launch normally
    assert {k: triton_launch.direct_launcher(k).bound for k in kernels} == bound
    monkeypatch.delenv("TE_OPS_TRITON_DIRECT_LAUNCH")
    got = [step() for _ in range(3)][-1]
    torch.cuda.synchronize()
    for k in kernels:  # every launch of the fast path's step from a bound call site
        assert triton_launch.direct_launcher(k).bound > bound[k], triton_launch.direct_launcher(
            k).stats()
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert all(torch.equal(a, b) for a, b in zip(ref, ref_again))
    if triton.__version__ == "3.6.0":  # the device machine's: its launcher layout is known
        entries = [e for k in kernels for e in triton_launch.direct_launcher(k).cache.values()
                   if e is not None]
        assert entries and all(triton_launch._c_launch(c.run) is not None for c, _ in entries)
    # a hook installed between steps (the Triton profiler's kind) turns bound launches off
    rt = triton.knobs.runtime
    saved = rt.launch_enter_hook
    seen = []
    record = seen.append
    chain = hasattr(saved, "add") and hasattr(saved, "remove")  # Triton's HookChain
    if chain:
        saved.add(record)
    else:
        rt.launch_enter_hook = record
    try:
        hooked = step()
    finally:
        if chain:
            saved.remove(record)
        else:
            rt.launch_enter_hook = saved
    launches = 8 if epilogue == "1" else 9  # fc1 + SwiGLU in one launch with the epilogue
    assert len(seen) >= launches and all(torch.equal(a, b) for a, b in zip(ref, hooked))


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

    kernel.__getitem__ = record
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


def test_c_launch_is_used_only_for_the_known_launcher_layouts():
    """The bound launch calls the C launch function only for the known layouts of Triton's
    ``CudaLauncher.__call__`` (3.5-3.6's compiled launcher, the later generic one) without
    scratch buffers; any other launcher is called as it is."""

    class Compiled:  # Triton 3.6.0's layout
        launch, launch_cooperative_grid, launch_pdl = "C", False, True
        global_scratch_size = profile_scratch_size = 0

        def __call__(self, gridX, gridY, gridZ, stream, function, *args):
            self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid,
                        self.launch_pdl, self.global_scratch_size, self.profile_scratch_size,
                        *args)

    class Generic:
        launch, launch_cooperative_grid, launch_pdl = "G", False, False
        arg_annotations, kernel_signature = "ann", "sig"
        global_scratch_size = profile_scratch_size = 0

        def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata,
                     launch_metadata, launch_enter_hook, launch_exit_hook, *args):
            self.launch(gridX, self.launch_cooperative_grid, self.launch_pdl,
                        self.arg_annotations, self.kernel_signature, self.global_scratch_size,
                        self.profile_scratch_size)

    assert triton_launch._c_launch(Compiled()) == ("compiled", "C", False, True, None, None)
    assert triton_launch._c_launch(Generic()) == ("generic", "G", False, False, "ann", "sig")
    scratch = Compiled()
    scratch.global_scratch_size = 64
    assert triton_launch._c_launch(scratch) is None

    class Other:
        def __call__(self, *args):
            pass

    assert triton_launch._c_launch(Other()) is None
    assert triton_launch._c_launch(lambda *a: None) is None


def test_launch_batch_is_not_ready_off_its_device():
    batch = triton_launch.LaunchBatch(runtime=_Runtime())
    batch.begin(torch.device("cpu"))
    assert not batch.ready
    batch.begin(torch.device("cuda", 0))  # nothing bound yet: no device
    assert not batch.ready


def test_bound_launch_without_a_binding_launches_normally():
    """A BoundLaunch of a kernel that cannot be launched directly (here a stand-in, as
    wrap_triton's or the interpreter's kernels) launches the normal way on every call."""
    kernel = _Kernel()
    batch = triton_launch.LaunchBatch(runtime=_Runtime())
    site = triton_launch.BoundLaunch(kernel, (3,), (7,), {"BLOCK": 16, "FLAG": True}, batch)
    x, out = torch.zeros(8), torch.zeros(8)
    for _ in range(3):
        site(x, out)
    assert [e[0] for e in kernel.log] == ["normal"] * 3
    assert kernel.log[-1][2][:2] == (x, out) and kernel.log[-1][2][2:] == (7,)
    assert site.go is None


def _two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.cuda
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA GPUs")
def test_tensors_on_another_device_launch_there_on_its_current_stream():
    """With cuda:0 current, te_ops' Triton kernels (general and fast path) given tensors on
    cuda:1 launch on cuda:1 and on cuda:1's current stream: inputs written on a side stream
    of cuda:1 behind a long sleep are read only after it (a launch on another stream would
    read them before); results equal a run with cuda:1 current."""
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
        got = [run(block, late) for _ in range(3)][-1]  # the third call: the fast path
        assert type(block.fusers()[0].__dict__.get("_fast_step")).__name__ == "FastStep"
        torch.cuda.synchronize(dev)
    finally:
        torch.cuda.set_stream(torch.cuda.default_stream(dev))
        torch.cuda.set_device(0)
    assert torch.equal(got_gemm, want_gemm)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def _ready_batch():
    """A LaunchBatch made ready in this thread with the stand-in runtime (device 0)."""
    batch = triton_launch.LaunchBatch(runtime=_Runtime())
    batch.device, batch.state = 0, triton_launch._direct_state(batch.runtime)
    batch.begin(torch.device("cuda", 0))
    return batch


def test_bound_launch_passes_only_the_tensors_while_its_batch_is_ready():
    """A bound site's later calls go to its bound launch with this thread's stream and the
    tensors; a tensor not 16-byte aligned, another thread, a stale launch state or the
    variable set to 0 launch the normal way."""
    import copy
    import threading

    batch = _ready_batch()
    assert batch.ready and batch.local.stream == 1234
    kernel = _Kernel()
    site = triton_launch.BoundLaunch(kernel, (3,), (7,), {"BLOCK": 16, "FLAG": True}, batch)
    calls = []
    site.go = lambda stream, tensors: calls.append((stream, tensors))
    site.launcher = SimpleNamespace(bound=0)
    x, out = torch.zeros(8), torch.zeros(8)
    site(x, out)
    assert calls == [(1234, (x, out))] and site.launcher.bound == 1 and kernel.log == []
    site(torch.zeros(9)[1:], out)  # misaligned: the normal launch
    assert len(calls) == 1 and [e[0] for e in kernel.log] == ["normal"]
    other = []
    t = threading.Thread(target=lambda: other.append(batch.ready))
    t.start()
    t.join()
    assert other == [False]  # what begin found is this thread's
    batch.runtime.rt.debug = True  # an option the compiled kernel depends on changed
    batch.begin(torch.device("cuda", 0))
    assert not batch.ready
    batch.runtime.rt.debug = False
    batch.begin(torch.device("cuda", 1))  # another device than the bound one
    assert not batch.ready
    copied = copy.deepcopy(site)
    assert copied.go is None and copied.batch is not batch and not copied.batch.ready


def test_launch_batch_is_off_with_the_variable_off(monkeypatch):
    monkeypatch.setenv("TE_OPS_TRITON_DIRECT_LAUNCH", "0")
    batch = triton_launch.LaunchBatch(runtime=_Runtime())
    batch.device, batch.state = 0, ("anything",)
    batch.begin(torch.device("cuda", 0))
    assert not batch.ready and triton_launch._direct_state(batch.runtime) is None
