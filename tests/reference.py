"""An independent float64 reference for te_ops' ops, and the dtype tolerances.

Nothing here imports or calls te_ops: the reference is a per-expert loop of
``torch.nn.functional.linear`` and a plain SwiGLU (``a`` = first half, ``b`` = second half,
``silu(a) * b``), so a bug shared by the library's kernels cannot hide in it.

Conventions
-----------
* Rows (tokens) past the split-size sum are padding: their reference output is zero (a
  constant, so every gradient flowing from those rows is zero too).
* Callers compute the reference from the *same rounded* inputs the library saw: cast the
  library's bf16/fp16/fp32 tensors to float64 with :func:`leaf`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "TOLERANCES",
    "assert_close",
    "leaf",
    "sizes_list",
    "split_arg",
    "grouped_linear",
    "swiglu",
    "scaled_swiglu",
    "bias",
    "grouped_mlp",
    "forward_backward",
]

#: Relative tolerance per dtype (also the absolute tolerance, relative to the max magnitude).
TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.bfloat16: 1.6e-2,
    torch.float16: 1e-3,
    torch.float64: 1e-10,
}


#: Edge cases shared by the test files: name -> (num_groups, rows, split sizes).
EDGE_CASES = {
    "padding": (3, 10, [3, 0, 5]),
    "no_padding": (3, 9, [4, 2, 3]),
    "zero_token_groups": (4, 6, [0, 6, 0, 0]),
    "one_group": (1, 7, [7]),
    "empty_batch": (3, 0, [0, 0, 0]),
}


def leaf(t: torch.Tensor) -> torch.Tensor:
    """A float64 leaf copy of ``t`` that requires grad (the reference's input)."""
    return t.detach().to(torch.float64).requires_grad_(True)


def sizes_list(split_sizes: Sequence[int] | torch.Tensor) -> list[int]:
    """Split sizes as a host list of ints."""
    if isinstance(split_sizes, torch.Tensor):
        return [int(v) for v in split_sizes.cpu().tolist()]
    return [int(v) for v in split_sizes]


def split_arg(sizes: Sequence[int], kind: str,
              device: torch.device | str) -> list[int] | torch.Tensor:
    """Split sizes as the library takes them: a host ``list`` or an int64 device ``tensor``."""
    if kind == "list":
        return list(sizes)
    if kind == "tensor":
        return torch.tensor(list(sizes), dtype=torch.int64, device=device)
    raise ValueError(f"kind must be 'list' or 'tensor', got {kind!r}")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                 name: str = "tensor") -> None:
    """``actual`` (the library's, in ``dtype``) matches the fp64 ``expected``.

    ``rtol = tol`` and ``atol = tol * max|expected|``: errors of long sums scale with the
    largest terms, not with each entry, so compare relative to the tensor's magnitude. An
    all-zero ``expected`` must be matched exactly.
    """
    assert actual is not None, f"{name}: got None, expected a tensor"
    assert tuple(actual.shape) == tuple(expected.shape), (
        f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    tol = TOLERANCES[dtype]
    exp = expected.detach().to(torch.float64).cpu()
    act = actual.detach().to(torch.float64).cpu()
    assert torch.isfinite(act).all(), f"{name}: non-finite values {act}"
    scale = exp.abs().max().item() if exp.numel() else 0.0
    torch.testing.assert_close(act, exp, rtol=tol, atol=tol * scale,
                               msg=lambda m: f"{name} ({dtype}): {m}")


def grouped_linear(x: torch.Tensor, weights: Sequence[torch.Tensor],
                   biases: Sequence[torch.Tensor] | None,
                   split_sizes: Sequence[int] | torch.Tensor,
                   probs: torch.Tensor | None = None) -> torch.Tensor:
    """``y_g = x_g W_g^T + b_g`` (``+ b_g * probs`` rows-wise when ``probs`` is given).

    Shapes: x (..., K) flattened to (M, K), weights[g] (N, K), biases[g] (N,), probs (M,)
    -> (..., N); or a GroupedLinear's packed ``weights()`` / ``biases()`` (one (G, N, K) /
    (G, N) tensor). Rows past ``sum(split_sizes)`` are zero.
    """
    if len(weights) == 1 and weights[0].dim() == 3:  # packed layout: [(G, N, K)]
        weights = list(weights[0].unbind(0))
    if biases is not None and len(biases) == 1 and biases[0].dim() == 2:
        biases = list(biases[0].unbind(0))
    in_features = x.shape[-1]
    out_features = weights[0].shape[0]
    x2d = x.reshape(-1, in_features)
    rows = x2d.shape[0]
    pieces = []
    start = 0
    for g, m in enumerate(sizes_list(split_sizes)):
        y = F.linear(x2d[start:start + m], weights[g])
        if biases:
            if probs is None:
                y = y + biases[g]
            else:
                y = y + probs.reshape(-1)[start:start + m, None] * biases[g]
        pieces.append(y)
        start += m
    assert start <= rows, "reference: split sizes sum past the rows"
    pieces.append(x2d.new_zeros(rows - start, out_features))
    return torch.cat(pieces).reshape(*x.shape[:-1], out_features)


def _glu_columns(width: int, interleave: int | None) -> tuple[list[int], list[int]]:
    """Column indices of ``a`` and ``b`` in a SwiGLU input of last dim ``width``."""
    if interleave is None:
        return list(range(width // 2)), list(range(width // 2, width))
    a_cols = [j for j in range(width) if (j // interleave) % 2 == 0]
    b_cols = [j for j in range(width) if (j // interleave) % 2 == 1]
    return a_cols, b_cols


def swiglu(x: torch.Tensor, interleave: int | None = None) -> torch.Tensor:
    """``silu(a) * b``: ``a`` first half of the last dim, ``b`` second half.

    With ``interleave=s`` the last dim alternates blocks of ``s`` columns: a, b, a, b, ...
    Shapes: (..., 2F) -> (..., F).
    """
    a_cols, b_cols = _glu_columns(x.shape[-1], interleave)
    a = x[..., a_cols]
    b = x[..., b_cols]
    return a * torch.sigmoid(a) * b


def scaled_swiglu(x: torch.Tensor, probs: torch.Tensor,
                  interleave: int | None = None) -> torch.Tensor:
    """``swiglu(x) * probs[..., None]``; probs has one entry per row (token) of ``x``."""
    return swiglu(x, interleave) * probs.reshape(x.shape[:-1]).unsqueeze(-1)


def bias(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``x + b`` along the last dim."""
    return x + b


def grouped_mlp(x: torch.Tensor, split_sizes: Sequence[int] | torch.Tensor,
                probs: torch.Tensor, fc1_weights: Sequence[torch.Tensor],
                fc1_biases: Sequence[torch.Tensor] | None,
                fc2_weights: Sequence[torch.Tensor], fc2_biases: Sequence[torch.Tensor] | None,
                interleave: int | None = None, fc1_probs: torch.Tensor | None = None,
                fc2_probs: torch.Tensor | None = None) -> torch.Tensor:
    """GroupedLinear -> ScaledSwiGLU -> GroupedLinear (the MoE expert block)."""
    h = grouped_linear(x, fc1_weights, fc1_biases, split_sizes, fc1_probs)
    a = scaled_swiglu(h, probs, interleave)
    return grouped_linear(a, fc2_weights, fc2_biases, split_sizes, fc2_probs)


def forward_backward(fn: Callable[[dict[str, torch.Tensor]], torch.Tensor],
                     leaves: dict[str, torch.Tensor], grad_output: torch.Tensor
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run ``fn(leaves)`` in float64 and backpropagate ``grad_output``.

    ``leaves`` maps names to float64 leaves (see :func:`leaf`). Returns the detached output and
    each leaf's gradient (zeros for leaves the output does not depend on, so "no dependence"
    compares as "zero gradient").
    """
    out = fn(leaves)
    names = list(leaves)
    grads = torch.autograd.grad(out, [leaves[k] for k in names],
                                grad_output.detach().to(torch.float64), allow_unused=True)
    return out.detach(), {
        k: (g if g is not None else torch.zeros_like(leaves[k])) for k, g in zip(names, grads)
    }


def assert_module_matches_reference(module: torch.nn.Module,
                                    fn: Callable[[dict[str, torch.Tensor]], torch.Tensor],
                                    x: torch.Tensor, probs: torch.Tensor, y: torch.Tensor,
                                    dy: torch.Tensor, dtype: torch.dtype) -> None:
    """After ``y = module(x, ..., probs, ...)`` and ``y.backward(dy)``: ``y`` and the gradients
    of ``x``, ``probs`` and each of ``module``'s named parameters against the float64
    reference ``fn`` over leaves named ``"x"``, ``"probs"`` and the parameter names (see
    :func:`forward_backward`), at ``dtype``'s tolerance (:func:`assert_close`)."""
    leaves = {"x": leaf(x), "probs": leaf(probs)}
    leaves.update({n: leaf(p) for n, p in module.named_parameters()})
    out, grads = forward_backward(fn, leaves, dy)
    assert_close(y, out, dtype, "output")
    assert_close(x.grad, grads["x"], dtype, "grad of input")
    assert_close(probs.grad, grads["probs"], dtype, "grad of probs")
    for n, p in module.named_parameters():
        assert_close(p.grad, grads[n], dtype, f"grad of {n}")


def expert_params(leaves: dict[str, torch.Tensor], prefix: str, kind: str, groups: int
                  ) -> list[torch.Tensor] | None:
    """The per-expert ``kind`` ("weight" / "bias") tensors of one GroupedLinear among
    ``leaves``, in either parameter layout: ``{prefix}{kind}`` (G, ...) unbound into G
    tensors (packed, the default), or ``{prefix}{kind}0..`` (``single_grouped_weight=False``);
    ``None`` when the layer has neither (no bias)."""
    if prefix + kind in leaves:
        packed = leaves[prefix + kind]
        assert packed.shape[0] == groups, f"{prefix}{kind}: {tuple(packed.shape)}"
        return list(packed.unbind(0))
    if f"{prefix}{kind}0" in leaves:
        return [leaves[f"{prefix}{kind}{g}"] for g in range(groups)]
    return None


def block_forward_backward(block: torch.nn.Module, groups: int, split_sizes: Sequence[int],
                           x: torch.Tensor, probs: torch.Tensor, grad_output: torch.Tensor
                           ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`forward_backward` of :func:`grouped_mlp` with the weights (and biases, where
    fc1 / fc2 have them) of ``block`` (fc1, activation, fc2; ``groups`` experts): the fp64
    output and the gradients of ``"x"``, ``"probs"`` and each parameter, named as in
    ``block.named_parameters()`` (``"0.weight"``, ``"2.bias"``; per-expert ``"0.weight3"``)."""
    fc1, _, fc2 = list(block)
    leaves = {"x": leaf(x), "probs": leaf(probs)}
    leaves.update({f"0.{n}": leaf(p) for n, p in fc1.named_parameters()})
    leaves.update({f"2.{n}": leaf(p) for n, p in fc2.named_parameters()})

    def params(lv, prefix, kind):
        return expert_params(lv, f"{prefix}.", kind, groups)

    def fn(lv):
        return grouped_mlp(lv["x"], split_sizes, lv["probs"], params(lv, 0, "weight"),
                           params(lv, 0, "bias"), params(lv, 2, "weight"),
                           params(lv, 2, "bias"))

    return forward_backward(fn, leaves, grad_output)
