"""A ``torch.distributed`` process group whose collectives run on psrt's direct layer.

torch's consumers (DDP, FSDP2, DTensor, ``torch.distributed.pipelining``, distributed
checkpoints) call a process group's methods; this one hands each call to a
:class:`~psrt.comm.direct.DirectGroup`, so it gets what psrt's own tensor-parallel traffic
gets: MPI for host tensors and NCCL for CUDA ones, the cross-rank agreement check (a
mismatched shape is an error on every rank naming two ranks and what each passed), and the
watchdog on every wait (a dead or frozen peer is named, never waited for silently).

torch cannot take a backend written in Python below its ``ProcessGroup`` (its ``Backend``
class has no Python constructor in 2.13), so this is a Python ``ProcessGroup``, the kind
torch's own threaded test group is; torch's checks that look for a C++ backend
(``_get_backend``) do not apply to it.

Collectives run on the caller's thread, as the direct layer's do: MPI's blocking calls are
its fastest on a host, and CUDA ones are enqueued on the current stream.  So a ``Work``
comes back complete on the host; on CUDA it carries the stream's event, and its ``wait()``
makes the waiting stream wait for it.  Sends and receives are the exception: they must
not block (``batch_isend_irecv`` posts both directions before waiting), so their ``Work``
waits for MPI's requests, marked for the watchdog.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from psrt.comm.base import ReduceOp, Request
from psrt.comm.direct import DirectGroup, Kind
from psrt.errors import InvalidArgumentError, UnsupportedOperationError

#: Who runs these collectives, in psrt's errors and stall reports
LABEL = "torch.distributed"

_RedOpType = dist.ReduceOp.RedOpType
_OPS = {_RedOpType.SUM: ReduceOp.SUM, _RedOpType.MIN: ReduceOp.MIN, _RedOpType.MAX: ReduceOp.MAX,
        _RedOpType.PRODUCT: ReduceOp.PRODUCT}


def reduction(op: dist.ReduceOp | _RedOpType, size: int, dtype: torch.dtype) -> tuple[ReduceOp, float]:
    """psrt's reduction and the factor to scale its result by, for torch's ``op``: an
    average is a sum times 1/size, and a pre-multiplied sum a sum times its factor (both
    linear, so scaling after the reduction gives the same result)."""
    if op == _RedOpType.SUM:  # most calls: a comparison costs a fifth of unpacking the op
        return ReduceOp.SUM, 1.0
    kind, factor = (op, None) if isinstance(op, _RedOpType) else op.__getstate__()
    if kind in _OPS:
        return _OPS[kind], 1.0
    if kind in (_RedOpType.AVG, _RedOpType.PREMUL_SUM):
        if not dtype.is_floating_point:
            raise InvalidArgumentError(f"{LABEL}: {kind.name} of a {dtype} tensor: psrt averages and scales "
                                       "floating-point tensors only (sum, then divide)")
        if kind == _RedOpType.AVG:
            return ReduceOp.SUM, 1.0 / size
        return ReduceOp.SUM, float(factor)
    raise UnsupportedOperationError(f"{LABEL}: psrt's backend has no {kind.name} reduction (it has SUM, AVG, "
                                    "PREMUL_SUM, MIN, MAX and PRODUCT)")


def completed(outputs: list[torch.Tensor], tensor: torch.Tensor | None) -> dist.Work:
    """The ``Work`` of a collective that ran on this thread over ``tensor`` (None: no data).
    On the host it is finished; on CUDA its future records the current stream, and waiting
    on it makes the waiting stream wait for that point."""
    if tensor is None or not tensor.is_cuda:
        return HostWork((), outputs)
    future = torch.futures.Future(devices=[tensor.device])
    future.set_result(outputs)
    return _create_work_from_future(future)


class HostWork(dist.Work):
    """Host work: finished when made (a collective), or until MPI's ``requests`` complete (a
    send or a receive, each request marked for the watchdog by whoever made it), then
    ``after`` runs.  A Python ``Work`` costs a fifth of one made from a future, which
    matters on every small collective; the future is made only when asked for."""

    def __init__(self, requests: Sequence[Request], outputs: list[torch.Tensor], after: Sequence = ()) -> None:
        super().__init__()
        self._requests, self._outputs, self._after = requests, outputs, after

    def wait(self, timeout: object = None) -> bool:
        if self._requests or self._after:
            for request in self._requests:
                request.wait()
            for finish in self._after:
                finish()
            self._requests, self._after = (), ()
        return True

    def is_completed(self) -> bool:
        return not self._requests or all([request.test() for request in self._requests])

    def is_success(self) -> bool:
        return self.is_completed()

    def result(self) -> list[torch.Tensor]:
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        self.wait()
        future = torch.futures.Future()
        future.set_result(self._outputs)
        return future


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when it is contiguous, else a contiguous copy to write back."""
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _single(tensors: Sequence[torch.Tensor], call: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise UnsupportedOperationError(f"{LABEL} {call}: psrt's backend takes one tensor per rank "
                                        f"(one device per process), got {len(tensors)}")
    return tensors[0]


class PsrtProcessGroup(dist.ProcessGroup):
    """A process group of ``direct``'s members (``direct.ranks`` are their psrt world
    ranks).  Collective like any process group: every member makes the same calls in the
    same order; with ``check`` (the default) each collective first agrees on its kind,
    dtype, shape and root with the other members."""

    def __init__(self, direct: DirectGroup, *, check: bool = True) -> None:
        super().__init__(direct.rank, direct.size)
        self.direct, self.check = direct, check
        self._name, self._desc = "", ""

    # -- identity torch asks for -------------------------------------------------------------
    def getBackendName(self) -> str:
        return "psrt"

    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:
        return self._name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    @property
    def group_desc(self) -> str:
        return self._desc

    def __repr__(self) -> str:
        return f"PsrtProcessGroup(ranks={list(self.direct.ranks)}, rank={self.direct.rank})"

    # -- reductions ----------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        tensor = _single(tensors, "all_reduce")
        self._all_reduce(tensor, _op(opts))
        return completed(tensors, tensor)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        """One all-reduce per dtype over the tensors packed together."""
        op = _op(opts)
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            group = [t for t in tensors if t.dtype == dtype]
            packed = torch.cat([t.reshape(-1) for t in group])
            self._all_reduce(packed, op)
            for tensor, part in zip(group, packed.split([t.numel() for t in group])):
                tensor.copy_(part.view_as(tensor))
        return completed(tensors, tensors[0] if tensors else None)

    def _all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp) -> None:
        reduce, scale = reduction(op, self.direct.size, tensor.dtype)
        flat = _flat(tensor)
        self.direct.all_reduce_(flat, reduce, label=LABEL, check=self.check, scale=scale)
        if flat is not tensor:
            tensor.copy_(flat)

    def reduce(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        """The all-reduce on a copy everywhere but the root, whose tensor alone changes."""
        tensor = _single(tensors, "reduce")
        target = tensor if self.direct.rank == opts.rootRank else tensor.clone()
        self._all_reduce(target, opts.reduceOp)
        return completed(tensors, tensor)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: object = None) -> dist.Work:
        reduce, scale = reduction(_op(opts), self.direct.size, input.dtype)
        out = _flat(output)
        self.direct.reduce_scatter_into(out, _flat(input), label=LABEL, check=self.check, op=reduce)
        if scale != 1.0:
            out.mul_(scale)
        if out is not output:
            output.copy_(out)
        return completed([output], output)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                       opts: object = None) -> dist.Work:
        output = _single(outputs, "reduce_scatter")
        blocks = _single(inputs, "reduce_scatter")
        self._reduce_scatter_base(output, torch.cat([b.reshape(-1) for b in blocks]).view(-1), opts)
        return completed(outputs, output)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: object = None) -> dist.Work:
        for output, input in zip(outputs, inputs):
            self._reduce_scatter_base(output, input, opts)
        return completed(outputs, outputs[0] if outputs else None)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # -- gathers and broadcasts ----------------------------------------------------------------
    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: object = None) -> dist.Work:
        out = _flat(output)
        if out.numel() != input.numel() * self.direct.size:
            raise InvalidArgumentError(f"{LABEL} all_gather_into_tensor: the output has {out.numel()} elements, "
                                       f"not {self.direct.size} times the input's {input.numel()}")
        self.direct.all_gather_into(out, _flat(input), label=LABEL, check=self.check)
        if out is not output:
            output.copy_(out)
        return completed([output], output)

    all_gather_single = _allgather_base

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: object = None) -> dist.Work:
        input, parts = _single(inputs, "all_gather"), _single(outputs, "all_gather")
        gathered = torch.empty((self.direct.size, *input.shape), dtype=input.dtype, device=input.device)
        self.direct.all_gather_into(gathered, _flat(input), label=LABEL, check=self.check)
        for part, value in zip(parts, gathered.unbind(0)):
            part.copy_(value.view_as(part))
        return completed(parts, input)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: object = None) -> dist.Work:
        for output, input in zip(outputs, inputs):
            self._allgather_base(output, input, opts)
        return completed(outputs, outputs[0] if outputs else None)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: object = None) -> dist.Work:
        for parts, input in zip(outputs, inputs):
            self.allgather([parts], [input], opts)
        return completed([t for parts in outputs for t in parts], inputs[0] if inputs else None)

    def broadcast(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        tensor = _single(tensors, "broadcast")
        flat = _flat(tensor)
        self.direct.broadcast_(flat, opts.rootRank, label=LABEL, check=self.check)
        if flat is not tensor:
            tensor.copy_(flat)
        return completed(tensors, tensor)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: object = None) -> dist.Work:
        """Every member's tensor to the root, as an all-to-all that sends to the root only."""
        input, root, size = _single(inputs, "gather"), opts.rootRank, self.direct.size
        mine = self.direct.rank == root
        rows = _flat(input).view(1, -1)
        self.direct.agree_on_call(Kind.GATHER, input, root, label=LABEL, check=self.check)
        received = [1] * size if mine else [0] * size
        got, _ = self.direct.all_to_all(rows, [int(r == root) for r in range(size)], label=LABEL, received=received)
        if mine:
            for part, value in zip(_single(outputs, "gather"), got.unbind(0)):
                part.copy_(value.view_as(part))
        return completed(outputs[0] if mine else [], input)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: object = None) -> dist.Work:
        """The root's i-th tensor to member i, as an all-to-all that only the root sends in."""
        output, root, size = _single(outputs, "scatter"), opts.rootRank, self.direct.size
        mine = self.direct.rank == root
        self.direct.agree_on_call(Kind.SCATTER, output, root, label=LABEL, check=self.check)
        if mine:
            rows = torch.stack([_flat(t).view(-1) for t in _single(inputs, "scatter")])
        else:
            rows = torch.empty((0, output.numel()), dtype=output.dtype, device=output.device)
        out = _flat(output)
        self.direct.all_to_all(rows, [1] * size if mine else [0] * size, label=LABEL,
                               received=[int(r == root) for r in range(size)], out=out.view(1, -1))
        if out is not output:
            output.copy_(out)
        return completed(outputs, output)

    # -- all-to-all --------------------------------------------------------------------------
    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: object = None) -> dist.Work:
        """``all_to_all_single``: rows of dim 0, evenly split when no sizes are given."""
        size = self.direct.size
        sends = list(input_split_sizes) or _even(input, size, "input")
        expected = list(output_split_sizes) or _even(output, size, "output")
        rows = _flat(input).view(input.shape[0], -1) if input.dim() else input.view(1, 1)
        out = _flat(output)
        received = None if self.check else expected
        _, got = self.direct.all_to_all(rows, sends, label=LABEL, received=received, out=out.view(out.shape[0], -1))
        if got != expected:
            raise InvalidArgumentError(f"{LABEL} all_to_all_single on rank {self.direct.ranks[self.direct.rank]}: "
                                       f"output_split_sizes {expected} but the members send {got}")
        if out is not output:
            output.copy_(out)
        return completed([output], output)

    all_to_all_single = alltoall_base

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: object = None) -> dist.Work:
        """Tensor i to member i, packed into one all-to-all of flat elements."""
        send = torch.cat([t.reshape(-1) for t in inputs]).view(-1, 1)
        out = torch.empty((sum(t.numel() for t in outputs), 1), dtype=send.dtype, device=send.device)
        received = None if self.check else [t.numel() for t in outputs]
        self.direct.all_to_all(send, [t.numel() for t in inputs], label=LABEL, received=received, out=out)
        for output, part in zip(outputs, out.view(-1).split([t.numel() for t in outputs])):
            output.copy_(part.view_as(output))
        return completed(outputs, send)

    def barrier(self, opts: object = None) -> dist.Work:
        self.direct.barrier(label=LABEL)
        return completed([], None)

    # -- coalescing: every call above has completed on return ----------------------------------
    def _start_coalescing(self, device: torch.device) -> None:
        return None

    def _end_coalescing(self, device: torch.device) -> dist.Work:
        return completed([], None)

    # -- point to point ----------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        """Posted at once (never blocking), as ``batch_isend_irecv`` needs; a CUDA tensor
        travels through host memory."""
        tensor = _single(tensors, "send")
        request = self.direct.send(tensor.detach().cpu(), dst, tag)
        peer = self.direct.ranks[dst]
        return HostWork([_Marked(self.direct, request, f"a {LABEL} send", f"{LABEL} send to rank {peer}", peer)],
                           tensors, [])

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        """Posted at once; waiting checks that the sender sent this tensor's dtype and shape."""
        tensor = _single(tensors, "recv")
        into = tensor if tensor.device.type == "cpu" and tensor.is_contiguous() else torch.empty(
            tensor.shape, dtype=tensor.dtype)
        request = self.direct.irecv_into(into, src, tag, kind=f"a {LABEL} receive",
                                         what=f"{LABEL} receive from rank {self.direct.ranks[src]}")
        after = [] if into is tensor else [lambda: tensor.copy_(into)]
        return HostWork([request], tensors, after)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> dist.Work:
        raise UnsupportedOperationError(f"{LABEL} recv without a source: psrt's backend receives from a named "
                                        "rank only (pass src=)")


class _Marked(Request):
    """A request whose wait is marked for the watchdog as waiting on one peer."""

    def __init__(self, direct: DirectGroup, request: Request, kind: str, what: str, peer: int) -> None:
        self._direct, self._request, self._kind, self._what, self._peer = direct, request, kind, what, peer

    def test(self) -> bool:
        return self._request.test()

    def wait(self) -> None:
        self._direct.wait(self._request, self._kind, self._what, (self._peer,))

    def cancel(self) -> None:
        self._request.cancel()


def _op(opts: object) -> dist.ReduceOp | _RedOpType:
    return _RedOpType.SUM if opts is None else opts.reduceOp


def _even(tensor: torch.Tensor, size: int, which: str) -> list[int]:
    rows = tensor.shape[0] if tensor.dim() else 1
    if rows % size:
        raise InvalidArgumentError(f"{LABEL} all_to_all_single: the {which} has {rows} rows, which the group's "
                                   f"{size} ranks do not divide (pass split sizes)")
    return [rows // size] * size
