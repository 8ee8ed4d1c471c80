"""Expert parallelism (EP): :class:`AllToAllDispatch` and :class:`AllToAllCombine`.

With ``ep`` ranks in a process group and ``E`` experts, rank ``r`` owns the ``El = E / ep``
experts ``[r * El, (r + 1) * El)``. In ``te_ops.MoE(..., ep_group=group)`` the layer's one
``Sequential`` runs ``Router -> Permute -> AllToAllDispatch -> fc1 -> ScaledSwiGLU -> fc2 ->
AllToAllCombine -> Combine``: ``Permute`` sorts the rows by global expert, hence by owning
rank; the dispatch sends each rank the rows of its experts (an all-to-all) and puts the rows it
receives in local-expert order (rows of local expert 0 from rank 0, 1, ..., then expert 1 ...);
the local experts run on them; the combine puts the outputs back in received order and sends
them home (the reverse all-to-all), where ``Combine`` sums them into token order. The backward
of each all-to-all is the all-to-all with the split lists swapped (Megatron-Core's
``MoEAlltoAllTokenDispatcher``, torchtitan's ``ExpertParallel``). Both ops' index maps are
gathers, so every row moves in a fixed order.

Two modes, the same math:

* **dropless** (``capacity=False``): the per-expert row counts are exchanged on the device (an
  all-to-all of the ``(E,)`` split sizes), then the rows travel by ``all_to_all_single``,
  which takes its split lists on the host: the dispatch copies ``2 * ep`` ints to the host
  once per layer per step (the combine and both backwards reuse them). Such a call is not
  graph-safe and does not trace whole under ``torch.compile`` (the gates say so).
* **capacity** (``capacity=True``, ``te_ops.MoE(capacity_factor=...)``): ``Permute`` gives
  every expert ``C`` rows (dropping past ``C`` by its drop policy, counted), so each rank
  sends ``El * C`` rows to each rank: static splits, no host read, capturable in a CUDA
  graph. Every rank of the group must route the same number of tokens (so the same ``C``);
  the dispatch checks it with an all-gather of ``C`` and a device-side assert.

One rank (``ep`` = 1): both all-to-alls are the identity, so the ops launch no collective and
move no row (Megatron-Core's ``all_to_all`` mapping returns its input for a one-rank group
likewise); dropless mode then reads nothing on the host. One local expert (``El`` = 1): received
order is local-expert order, so the reorders are skipped. ``explain()`` says which applies.

The collectives are :mod:`te_ops.comm`'s functional collectives (gloo on CPU, NCCL on GPUs).
Every rank of the group must run the forward and the backward of the layer (as with any
collective); a ``None`` gradient is sent as zeros.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import comm, env
from ..op import BasicOperation
from ..splits import host_values

__all__ = ["AllToAllDispatch", "AllToAllCombine", "local_order"]


def local_order(recv_counts: torch.Tensor, ep: int, num_local: int, num_rows: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The two index maps between received order and local-expert order, on the device.

    Parameters
    ----------
    recv_counts : (ep * num_local,) int64, rows received from rank ``s`` for local expert
        ``e`` at ``s * num_local + e``.
    ep, num_local, num_rows : ints; ``num_rows = recv_counts.sum()`` (known on the host).

    Returns
    -------
    recv_index : (num_rows,) int64, the received row local row ``i`` holds.
    local_index : (num_rows,) int64, the local row received row ``j`` goes to.
    """
    device = recv_counts.device
    flat = recv_counts.reshape(-1)
    recv_start = torch.cumsum(flat, 0) - flat  # by (s, e)
    by_expert = recv_counts.view(ep, num_local).t().reshape(-1)  # (e, s)
    local_start = (torch.cumsum(by_expert, 0) - by_expert).view(num_local, ep).t().reshape(-1)
    group = torch.repeat_interleave(torch.arange(ep * num_local, device=device), flat,
                                    output_size=num_rows)
    rows = torch.arange(num_rows, device=device)
    local_index = local_start[group] + rows - recv_start[group]
    recv_index = torch.empty_like(local_index).scatter_(0, local_index, rows)
    return recv_index, local_index


