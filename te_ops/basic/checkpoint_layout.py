"""Why a checkpoint of the other ``GroupedLinear`` weight layout cannot be converted.

``GroupedLinear.load_state_dict`` converts per-expert ``weight{g}`` / ``bias{g}`` entries to
one stacked ``weight`` (experts, out, in) / ``bias`` (experts, out) and back
(:func:`te_ops.basic.grouped_linear.convert_weight_layout`) when the checkpoint holds the
other layout for exactly the layer's experts. Where it holds that layout for another number
of experts, torch's own message lists keys the layer does accept in the other layout ("missing
'weight', unexpected 'weight0', 'weight1'"); :func:`expert_count_errors` gives the messages
that name the experts instead.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["expert_count_errors"]


def _per_expert_indices(state_dict: dict, prefix: str, kind: str) -> list[int]:
    pattern = re.compile(re.escape(prefix + kind) + r"(\d+)")
    return sorted(int(m.group(1)) for k in state_dict
                  if isinstance(k, str) and (m := pattern.fullmatch(k)))


def _names(kind: str, groups: list[int]) -> str:
    shown = ", ".join(f"{kind}{g}" for g in groups[:8])
    return shown + (f", ... ({len(groups)} in all)" if len(groups) > 8 else "")


def expert_count_errors(state_dict: dict, prefix: str, num_groups: int, single: bool,
                        kinds: tuple[str, ...]) -> list[str]:
    """Messages for ``load_state_dict``'s ``error_msgs``: checkpoint entries of the other
    layout whose expert count does not fit the layer.

    Parameters
    ----------
    state_dict : dict
        The checkpoint (keys with ``prefix``).
    prefix : str
        The layer's key prefix.
    num_groups : int
        The layer's experts.
    single : bool
        The layer's layout: ``True`` for one stacked ``weight`` (``single_grouped_weight``).
    kinds : tuple of str
        The parameter names the layer has (``("weight",)`` or ``("weight", "bias")``).

    Returns
    -------
    list of str
        One message per kind that cannot be converted: a single-weight layer given
        per-expert entries that lack some of ``{kind}0..{kind}{G-1}`` (more experts than the
        layer are not reported here: experts 0..G-1 load and the rest are unexpected keys, as
        for a per-expert layer); a per-expert layer given a stacked ``{kind}`` (3-D weight,
        2-D bias; a dense layer's 2-D weight is left to torch's key messages) whose first dim
        (experts) is not ``num_groups``.
    """
    errors = []
    for kind in kinds:
        one = prefix + kind
        if single and one not in state_dict:
            have = _per_expert_indices(state_dict, prefix, kind)
            missing = [g for g in range(num_groups) if g not in have]
            if have and missing:
                errors.append(
                    f"cannot stack per-expert entries into {one} of a single_grouped_weight "
                    f"layer with num_groups={num_groups} (it needs {kind}0..{kind}"
                    f"{num_groups - 1}): the checkpoint has {_names(kind, have)} and is "
                    f"missing {_names(kind, missing)}")
        elif not single and one in state_dict and not _per_expert_indices(state_dict, prefix,
                                                                            kind):
            shape: Any = tuple(getattr(state_dict[one], "shape", ()))
            stacked_dims = 3 if kind == "weight" else 2  # (G, out, in) / (G, out); else dense
            if len(shape) == stacked_dims and shape[0] != num_groups:
                errors.append(
                    f"cannot split the stacked {one} of shape {shape} into per-expert "
                    f"{kind}0..{kind}{num_groups - 1}: it holds {shape[0]} experts, the layer "
                    f"has num_groups={num_groups}")
    return errors
