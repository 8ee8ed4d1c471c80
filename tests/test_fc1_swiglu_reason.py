"""The merged dispatch (the two Gluon families in one ``BackendChoice``):
regression tests of the defects found.

* ``fc1_swiglu_reason`` (recorded for ``explain()`` as "fc1 SwiGLU epilogue") said fc1's
  fprop "runs in the persistent many-rows Triton kernel" also where the choice runs it in the
  warp-specialized Gluon kernel (``"fprop" in gluon_kinds``: a grouped linear of
  ``GLUON_RULE``'s (768 -> 2048) at 512 rows per group used as fc1), and it compared the fused
  launch with the wrong kernel.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from te_ops.gemm import fc1_swiglu_reason
from te_ops.gemm.dispatch import BackendChoice

CUDA = torch.device("cuda")  # only its type is read: no GPU needed
ACT = SimpleNamespace(name="triton", reason="")


@pytest.mark.parametrize("gluon", [(), ("fprop", "dgrad"), ("fprop", "dgrad", "wgrad")])
def test_fc1_swiglu_reason_names_the_kernel_fc1_fprop_runs_in(gluon):
    choice = BackendChoice("triton", "r", True, large_kinds=("fprop", "dgrad"),
                           gluon_kinds=gluon)
    why = fc1_swiglu_reason(choice, ACT, None, False, None, 512.0, CUDA)
    if "fprop" in gluon:
        assert "runs in the warp-specialized Gluon kernel" in why, why
        assert "runs in the persistent" not in why, why
    else:
        assert "persistent many-rows Triton kernel" in why and "Gluon" not in why, why


def test_fc1_epilogue_with_gluon_wgrad_only_is_the_persistent_kernels():
    """A "wgrad" entry of gluon_kinds (the Gluon wgrad) says nothing about fc1's fprop."""
    choice = BackendChoice("triton", "r", True, large_kinds=("fprop", "dgrad"),
                           gluon_kinds=("wgrad",))
    why = fc1_swiglu_reason(choice, ACT, None, False, None, 2048.0, CUDA)
    assert "persistent many-rows Triton kernel" in why, why