def _dropless_host_read_reason(op: str) -> str:
    return (f"{op} (dropless expert parallelism) copies the all-to-all split sizes to the "
            "host once per step (all_to_all_single takes host split lists); "
            "te_ops.MoE(capacity_factor=...) gives static splits without a host read")


class _EPOp(BasicOperation):
    """What the two ops share: the group, its size and rank, the mode."""

    def _setup(self, num_experts: int, group: Any, capacity: bool) -> None:
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
        ep, rank = comm.check_group(group)
        if num_experts % ep:
            raise ValueError(f"num_experts must be divisible by the ep_group's size {ep}, got "
                             f"{num_experts}")
        if not isinstance(capacity, bool):
            raise TypeError(f"capacity must be a bool, got {type(capacity).__name__}")
        self.num_experts = num_experts
        self.ep_size, self.ep_rank = ep, rank
        self.num_local_experts = num_experts // ep
        self.capacity = capacity
        self._group = comm.GroupRef(group)

    @property
    def group(self) -> Any:
        """The expert-parallel process group."""
        return self._group.group

    @property
    def local_experts(self) -> range:
        """The global ids of this rank's experts."""
        start = self.ep_rank * self.num_local_experts
        return range(start, start + self.num_local_experts)

    @property
    def one_rank(self) -> bool:
        """A one-rank group: the all-to-all is the identity, no collective is launched."""
        return self.ep_size == 1

    @property
    def reorders(self) -> bool:
        """Whether received order differs from local-expert order (several ranks and several
        local experts); otherwise the rows are not reordered."""
        return self.ep_size > 1 and self.num_local_experts > 1

    def _mode(self) -> str:
        if self.one_rank:
            return "one rank: identity, no collective, no host read"
        if self.capacity:
            return "capacity: static splits, no host read"
        if isinstance(self, AllToAllCombine):
            return "dropless: the dispatch's host split lists"
        return "dropless: one host read of the split sizes per step"

    def describe(self) -> str:
        experts = self.local_experts
        return (f"{type(self).__name__}(ep={self.ep_size}, rank {self.ep_rank}: experts "
                f"{experts.start}..{experts.stop - 1} of {self.num_experts}, {self._mode()})")

    def host_sync_reason(self) -> str | None:
        if self.capacity or self.one_rank:
            return None
        return _dropless_host_read_reason(type(self).__name__)

    def _splits(self, num_rows: int, a2a_splits: torch.Tensor | None
                ) -> tuple[list[int], list[int]]:
        """(send, receive) split lists of the dispatch: static in capacity mode
        (``num_rows``, the op's input rows, is ``ep * El * C`` in either op), else the host
        copy of ``a2a_splits`` (2 * ep,), read once per fuser forward."""
        ep = self.ep_size
        if self.capacity:
            return [num_rows // ep] * ep, [num_rows // ep] * ep
        if env.read("TE_OPS_GRAPH_SAFE") == "1":
            raise RuntimeError(f"TE_OPS_GRAPH_SAFE=1 forbids host syncs: "
                               f"{_dropless_host_read_reason(type(self).__name__)}")
        values = host_values(a2a_splits, source=a2a_splits)
        return values[:ep], values[ep:]


class AllToAllDispatch(_EPOp):
    """Rows sent to the ranks that own their experts, in local-expert order there.

    Parameters
    ----------
    num_experts : int
        All experts of the layer (``E``), divisible by the group's size.
    group : torch.distributed.ProcessGroup
        The expert-parallel group (gloo on CPU, NCCL on GPUs).
    capacity : bool
        Static capacity mode (every expert gets the same number of rows ``C``, the input's
        rows being ``E * C``); ``False``: dropless.

    Extra inputs
    ------------
    split_sizes : (E,) integer tensor, rows per global expert (``Permute``'s; they sum to the
        rows: padding rows are refused in dropless mode).
    probs : (R,) float, each row's routing weight.

    Extra outputs
    -------------
    split_sizes : (El,) int64, rows per local expert (for fc1 and fc2).
    probs : (N,) the received rows' weights in local order (for ``ScaledSwiGLU``).
    a2a_splits : (2 * ep,) int64, rows sent to and received from each rank.
    recv_index, local_index : (N,) int64, the maps of :func:`local_order` (for
        :class:`AllToAllCombine`).

    Shapes
    ------
    Main input (R, hidden) -> main output (N, hidden), N the rows received (in capacity mode
    ``ep * El * C``).

    Raises
    ------
    ValueError / TypeError
        Bad constructor arguments; extra inputs of the wrong shape, dtype or device; in
        dropless mode split sizes that do not sum to the rows; in capacity mode rows not a
        multiple of ``E``.
    RuntimeError
        Capacity mode where the ranks' capacities differ (a device-side assert: the ranks
        routed different token counts); dropless mode under ``TE_OPS_GRAPH_SAFE=1`` (several
        ranks); on one rank, dropless split sizes that do not sum to the rows (a device-side
        assert: one rank reads no host value).
    """

    num_extra_inputs = 2
    num_extra_outputs = 5

    def __init__(self, num_experts: int, group: Any, *, capacity: bool = False) -> None:
        super().__init__()
        self._setup(num_experts, group, capacity)

    def extra_input_names(self) -> list[str | None]:
        return ["split_sizes", "probs"]

    def extra_output_names(self) -> list[str | None]:
        return ["split_sizes", "probs", "a2a_splits", "recv_index", "local_index"]

    def dispatch_notes(self, info: Any) -> list[str]:
        device = info.device if info is not None and info.device is not None else None
        return [f"all-to-all: {self._transport(device)}"]

    def _transport(self, device: torch.device | None) -> str:
        """Which all-to-all runs and why (cached per device type: it is asked every call)."""
        key = None if device is None else device.type
        cache = self.__dict__.setdefault("_transport_text", {})
        if key not in cache:
            cache[key] = self._describe_transport(device)
        return cache[key]

    def _describe_transport(self, device: torch.device | None) -> str:
        backend = comm.backend(self.group)
        if self.one_rank:
            return (f"none: the {backend} group has one rank, so the all-to-all is the "
                    "identity (no collective launched, no host read)")
        if self.capacity:
            return (f"all_to_all_single over {backend} with static splits "
                    "(El * C rows per rank), no host read")
        why = ("device unknown (planned without a call)" if device is None else
               comm.device_splits_unavailable_reason(self.group, device))
        return (f"all_to_all_single over {backend} with host split lists (one "
                f"host read per step); device split sizes (all_to_all_vdev_2d) not used: {why}")

    def _check(self, x: Any, split_sizes: Any, probs: Any) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"input must be a (rows, hidden) tensor, got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
        for name, t, shape in (("split_sizes", split_sizes, (self.num_experts,)),
                               ("probs", probs, (x.shape[0],))):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
            if t.device != x.device:
                raise ValueError(f"{name} must be on the input's device {x.device}, got "
                                 f"{t.device}")
        if split_sizes.is_floating_point() or split_sizes.dtype == torch.bool:
            raise TypeError(f"split_sizes must have an integer dtype, got {split_sizes.dtype}")
        if not probs.is_floating_point():
            raise TypeError(f"probs must have a floating-point dtype, got {probs.dtype}")
        if self.capacity and x.shape[0] % self.num_experts:
            raise ValueError(f"input must have a multiple of num_experts={self.num_experts} "
                             f"rows in capacity mode (C rows per expert), got {x.shape[0]}")

    def _capacity_counts(self, x: torch.Tensor) -> torch.Tensor:
        """Capacity mode: the static per-(rank, local expert) counts, after checking on the
        device that every rank has the same capacity."""
        cap = x.shape[0] // self.num_experts
        mine = torch.full((1,), cap, dtype=torch.int64, device=x.device)
        every = comm.all_gather(mine, self.group, self.ep_size)
        torch._assert_async(
            (every == cap).all(),
            "te_ops AllToAllDispatch (capacity mode): the ranks of the ep_group have different "
            "capacities (rows per expert): every rank must route the same number of tokens")
        return mine.expand(self.ep_size * self.num_local_experts)

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, recipe=None):
        ctx = basic_op_ctxs[0]
        split_sizes, probs = basic_op_extra_inputs[0]
        self._check(input_, split_sizes, probs)
        if self.one_rank:
            return self._forward_one_rank(ctx, input_, split_sizes, probs)
        ep, el = self.ep_size, self.num_local_experts
        if self.capacity:
            recv_counts = self._capacity_counts(input_)
            a2a_splits = recv_counts.new_full((2 * ep,), input_.shape[0] // ep)
        else:
            recv_counts = comm.all_to_all(split_sizes.long(), [el] * ep, [el] * ep, self.group)
            per_rank = torch.stack([split_sizes.long().view(ep, el).sum(1),
                                    recv_counts.view(ep, el).sum(1)])
            a2a_splits = per_rank.reshape(-1)
        send, recv = self._splits(input_.shape[0], a2a_splits)
        if sum(send) != input_.shape[0]:
            raise ValueError(f"split_sizes must sum to the input's {input_.shape[0]} rows "
                             f"(expert-parallel dispatch sends every row), got {sum(send)}")
        num_rows = sum(recv)
        rows = comm.all_to_all(input_, recv, send, self.group)
        row_probs = comm.all_to_all(probs, recv, send, self.group)
        recv_index, local_index = local_order(recv_counts, ep, el, num_rows)
        local_splits = recv_counts.reshape(ep, el).sum(0)
        if ctx.requires_grad:
            ctx.save_for_backward(local_index)
            ctx.splits = (send, recv)
            ctx.output_shape, ctx.dtype = (num_rows, input_.shape[1]), input_.dtype
            ctx.probs_dtype = probs.dtype
        self.record_dispatch("all-to-all", self._transport(input_.device))
        if self.reorders:
            rows, row_probs = rows[recv_index], row_probs[recv_index]
        return rows, [(local_splits, row_probs, a2a_splits, recv_index, local_index)]

    def _forward_one_rank(self, ctx: Any, input_: torch.Tensor, split_sizes: torch.Tensor,
                          probs: torch.Tensor) -> tuple[torch.Tensor, list]:
        """``ep`` = 1: every row stays, in order; the extra outputs as a one-rank all-to-all
        would give them, computed on the device (dropless split sizes are checked to sum to
        the rows by a device-side assert: no host read)."""
        rows = input_.shape[0]
        if self.capacity:
            local_splits = split_sizes.new_full((self.num_experts,), rows // self.num_experts,
                                                dtype=torch.int64)
        else:
            local_splits = split_sizes.long()
            torch._assert_async(
                local_splits.sum() == rows,
                "te_ops AllToAllDispatch: split_sizes must sum to the input's rows (the "
                "expert-parallel dispatch sends every row)")
        index = torch.arange(rows, device=input_.device)
        if ctx.requires_grad:
            ctx.output_shape, ctx.dtype, ctx.device = tuple(input_.shape), input_.dtype, \
                input_.device
            ctx.probs_shape, ctx.probs_dtype = tuple(probs.shape), probs.dtype
        self.record_dispatch("all-to-all", self._transport(input_.device))
        return input_, [(local_splits, probs, local_splits.new_full((2,), rows), index, index)]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        ctx = basic_op_ctxs[0]
        grad_probs_out = basic_op_grad_extra_outputs[0][1]
        if self.one_rank:
            grad_input = grad_probs = None
            if ctx.input_requires_grad:
                grad_input = grad_output if grad_output is not None else torch.zeros(
                    ctx.output_shape, dtype=ctx.dtype, device=ctx.device)
            if ctx.extra_input_requires_grad(1):
                grad_probs = (grad_probs_out.reshape(ctx.probs_shape)
                              if grad_probs_out is not None else None)
            return grad_input, [[]], [[None, grad_probs]]
        (local_index,) = ctx.saved_tensors
        send, recv = ctx.splits
        grad_input = grad_probs = None
        if ctx.input_requires_grad:
            g = grad_output if grad_output is not None else local_index.new_zeros(
                ctx.output_shape, dtype=ctx.dtype)  # None: a zero gradient (still sent)
            grad_input = comm.all_to_all(g[local_index] if self.reorders else g, send, recv,
                                         self.group)
        if ctx.extra_input_requires_grad(1):
            g = grad_probs_out
            if g is None:
                g = local_index.new_zeros(local_index.shape, dtype=ctx.probs_dtype)
            g = g.reshape(-1)
            grad_probs = comm.all_to_all(g[local_index] if self.reorders else g, send, recv,
                                         self.group)
        return grad_input, [[]], [[None, grad_probs]]


class AllToAllCombine(_EPOp):
    """The experts' output rows sent back to the ranks they came from, in the order the
    paired :class:`AllToAllDispatch` received them from each (the reverse all-to-all).

    Parameters
    ----------
    dispatch : AllToAllDispatch
        The dispatch whose rows come back (its group, experts and mode are taken).

    Extra inputs
    ------------
    a2a_splits, recv_index, local_index : the dispatch's extra outputs of the same names. In
        dropless mode the split lists are the dispatch's host copy (one read per step while
        both ops run in one fuser, as in ``te_ops.MoE``; a fuser boundary between them, e.g.
        a module hook, reads them again).

    Shapes
    ------
    Main input (N, hidden) in local-expert order -> main output (R, hidden) in the source
    rank's ``Permute`` order.

    Raises
    ------
    TypeError / ValueError
        ``dispatch`` not an AllToAllDispatch; index maps not (N,) int64.
    """

    num_extra_inputs = 3

    def __init__(self, dispatch: AllToAllDispatch) -> None:
        super().__init__()
        if not isinstance(dispatch, AllToAllDispatch):
            raise TypeError(f"dispatch must be an AllToAllDispatch, got "
                            f"{type(dispatch).__name__}")
        self._setup(dispatch.num_experts, dispatch.group, dispatch.capacity)

    def extra_input_names(self) -> list[str | None]:
        return ["a2a_splits", "recv_index", "local_index"]

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, recipe=None):
        ctx = basic_op_ctxs[0]
        a2a_splits, recv_index, local_index = basic_op_extra_inputs[0]
        n = input_.shape[0] if isinstance(input_, torch.Tensor) and input_.dim() == 2 else None
        for name, t in (("recv_index", recv_index), ("local_index", local_index)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or (
                    tuple(t.shape) != (n,)):
                raise ValueError(f"{name} must be a ({n},) int64 tensor (one entry per input "
                                 f"row), got {getattr(t, 'dtype', type(t).__name__)} "
                                 f"{tuple(getattr(t, 'shape', ()))}")
        if self.one_rank:
            if ctx.requires_grad:
                ctx.output_shape, ctx.dtype, ctx.device = tuple(input_.shape), input_.dtype, \
                    input_.device
            return input_, [()]
        send, recv = self._splits(n, a2a_splits)  # the dispatch's send / receive lists
        out = comm.all_to_all(input_[local_index] if self.reorders else input_, send, recv,
                              self.group)
        if ctx.requires_grad:
            ctx.save_for_backward(recv_index)
            ctx.splits = (send, recv)
            ctx.output_shape, ctx.dtype = tuple(out.shape), out.dtype
        return out, [()]

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
        ctx = basic_op_ctxs[0]
        if self.one_rank:
            if grad_output is None:
                grad_output = torch.zeros(ctx.output_shape, dtype=ctx.dtype, device=ctx.device)
            return grad_output, [[]], [[None, None, None]]
        (recv_index,) = ctx.saved_tensors
        send, recv = ctx.splits
        if grad_output is None:  # a zero gradient, still sent: the other ranks wait for it
            grad_output = recv_index.new_zeros(ctx.output_shape, dtype=ctx.dtype)
        grad = comm.all_to_all(grad_output, recv, send, self.group)
        return (grad[recv_index] if self.reorders else grad), [[]], [[None, None, None]]
