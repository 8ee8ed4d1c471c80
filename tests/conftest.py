"""Shared pytest setup: the ``cuda`` marker, env isolation and the device list."""

from __future__ import annotations

import os
import zlib

import pytest
import torch

#: Devices every device-parametrized test runs on: cpu always, cuda when present.
devices: list[str] = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU (skipped without one)")


def _shard() -> tuple[int, int] | None:
    """``TEST_SHARD=k/n`` (0 <= k < n): this process runs the k-th of n disjoint test shards."""
    value = os.environ.get("TEST_SHARD", "")
    if not value:
        return None
    try:
        k, n = (int(part) for part in value.split("/"))
    except ValueError:
        k = n = -1
    if not 0 <= k < n:
        raise pytest.UsageError(f"TEST_SHARD must be 'k/n' with 0 <= k < n, got {value!r}")
    return k, n


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    shard = _shard()
    if shard is not None:
        # A stable hash of the test id (not Python's salted hash()): every process agrees.
        k, n = shard
        keep = [zlib.crc32(i.nodeid.encode()) % n == k for i in items]
        config.hook.pytest_deselected(items=[i for i, m in zip(items, keep) if not m])
        items[:] = [i for i, m in zip(items, keep) if m]
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
    from te_ops.gemm import grouped_mm_unsupported_reason

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
