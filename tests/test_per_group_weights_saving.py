"""Saving a block with per-group weights (adjacent slices of one buffer,
docs/architecture.md "single_grouped_weight"): the state dict round-trips through torch.save
and safetensors' ``save_file`` under the per-group names; safetensors' ``save_model`` refuses
the shared storage (documented, so the test pins the behaviour the docs describe)."""

from __future__ import annotations

import io

import pytest
import torch

import te_ops


def _block(single: bool = False) -> te_ops.Sequential:
    torch.manual_seed(0)
    return te_ops.Sequential(
        te_ops.GroupedLinear(4, 8, 16, bias=False, single_grouped_weight=single),
        te_ops.ScaledSwiGLU(),
        te_ops.GroupedLinear(4, 8, 8, bias=False, single_grouped_weight=single))


def test_torch_save_round_trip_keeps_the_per_group_names():
    block = _block()
    buf = io.BytesIO()
    torch.save(block.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert list(loaded) == [f"0.weight{i}" for i in range(4)] + [f"2.weight{i}" for i in range(4)]
    other = _block()
    with torch.no_grad():
        for p in other.parameters():
            p.zero_()
    other.load_state_dict(loaded)
    assert all(torch.equal(a, b) for a, b in zip(block.parameters(), other.parameters()))


def test_safetensors_save_file_of_the_state_dict(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    block = _block()
    path = tmp_path / "block.safetensors"
    st.save_file(block.state_dict(), str(path))
    loaded = st.load_file(str(path))
    assert all(torch.equal(loaded[k], v) for k, v in block.state_dict().items())


def test_safetensors_save_model_refuses_per_group_weights_but_not_a_single_weight(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    with pytest.raises(RuntimeError, match="entire storage"):
        st.save_model(_block(), str(tmp_path / "per_group.safetensors"))
    st.save_model(_block(single=True), str(tmp_path / "single.safetensors"))
