"""``fc1_swiglu_reason`` (recorded for ``explain()`` as "fc1 SwiGLU epilogue") with the Gluon
kernels in one ``BackendChoice``.

* It names the kernel fc1's fprop runs in: the warp-specialized Gluon kernel where the choice
  runs it there (``"fprop" in gluon_kinds``, e.g. a grouped linear of a Gluon fprop row's
  shape, 768 -> 2048 at 512 rows per group, used as fc1), the persistent many-rows Triton
  kernel otherwise, and compares the fused launch with that kernel.
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
