"""``TE_OPS_FUSION_OFF`` values for tests that switch single fusions on or off."""

from __future__ import annotations


def _on(flag: bool | str) -> bool:
    """A fusion flag given as a bool or as the strings "1" / "0"."""
    return flag if isinstance(flag, bool) else flag == "1"


def fusions_off(**fused: bool | str) -> str:
    """The variable's value for fusion name -> fused? flags: the names whose flag is off,
    comma-separated (``""``: every fusion on)."""
    return ",".join(name for name, flag in fused.items() if not _on(flag))


def set_grouped_mlp(monkeypatch, forward: bool | str, backward: bool | str) -> None:
    """Fused (True / "1") or unfused grouped-MLP forward and backward for this test."""
    monkeypatch.setenv("TE_OPS_FUSION_OFF", fusions_off(grouped_mlp_forward=forward,
                                                        grouped_mlp_backward=backward))
