"""Review of stop 12's library changes (bound launches, the fc1 SwiGLU epilogue, the fc1
recompute): CPU tests of the defects found, each failing before its fix.
"""

from __future__ import annotations

import pytest
import torch

import te_ops
from te_ops.kernels import triton_launch


def test_c_launch_leaves_a_gsan_instrumented_launcher_to_its_own_call():
    """Triton 3.9's launcher appends three sanitizer arguments to the kernel's arguments when
    the kernel was compiled with ``TRITON_INSTRUMENTATION_MODE=gsan`` (``gsan_enabled``); the
    bound launch's direct C call would pass the kernel's arguments without them. Such a
    launcher must be called as it is (``_c_launch`` returns ``None``)."""

    class Generic:  # Triton 3.9.0's CudaLauncher.__call__ layout, sanitizer on
        launch, launch_cooperative_grid, launch_pdl = "G", False, False
        arg_annotations, kernel_signature = "ann", "sig"
        global_scratch_size = profile_scratch_size = 0
        gsan_enabled = True

        def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata,
                     launch_metadata, launch_enter_hook, launch_exit_hook, *args):
            kernel_args = args
            if self.gsan_enabled:
                kernel_args = (*args, 1, 2, 3)
            self.launch(gridX, self.launch_cooperative_grid, self.launch_pdl,
                        self.arg_annotations, self.kernel_signature, self.global_scratch_size,
                        self.profile_scratch_size, kernel_args)

    assert triton_launch._c_launch(Generic()) is None
    plain = Generic()
    plain.gsan_enabled = False
    assert triton_launch._c_launch(plain) == ("generic", "G", False, False, "ann", "sig")


def _fake_epilogue(fc1, act, x2d, weights, splits, backend1, probs, recipe):
    """``fc1_swiglu_forward`` as the CUDA gate answers it, on the CPU: not used under a
    recipe, else fc1's GEMM and the activation from torch ops (the fused launch's values)."""
    from te_ops.basic.swiglu import swiglu_forward
    from te_ops.gemm.dispatch import grouped_fprop

    if recipe is not None:
        return None
    backend_act = act.select_backend(x2d.new_empty(0, fc1.out_features))
    h = grouped_fprop(x2d, weights, splits, backend1)
    return h, swiglu_forward(h, None, probs, backend_act), backend_act


def test_epilogue_call_drops_an_earlier_calls_recipe_record(monkeypatch):
    """After a call under a recipe, a call that takes the fc1 SwiGLU epilogue (no recipe)
    must not leave the recipe's note on fc1 in ``explain()`` (the unfused fc1 fprop drops it
    in ``forward_math``, which the epilogue skips)."""
    from te_ops.fused import grouped_mlp
    from te_ops.quantization import Float8CurrentScaling

    monkeypatch.setattr(grouped_mlp, "fc1_swiglu_forward", _fake_epilogue)
    torch.manual_seed(0)
    block = te_ops.Sequential(te_ops.GroupedLinear(4, 32, 64, bias=False),
                              te_ops.ScaledSwiGLU(),
                              te_ops.GroupedLinear(4, 32, 32, bias=False))
    splits = torch.tensor([10, 0, 14, 8])
    probs = torch.rand(32)
    x = torch.randn(32, 32)
    with te_ops.autocast(enabled=True, recipe=Float8CurrentScaling()):
        block(x, splits, probs, splits)
    assert any(k.startswith("recipe ") for k in block[0].__dict__["_dispatch_records"])
    block(x, splits, probs, splits)  # no recipe: the (fake) epilogue runs fc1's fprop
    records = block[0].__dict__["_dispatch_records"]
    assert not any(k.startswith("recipe ") for k in records), records
    assert "Float8CurrentScaling" not in block.explain().split("dispatch:")[1].splitlines()[3]


def test_fc1_swiglu_without_groups_names_the_weights(monkeypatch):
    """``fc1_swiglu`` with G = 0 groups (weights (0, 2F, K), offsets (0,)) raised
    ZeroDivisionError from its config (rows / groups), and the kernel would read the empty
    offsets; a clear ValueError names the argument and the value."""
    from te_ops.gemm import grouped_mlp_triton as gm

    monkeypatch.setattr(gm, "unsupported_reason", lambda *a: None)  # as on a GPU
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    w = torch.randn(0, 16, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"weights .*at least one group.*G=0"):
        gm.fc1_swiglu(x, w, torch.zeros(0, dtype=torch.int32))


@pytest.mark.parametrize("kind", ["fprop", "dgrad"])
def test_triton_rows_without_groups_names_the_weights(monkeypatch, kind):
    """The same input kind for the Triton grouped fprop / dgrad (G = 0)."""
    from te_ops.gemm import grouped_gemm_triton as tg

    monkeypatch.setattr(tg, "unsupported_reason", lambda *a: None)  # as on a GPU
    w = torch.randn(0, 16, 8, dtype=torch.bfloat16)
    a = torch.randn(4, 8 if kind == "fprop" else 16, dtype=torch.bfloat16)
    call = tg.triton_fprop if kind == "fprop" else tg.triton_dgrad
    with pytest.raises(ValueError, match=r"weights .*at least one group.*G=0"):
        call(a, w, torch.zeros(0, dtype=torch.int32))
