"""Shared pytest setup: the ``cuda`` marker, env isolation and the device list."""

from __future__ import annotations

import os

import pytest
import torch

#: Devices every device-parametrized test runs on: cpu always, cuda when present.
devices: list[str] = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _clean_te_ops_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts with no TE_OPS_* variable set (and its changes are undone)."""
    for name in list(os.environ):
        if name.startswith("TE_OPS_"):
            monkeypatch.delenv(name, raising=False)


@pytest.fixture(params=[pytest.param(d, marks=[pytest.mark.cuda] if d == "cuda" else [])
                        for d in devices])
def device(request: pytest.FixtureRequest) -> torch.device:
    """Each device of :data:`devices` in turn."""
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _seed() -> None:
    """Deterministic random data in every test."""
    torch.manual_seed(1234)


@pytest.fixture
def use_backend(monkeypatch: pytest.MonkeyPatch):
    """``use_backend(name, device, dtype, *(in_features, out_features))`` forces a grouped GEMM
    backend via ``TE_OPS_GROUPED_GEMM_BACKEND``; skips (with the library's reason) when
    ``grouped_mm`` cannot run one of the given layer shapes."""
    from te_ops.kernels import grouped_mm_unsupported_reason

    def _use(name: str, device: torch.device | str, dtype: torch.dtype,
             *dims: tuple[int, int]) -> None:
        if name == "grouped_mm":
            for in_features, out_features in dims:
                reason = grouped_mm_unsupported_reason(torch.device(device), dtype,
                                                       in_features, out_features)
                if reason is not None:
                    pytest.skip(f"grouped_mm unsupported: {reason}")
        monkeypatch.setenv("TE_OPS_GROUPED_GEMM_BACKEND", name)

    return _use
