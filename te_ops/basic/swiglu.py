"""SwiGLU and ScaledSwiGLU activations.

SwiGLU (Shazeer, "GLU Variants Improve Transformer", 2020): the input's last dim is split in
halves ``a`` (first) and ``b`` (second) and ``out = SiLU(a) * b``. This is TransformerEngine's
convention; note that ``torch.nn.functional.glu`` gates the *other* half (``a * sigmoid(b)``).

With ``glu_interleave_size=s`` the last dim is laid out in blocks of ``s``: ``a`` block, ``b``
block, ``a`` block, ... (as TransformerEngine's ``glu_interleave_size``), which lets a
tensor-parallel or block-quantized fc1 keep matching halves together.

Math is done in float32 (float64 for float64 inputs) and the output cast back to the input
dtype.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..kernels import swiglu_triton
from ..kernels.swiglu_triton import ActivationChoice
from ..op import BasicOperation, OperationContext
from ..shapes import as_shape
from .grouped_linear import check_probs

__all__ = ["SwiGLU", "ScaledSwiGLU", "SwiGLUSaved", "swiglu_forward", "swiglu_backward"]


def _halves(x: torch.Tensor, interleave: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    if interleave is None:
        return x.chunk(2, dim=-1)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // (2 * interleave), 2, interleave)
    a, b = blocks.unbind(-2)
    half = x.shape[-1] // 2  # explicit: -1 is ambiguous for an empty batch
    return a.reshape(*x.shape[:-1], half), b.reshape(*x.shape[:-1], half)


def _join(da: torch.Tensor, db: torch.Tensor, interleave: int | None) -> torch.Tensor:
    if interleave is None:
        return torch.cat([da, db], dim=-1)
    shape = (*da.shape[:-1], da.shape[-1] // interleave, 1, interleave)
    return torch.cat([da.reshape(shape), db.reshape(shape)], dim=-2).reshape(
        *da.shape[:-1], 2 * da.shape[-1])


#: Elements per operand in one row block of the torch SwiGLU passes on the CPU with one
#: intra-op thread: a block's handful of fp32 temporaries (64 Ki elements, 256 KiB each) stays
#: in the core's L2 cache from one pass to the next, so only the inputs and results travel to
#: and from memory. Measured on a 2-core Xeon VM (2 MiB L2 per core), E8 T4096 FF512 fp32
#: (the CPU shape): 128-row blocks take the fused activation
#: backward from 14-20 to 9-10.5 ms (64 Ki best: 9.1 ms against 9.5-9.8 at 96-128 Ki).
CPU_BLOCK_ELEMENTS = 65536

#: Every block but the last holds a multiple of this many elements per operand. aten's CPU
#: elementwise loops run a contiguous range in vector steps (up to 2 x 16 fp32 lanes with
#: AVX512) and the remainder in scalar code, and ``silu`` / ``silu_backward`` round the two
#: differently (1 ulp): with ragged blocks the values would depend on the block size, and the
#: eager (blocked) result would differ from the one-block result of ``torch.compile``.
CPU_BLOCK_ALIGN = 64


def _block_rows(rows: int, half: int, device: torch.device) -> int:
    """Rows per block of the torch SwiGLU passes: L2-sized on the CPU with one intra-op thread
    (rounded so a block holds a multiple of :data:`CPU_BLOCK_ALIGN` elements: the vector and
    scalar parts of each contiguous pass fall where they fall over all rows, so the values are
    bitwise those of one block); all rows otherwise. With several threads every op is split
    over them already, and a loop of small parallel regions stalls whenever one thread is
    descheduled (measured on a loaded 2-core host: steps several times slower). On CUDA a
    launch per block would cost more than it saves; under ``torch.compile`` a Python loop over
    data-dependent row counts does not belong in a graph."""
    if (device.type != "cpu" or rows == 0 or torch.get_num_threads() != 1
            or torch.compiler.is_compiling()):
        return max(rows, 1)
    half = max(half, 1)
    unit = CPU_BLOCK_ALIGN // math.gcd(half, CPU_BLOCK_ALIGN)  # rows per aligned unit
    return max(unit, CPU_BLOCK_ELEMENTS // half // unit * unit)


#: ``explain()``'s names of the fused grouped MLP's epilogue decisions, recorded on the
#: activation op (``fused/fc1_epilogue.py``).
FC1_EPILOGUE = "fc1 SwiGLU epilogue"

#: The per-block aten ops as direct C bindings: the same kernels as ``torch.ops.aten.silu.out``
#: / ``silu_backward.grad_input``, whose Python-level op objects cost ~1.5 and ~1 us more per
#: call (measured on the 2-core CI VM; 32 blocks a pass at the CPU shape). Dispatched through
#: the C++ dispatcher as the op objects are, so AOTAutograd's dispatch-level tracing records
#: the same ops.
#: Dynamo cannot trace the raw ``silu_backward`` binding (a skipped builtin: a graph break, an
#: error under ``fullgraph=True``), so a Dynamo trace calls the op object (:func:`_silu_grad`).
_SILU = torch._C._nn.silu
_SILU_BACKWARD_OP = torch.ops.aten.silu_backward.grad_input
_SILU_BACKWARD = getattr(_SILU_BACKWARD_OP, "_op", _SILU_BACKWARD_OP)
_IS_COMPILING = torch.compiler.is_compiling


def _silu_grad(dy: torch.Tensor, a: torch.Tensor, out: torch.Tensor) -> None:
    """``out = silu_backward(dy, a)`` (aten's ``grad_input`` overload)."""
    if _IS_COMPILING():
        _SILU_BACKWARD_OP(dy, a, grad_input=out)
    else:
        _SILU_BACKWARD(dy, a, grad_input=out)


class _Scratch:
    """Buffers of one row block in the compute dtype, ``(rows, width)`` each, allocated on
    first use once per call and reused by every block (no allocator traffic inside the loop).
    :meth:`of_rows` gives a block's views (the buffers themselves for a full block, their
    first ``n`` rows for the ragged last one), made once per row count. The block views hold
    the buffers, not this object, so no reference cycle keeps the buffers alive past the call
    (they are freed when the call drops its last reference, not at the next garbage
    collection)."""

    def __init__(self, rows: int, width: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.rows, self.dtype = rows, dtype
        self._buffers = _Buffers(rows, width, dtype, device)
        self._whole = _BlockScratch(self._buffers, rows)
        self._tail: _BlockScratch | None = None

    def full(self, name: str) -> torch.Tensor:
        return self._buffers.get(name)

    def of_rows(self, n: int) -> _BlockScratch:
        """The views for an ``n``-row block: every block has ``rows`` rows but the last.
        (Compared, not hashed: under ``torch.compile`` ``n`` may be a SymInt.)"""
        if n == self.rows:
            return self._whole
        if self._tail is None or self._tail.rows != n:
            self._tail = _BlockScratch(self._buffers, n)
        return self._tail


class _Buffers:
    """The full-size scratch buffers of a :class:`_Scratch`, by name, made on first use."""

    def __init__(self, rows: int, width: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.rows, self.width, self.dtype, self.device = rows, width, dtype, device
        self._by_name: dict[str, torch.Tensor] = {}

    def get(self, name: str) -> torch.Tensor:
        buf = self._by_name.get(name)
        if buf is None:
            buf = torch.empty(self.rows, self.width, dtype=self.dtype, device=self.device)
            self._by_name[name] = buf
        return buf


class _BlockScratch:
    """The scratch views of an ``n``-row block, one attribute per buffer name (``s.silu``),
    made on first use: after that a plain attribute read, which the block loop does ~8 times
    a block. ``rows`` and ``dtype`` are the block's row count and the compute dtype."""

    def __init__(self, buffers: _Buffers, n: int) -> None:
        self._buffers, self.rows, self.dtype = buffers, n, buffers.dtype

    def __getattr__(self, name: str) -> torch.Tensor:  # only for names not made yet
        if name.startswith("_"):
            raise AttributeError(name)
        buf = self._buffers.get(name)
        view = buf if self.rows == self._buffers.rows else buf[:self.rows]
        setattr(self, name, view)
        return view


class _Blocks:
    """The row blocks of one SwiGLU call: ``x`` as (n, 2F) rows, its halves, probs as an (n, 1)
    column in the compute dtype, and the scratch every block reuses."""

    def __init__(self, x: torch.Tensor, interleave: int | None,
                 probs: torch.Tensor | None) -> None:
        self.x2 = x if x.dim() == 2 else x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
        self.rows, self.half = self.x2.shape[0], x.shape[-1] // 2
        self.compute = torch.promote_types(x.dtype, torch.float32)  # fp64 inputs keep fp64
        self.step = _block_rows(self.rows, self.half, x.device)
        self.scratch = _Scratch(min(self.step, self.rows), self.half, self.compute, x.device)
        self.probs = None if probs is None else (
            probs.unsqueeze(-1) if probs.dim() == 1 else probs.reshape(-1, 1)).to(self.compute)
        self.a, self.b = _halves(self.x2, interleave)

    def split(self, t: torch.Tensor | None) -> list[torch.Tensor | None]:
        """``t`` (rows first) in the blocks' rows; ``None`` for every block when ``t`` is."""
        if t is None:
            return [None] * -(-max(self.rows, 1) // self.step)
        if self.step >= self.rows:  # one block (CUDA, several threads): no split op
            return [t]
        return list(t.split(self.step))


def _parts(a: torch.Tensor, b: torch.Tensor, s: _BlockScratch):
    """``a``, ``b`` and ``SiLU(a)`` of one row block, in the compute dtype (one ``silu``
    pass); every SwiGLU path (forward, backward, fused recompute) derives its values from
    these, block by block, so they agree bitwise."""
    if a.dtype != s.dtype:
        a, b = s.a.copy_(a), s.b.copy_(b)
    return a, b, _SILU(a, out=s.silu)


def _scaled_product(silu: torch.Tensor, b: torch.Tensor, probs: torch.Tensor | None,
                    dest: torch.Tensor, s: _BlockScratch,
                    silu_b: torch.Tensor | None = None) -> None:
    """``dest = (SiLU(a) * b) * probs``, rounded as written, cast to ``dest.dtype``;
    ``silu_b``: the product ``SiLU(a) * b``, already computed."""
    target = dest if dest.dtype == silu.dtype else s.out
    if silu_b is None:
        torch.mul(silu, b, out=target)
        if probs is not None:
            target.mul_(probs)
    elif probs is not None:
        torch.mul(silu_b, probs, out=target)
    else:
        target.copy_(silu_b)
    if target is not dest:
        dest.copy_(target)


def _forward_torch(x: torch.Tensor, interleave: int | None,
                   probs: torch.Tensor | None) -> torch.Tensor:
    blk = _Blocks(x, interleave, probs)
    out = torch.empty(blk.rows, blk.half, dtype=x.dtype, device=x.device)
    of_rows = blk.scratch.of_rows
    for a, b, p, o in zip(blk.split(blk.a), blk.split(blk.b), blk.split(blk.probs),
                          blk.split(out)):
        s = of_rows(a.shape[0])
        _, b, silu = _parts(a, b, s)
        _scaled_product(silu, b, p, o, s)
    return as_shape(out, (*x.shape[:-1], blk.half))


def _backward_block(a: torch.Tensor, b: torch.Tensor, dyb: torch.Tensor, p: torch.Tensor | None,
                    ga: torch.Tensor, gb: torch.Tensor, gp: torch.Tensor | None,
                    out: torch.Tensor | None, s: _BlockScratch) -> None:
    """One row block of the backward: ``ga`` / ``gb`` (grads of the halves), ``gp`` (grad of
    probs, compute dtype), ``out`` (the forward output) written in place. Each of the few
    passes reads operands that the previous pass left in cache. ``ga`` / ``gb`` may be ``a`` /
    ``b`` and ``out`` may be ``dyb``: each is written after the last read of what it
    overwrites."""
    a, b, silu = _parts(a, b, s)
    dy = dyb if dyb.dtype == s.dtype else s.dy.copy_(dyb)
    silu_b = None
    if p is not None or out is not None:
        silu_b = torch.mul(silu, b, out=s.silu_b)
    if p is not None:  # grad_probs = rowsum(SiLU(a) * b * dy), then dy scaled by probs
        torch.sum(torch.mul(silu_b, dy, out=s.prod), dim=-1, out=gp)
        dy = torch.mul(dy, p, out=s.dy_p)
    dy_b = torch.mul(dy, b, out=s.dy_b)
    torch.mul(dy, silu, out=gb)  # b is dead from here on
    # aten's silu_backward computes dy_b * s * (1 + a * (1 - s)), s = sigmoid(a), in one pass.
    _silu_grad(dy_b, a, ga)
    if out is not None:  # dy is dead too
        _scaled_product(silu, b, p, out, s, silu_b)


def _block_views(blk: _Blocks, dy2: torch.Tensor, grad_x: torch.Tensor, out: torch.Tensor | None,
                 direct: bool) -> list[list]:
    """Per block: ``a``, ``b``, ``dy``, ``grad_x``'s rows (``None`` when ``direct``), the
    gradient halves (views of ``grad_x`` when ``direct``, else ``None``: the block's scratch,
    copied into ``grad_x`` after) and ``out``. Views already made are shared: written over the
    input, the halves' blocks are ``a``'s and ``b``'s; written over ``dy``, ``out``'s are
    ``dy``'s (each view costs ~1 us of host time, 32 blocks a pass)."""
    a, b, dy = blk.split(blk.a), blk.split(blk.b), blk.split(dy2)
    out_views = dy if out is dy2 else blk.split(out)
    if not direct:
        return [a, b, dy, blk.split(grad_x), blk.split(None), blk.split(None), out_views]
    if grad_x is blk.x2:  # direct: no interleave, so a and b are x2's two halves
        return [a, b, dy, blk.split(None), a, b, out_views]
    half = blk.half
    return [a, b, dy, blk.split(None), blk.split(grad_x[:, :half]),
            blk.split(grad_x[:, half:]), out_views]


def _backward_torch(x: torch.Tensor, grad_output: torch.Tensor, interleave: int | None,
                    probs: torch.Tensor | None, with_output: bool, grad_into_input: bool,
                    output_into_grad: bool):
    blk = _Blocks(x, interleave, probs)
    n, half = blk.rows, blk.half
    dy2 = as_shape(grad_output, (n, half))
    # Gradient halves in the compute dtype: written straight into grad_x (over x with
    # grad_into_input) when its layout and dtype allow, else in scratch and copied per block.
    grad_x = blk.x2 if grad_into_input else torch.empty_like(
        blk.x2, memory_format=torch.contiguous_format)
    direct = interleave is None and x.dtype == blk.compute
    gp = None if probs is None else torch.empty(n, dtype=blk.compute, device=x.device)
    out = None
    if with_output:
        out = dy2 if output_into_grad and dy2.dtype == x.dtype else torch.empty(
            n, half, dtype=x.dtype, device=x.device)
    of_rows = blk.scratch.of_rows
    a_s, b_s, dy_s, gx_s, ga_s, gb_s, out_s = _block_views(blk, dy2, grad_x, out, direct)
    for a, b, dy, p, gx, ga, gb, gp_b, o in zip(a_s, b_s, dy_s, blk.split(blk.probs), gx_s,
                                                 ga_s, gb_s, blk.split(gp), out_s):
        s = of_rows(a.shape[0])
        # Not direct: each half in a contiguous scratch of its own, so a pass over contiguous
        # operands runs as one range, as the functional ops of a torch.compile trace do (into
        # strided halves aten runs row by row, whose scalar remainders round silu_backward
        # differently: 1 ulp).
        if not direct:
            ga, gb = s.grad_a, s.grad_b
        _backward_block(a, b, dy, p, ga, gb, gp_b, o, s)
        if interleave is not None:
            gx.copy_(_join(ga, gb, interleave))
        elif not direct:
            gx[:, :half].copy_(ga)
            gx[:, half:].copy_(gb)
    lead = x.shape[:-1]
    grad_probs = None if gp is None else as_shape(gp, lead).to(probs.dtype)
    out = None if out is None else as_shape(out, (*lead, half))
    return as_shape(grad_x, x.shape), grad_probs, out


def swiglu_forward(x: torch.Tensor, interleave: int | None = None,
                   probs: torch.Tensor | None = None,
                   backend: ActivationChoice | None = None) -> torch.Tensor:
    """``SiLU(a) * b`` (times ``probs[..., None]``), computed in fp32, cast to ``x.dtype``.

    Shapes: x (..., 2F), probs (...) -> (..., F). On CUDA this runs one Triton kernel
    (``te_ops.kernels.swiglu_triton``) where it applies; ``backend`` is the choice made for
    this call (``swiglu_triton.select_backend``; chosen here when ``None``). The torch path
    runs in L2-sized row blocks on the CPU (``CPU_BLOCK_ELEMENTS``).
    """
    backend = backend or swiglu_triton.select_backend(x, interleave)
    if backend.name == "triton":
        return swiglu_triton.swiglu_forward(x, probs)
    return _forward_torch(x, interleave, probs)


def swiglu_backward(x: torch.Tensor, grad_output: torch.Tensor,
                    interleave: int | None = None, probs: torch.Tensor | None = None,
                    *, with_output: bool = False, backend: ActivationChoice | None = None,
                    grad_into_input: bool = False, output_into_grad: bool = False):
    """Gradients of :func:`swiglu_forward` w.r.t. ``x`` and ``probs``.

    With ``s = sigmoid(a)``: ``d/da SiLU(a) = s * (1 + a * (1 - s))``.

    Shapes: x (..., 2F), grad_output (..., F) -> (grad_x (..., 2F), grad_probs (...) | None).
    With ``with_output=True`` a third result is the forward output, bitwise equal to
    :func:`swiglu_forward`'s, computed from the same intermediates in the same pass (the fused
    grouped-MLP backward uses it as fc2's wgrad input). ``backend``: the forward's choice
    (saved in :class:`SwiGLUSaved`); chosen here when ``None``. ``grad_into_input=True``
    writes ``grad_x`` over ``x`` (``x`` is then lost): one (..., 2F) buffer less, and on the
    CPU the gradient's stores hit the cache lines the same block just read.
    ``output_into_grad=True`` (torch path; Triton allocates the output) likewise writes the
    output over ``grad_output`` when their dtypes match. The torch path runs in the forward's
    row blocks, each pass reading what the previous one left in cache.
    """
    backend = backend or swiglu_triton.select_backend(x, interleave)
    if backend.name == "triton":
        grad_x, grad_probs, out = swiglu_triton.swiglu_backward(
            x, grad_output, probs, write_output=with_output, grad_into_input=grad_into_input)
        return (grad_x, grad_probs, out) if with_output else (grad_x, grad_probs)
    grad_x, grad_probs, out = _backward_torch(x, grad_output, interleave, probs, with_output,
                                              grad_into_input, output_into_grad)
    return (grad_x, grad_probs, out) if with_output else (grad_x, grad_probs)


@dataclass
class SwiGLUSaved:
    """The one saved-context layout of SwiGLU / ScaledSwiGLU: the input, the probs and the
    kernels the forward chose (the backward and the recompute run the same).

    ``x`` is ``None`` when a fused forward did not save it (``SwiGLU(recompute_input=True)``):
    ``recompute_x(keep=False)`` then returns it, bitwise the forward's, by re-running fc1's
    forward GEMM from fc1's saved context (``te_ops/fused/fc1_recompute.py``); ``keep=True``
    keeps the result for the next call (fc2's input recompute followed by this op's backward
    computes it once). :meth:`input` gives either.
    """

    x: torch.Tensor | None
    probs: torch.Tensor | None
    backend: ActivationChoice | None = None
    recompute_x: Callable[..., torch.Tensor] | None = None

    def save(self, ctx: OperationContext) -> None:
        ctx.save_for_backward(self.x, self.probs)
        ctx.swiglu_layout = {"backend": self.backend, "recompute_x": self.recompute_x}

    @classmethod
    def load(cls, ctx: OperationContext) -> SwiGLUSaved:
        x, probs = ctx.saved_tensors
        layout = ctx.swiglu_layout
        return cls(x, probs, layout["backend"], layout["recompute_x"])

    def input(self, keep: bool = False) -> torch.Tensor:
        """The activation's input (..., 2F): the saved one, or recomputed (``keep``: see the
        class docstring).

        Raises
        ------
        RuntimeError
            The context holds neither the input nor a way to recompute it.
        """
        if self.x is not None:
            return self.x
        if self.recompute_x is None:
            raise RuntimeError("SwiGLU context holds no input and no way to recompute it")
        return self.recompute_x(keep=keep)


class SwiGLU(BasicOperation):
    """``SiLU(a) * b`` with ``a`` the first half of the last dim and ``b`` the second.

    Parameters
    ----------
    glu_interleave_size : int, optional
        Block size of an interleaved layout (see module docstring); ``None`` or ``0`` for
        halves (as TransformerEngine). May be given positionally: ``ScaledSwiGLU(32)``.
    recompute_input : bool, keyword-only
        Opt-in selective recompute (compute for activation memory, as Megatron's selective
        activation recompute): in a ``GroupedLinear (fc1) -> SwiGLU -> GroupedLinear (fc2)``
        chain whose forward runs fused (``ForwardGroupedMLP``), h (this op's input, fc1's
        output, tokens x 2F elements) is not saved; backward re-runs fc1's forward GEMM from
        fc1's saved input and weights (same call, same backend, so h is bitwise the
        forward's): one extra fc1 GEMM per step (2·T·H·2F FLOPs, ~22 % of the step's).
        Where it cannot be honoured, h is saved as with the option off and a warning (once
        per op and reason) and ``explain()`` say why: the forward runs unfused, a recipe
        (``te_ops.autocast``) is active, or fc1 keeps no input (its weights need no
        gradient). Default ``False``.

    Shapes
    ------
    input (..., 2F) -> output (..., F), same dtype (fp32 math inside).

    Numerics
    --------
    ``SiLU(a) = a * sigmoid(a)`` in fp32 (fp64 for fp64 inputs), as ``torch.nn.functional.silu``.
    Below ``a`` of about -88.72 (fp32; -709.78 in fp64) ``exp(-a)`` overflows, so ``SiLU(a)``
    and its derivative are a signed zero, though the true value is still representable down
    to about -103 (|SiLU(a)| < 2.7e-37 there): torch's CPU and CUDA ``silu`` and te_ops' Triton
    kernel (``sigmoid = 1 / (1 + exp(-a))``, then ``a * sigmoid``) all return zero.
    ``a = -inf`` gives NaN (``-inf * 0``) on every path, ``a = +inf`` gives ``inf * b``.

    Raises
    ------
    ValueError
        The last dim is odd or not a multiple of ``2 * glu_interleave_size``.
    TypeError
        ``recompute_input`` is not a bool.
    """

    #: Class default, so modules pickled before the option existed load with it off.
    recompute_input: bool = False

    def __init__(self, glu_interleave_size: int | None = None, *,
                 recompute_input: bool = False) -> None:
        super().__init__()
        if not isinstance(recompute_input, bool):
            raise TypeError(f"recompute_input must be a bool, got "
                            f"{type(recompute_input).__name__} ({recompute_input!r})")
        self.recompute_input = recompute_input
        if glu_interleave_size == 0 and not isinstance(glu_interleave_size, bool):
            glu_interleave_size = None  # TransformerEngine's "no interleave"
        if glu_interleave_size is not None and (
            isinstance(glu_interleave_size, bool) or not isinstance(glu_interleave_size, int)
            or glu_interleave_size < 1
        ):
            raise ValueError(
                "glu_interleave_size must be a positive int, 0 or None, got "
                f"{glu_interleave_size!r}"
            )
        self.glu_interleave_size = glu_interleave_size

    def check_input(self, input_: torch.Tensor) -> None:
        step = 2 * (self.glu_interleave_size or 1)
        if input_.dim() < 1 or input_.shape[-1] % step:
            raise ValueError(
                f"input must have a last dim divisible by {step}, got shape "
                f"{tuple(input_.shape)}"
            )
        if not input_.is_floating_point():
            raise TypeError(f"input must be floating point, got {input_.dtype}")

    def _settings_text(self) -> str:
        parts = ([f"glu_interleave_size={self.glu_interleave_size}"]
                 if self.glu_interleave_size else [])
        return ", ".join(parts + (["recompute_input=True"] if self.recompute_input else []))

    def extra_repr(self) -> str:
        return self._settings_text()

    def record_recompute(self, reason: str | None) -> None:
        """Record this call's ``recompute_input`` decision for ``explain()`` (``reason``:
        ``None`` when honoured, else why h is saved) and, when not honoured, warn once per
        reason (UserWarning naming the op and the reason)."""
        if reason is None:
            self.record_dispatch("fc1 recompute", "on: h is not saved; backward re-runs fc1's "
                                 "forward GEMM from fc1's saved input and weights")
            return
        self.record_dispatch("fc1 recompute", f"off, h is saved: {reason}")
        warned = self.__dict__.setdefault("_recompute_warned", set())
        if reason not in warned:
            warned.add(reason)
            warnings.warn(f"{self.describe()}: recompute_input=True is not honoured, h (fc1's "
                          f"output) is saved: {reason}", UserWarning, stacklevel=3)

    def forget_recompute(self) -> None:
        """Drop the recorded ``recompute_input`` decision: a call with the option off (it is
        a plain attribute, which a user may switch between calls) saves h, and ``explain()``
        must not report an earlier call's decision for it."""
        self.__dict__.get("_dispatch_records", {}).pop("fc1 recompute", None)

    def forget_epilogue(self, kind: str) -> None:
        """Drop the recorded decision of the fused grouped MLP's epilogue ``kind``
        (:data:`FC1_EPILOGUE`): this call's forward (or backward) ran
        the activation unfused, and ``explain()`` must not report an earlier fused call's
        launch for it."""
        self.__dict__.get("_dispatch_records", {}).pop(kind, None)

    def select_backend(self, input_: torch.Tensor) -> ActivationChoice:
        """Choose the SwiGLU kernels for this call, once (saved in the layout, recorded for
        ``explain()``)."""
        choice = swiglu_triton.select_backend(input_, self.glu_interleave_size)
        self.record_dispatch("activation backend", f"{choice.name} ({choice.reason})")
        return choice

    def dispatch_notes(self, info) -> list[str]:
        notes = self._backend_notes(info)
        if self.recompute_input:
            notes.append("fc1 recompute: requested (recompute_input=True); honoured where the "
                         "fused grouped MLP forward runs without a recipe, else h is saved "
                         "(see fusions not applied)")
        return notes

    def _backend_notes(self, info) -> list[str]:
        if info.device is None or info.device.type != "cuda":
            where = "unknown device" if info.device is None else info.device.type
            notes = [f"activation backend: torch ({where}; Triton kernels are CUDA-only)"]
            if info.device is not None:  # the fused launch of fused/fc1_epilogue.py is a
                # Triton kernel too
                why = (f"not used: te_ops' Triton kernels run on CUDA only, this call is on "
                       f"{where}")
                notes += [f"fc1 SwiGLU epilogue: {why}"]
            return notes
        if self.glu_interleave_size is not None:
            return ["activation backend: torch (glu_interleave_size is set)"]
        if swiglu_triton.triton is None:
            return ["activation backend: torch (triton is not installed)"]
        return ["activation backend: triton (one kernel forward, one backward)"]

    def describe(self) -> str:
        return f"{type(self).__name__}({self._settings_text()})"

    def save_unfused(self, ctx, input_: torch.Tensor, probs: torch.Tensor | None,
                     backend: ActivationChoice) -> None:
        """The unfused forward's saved context (h itself: the unfused op cannot re-run fc1,
        so ``recompute_input`` is recorded and warned about as not honoured)."""
        if self.recompute_input:
            self.record_recompute("the activation ran unfused (the fused grouped MLP forward "
                                  "did not cover it; explain() names why)")
        else:
            self.forget_recompute()
        SwiGLUSaved(input_, probs, backend).save(ctx)

    def op_forward(self, ctx, input_, *, recipe=None):
        self.forget_epilogue(FC1_EPILOGUE)
        self.check_input(input_)
        backend = self.select_backend(input_)
        if ctx.requires_grad:
            self.save_unfused(ctx, input_, None, backend)
        return swiglu_forward(input_, self.glu_interleave_size, backend=backend)

    def op_backward(self, ctx, grad_output):
        saved = SwiGLUSaved.load(ctx)
        grad_input, _ = swiglu_backward(saved.input(), grad_output, self.glu_interleave_size,
                                        backend=saved.backend)
        return grad_input, []

    def recompute_output(self, saved: SwiGLUSaved) -> torch.Tensor:
        """The forward output, recomputed bit-identically from the saved context (a
        recomputed input is kept for this op's backward, which follows)."""
        return swiglu_forward(saved.input(keep=True), self.glu_interleave_size, saved.probs,
                              saved.backend)


class ScaledSwiGLU(SwiGLU):
    """``SwiGLU(x) * probs[..., None]``; ``probs`` is an extra input with its own gradient.

    Extra inputs
    ------------
    probs : torch.Tensor
        Shape (tokens,) where tokens = ``input.numel() // input.shape[-1]``, float.

    Raises
    ------
    ValueError / TypeError
        As :class:`SwiGLU`, and ``probs`` of the wrong shape, dtype or device.
    """

    num_extra_inputs = 1

    def extra_input_names(self) -> list[str | None]:
        return ["probs"]

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, recipe=None):
        ctx = basic_op_ctxs[0]
        (probs,) = basic_op_extra_inputs[0]
        self.forget_epilogue(FC1_EPILOGUE)
        self.check_input(input_)
        probs = check_probs(probs, math.prod(input_.shape[:-1]), input_.device,
                            lead_shape=tuple(input_.shape[:-1]))
        probs = as_shape(probs, input_.shape[:-1])
        backend = self.select_backend(input_)
        if ctx.requires_grad:
            self.save_unfused(ctx, input_, probs, backend)
        return swiglu_forward(input_, self.glu_interleave_size, probs, backend), [()]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        saved = SwiGLUSaved.load(basic_op_ctxs[0])
        grad_input, grad_probs = swiglu_backward(saved.input(), grad_output,
                                                 self.glu_interleave_size, saved.probs,
                                                 backend=saved.backend)
        return grad_input, [[]], [[as_shape(grad_probs, (grad_probs.numel(),))]]
