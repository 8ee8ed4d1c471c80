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
def test_fast_step_uses_direct_launches_and_matches_normal_launches(monkeypatch):
    """The fast path's Triton kernels (GEMMs and SwiGLU) launch from the cache, with the
    same bits as JITFunction.run's launches."""
    pytest.importorskip("triton")
    import te_ops
    from te_ops.kernels import grouped_gemm_triton, swiglu_triton

    monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", "triton")
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

    kernels = (grouped_gemm_triton._rows_kernel, grouped_gemm_triton._wgrad_kernel,
               swiglu_triton._fwd_kernel, swiglu_triton._bwd_kernel)
    monkeypatch.setenv("TE_OPS_TRITON_DIRECT_LAUNCH", "0")
    ref = [step() for _ in range(2)][-1]
    monkeypatch.delenv("TE_OPS_TRITON_DIRECT_LAUNCH")
    before = {k: triton_launch.direct_launcher(k).direct for k in kernels}
    got = [step() for _ in range(3)][-1]
    torch.cuda.synchronize()
    for k in kernels:
        assert triton_launch.direct_launcher(k).direct > before[k], triton_launch.direct_launcher(
            k).stats()
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


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
