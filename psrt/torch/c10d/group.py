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
its fastest on a host.  CUDA ones are enqueued as ``ProcessGroupNCCL`` enqueues them: on a
stream of the group's own, after it has waited for a ready event recorded on the caller's
current stream, and their work records a done event there; waiting on the work makes the
caller's current stream wait for it, never the host, and holds the tensors until then.  So
DDP's bucket all-reduces run beside the backward that launched them.  A peer that stops is
noticed by whoever next waits on the stream, not by psrt's watchdog.

Sends and receives must not block (``batch_isend_irecv`` posts both directions before
waiting): on the host their works wait for MPI's requests; CUDA ones send their header over
MPI at once and their payload over NCCL (:mod:`psrt.comm.device_messages`), all posted
messages issued as one NCCL group when any work of the group is waited for or the group's
next collective starts, so that a ring of sends and receives never deadlocks.  The first CUDA
call on a group must be a collective (every member makes the group's NCCL communicator),
as torch asks of NCCL groups.  A local mistake (an output of the wrong size) is an error on
that rank before any communication, as in psrt's own API; the others then wait, watched,
for it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from psrt.comm import streams
from psrt.comm.device_messages import DeviceMessage, DeviceMessages
from psrt.comm.direct import DirectGroup
from psrt.comm.header import Kind
from psrt.errors import InvalidArgumentError, UnsupportedOperationError
from psrt.torch.c10d.arguments import (LABEL, check_like, contiguous, even_split, expect_counts, op_of, reduction,
                                       rows_of, single)
from psrt.torch.c10d.work import HostWork, Marked, MessageWork, StreamWork, completed


class PsrtProcessGroup(dist.ProcessGroup):
    """A process group of ``direct``'s members (``direct.ranks`` are their psrt world
    ranks).  Collective like any process group: every member makes the same calls in the
    same order, and each collective first agrees on its kind, dtype, shape and root with
    the other members.  ``release`` frees ``direct`` when torch destroys the group."""

    def __init__(self, direct: DirectGroup, release: Callable[[DirectGroup], None]) -> None:
        super().__init__(direct.rank, direct.size)
        self.direct, self._release = direct, release
        self._name, self._desc = "", ""
        self._host_is_device = streams.api().covers(torch.device("cpu"))  # True on a test's fake device only
        self._streams: dict[torch.device, object] = {}  # the group's own stream per device
        self._messages: DeviceMessages | None = None
        self._posted: list[DeviceMessage] = []  # CUDA sends and receives not yet issued
        self._inside = False  # within a device collective: calls it makes of others run as its part

    # -- identity and life ---------------------------------------------------------------------
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

    def shutdown(self) -> None:
        """Free the group's communicators (``destroy_process_group`` calls it on every member)."""
        self._release(self.direct)

    def __repr__(self) -> str:
        return f"PsrtProcessGroup(ranks={list(self.direct.ranks)}, rank={self.direct.rank})"

    # -- where a call runs ---------------------------------------------------------------------
    def _on_device(self, tensor: torch.Tensor | None) -> bool:
        return tensor is not None and (tensor.is_cuda or self._host_is_device)  # is_cuda: cheaper than .device

    def _covers(self, device: torch.device) -> bool:
        return device.type == "cuda" or (self._host_is_device and device.type == "cpu")

    def _ordered(self, tensor: torch.Tensor | None, outputs: list, run: Callable[[], object],
                 *keep: torch.Tensor) -> dist.Work:
        """Run the collective ``run`` over ``tensor``: at once on the host; for a device tensor
        on this group's stream, after the caller's ready event and after the messages posted
        before it, with a work that records the done event and holds ``outputs`` and ``keep``
        until it is waited for."""
        if self._inside or tensor is None or not (tensor.is_cuda or self._host_is_device):
            run()
            return completed(outputs)
        device = tensor.device
        stream = self._stream(device)
        self._issue()
        cuda = streams.api()
        cuda.wait(stream, cuda.record(cuda.current(device)))
        self._inside = True
        try:
            with cuda.using(stream):
                run()
        finally:
            self._inside = False
        return StreamWork(device, stream, cuda.record(stream), outputs, keep)

    def _stream(self, device: torch.device) -> object:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = streams.api().new_stream(device)
        return stream

    def _issue(self) -> None:
        """Issue every posted send and receive, as one group (their order kept)."""
        if self._posted:
            posted, self._posted = self._posted, []
            self._messages.issue(posted)

    def _device_messages(self, device: torch.device) -> DeviceMessages:
        if self._messages is None:
            self._messages = DeviceMessages(self.direct, device, self._stream(device))
        return self._messages

    # -- reductions ----------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        tensor = single(tensors, "all_reduce")
        if not (tensor.is_cuda or self._host_is_device):  # the host's path, DDP's on a CPU: no more calls than it had
            self._all_reduce(tensor, op_of(opts))
            return completed(tensors)
        return self._ordered(tensor, tensors, lambda: self._all_reduce(tensor, op_of(opts)))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        """One all-reduce per dtype over the tensors packed together."""
        op = op_of(opts)

        def run() -> None:
            for dtype in dict.fromkeys(t.dtype for t in tensors):
                group = [t for t in tensors if t.dtype == dtype]
                packed = torch.cat([t.reshape(-1) for t in group])
                self._all_reduce(packed, op)
                for tensor, part in zip(group, packed.split([t.numel() for t in group])):
                    tensor.copy_(part.view_as(tensor))
        return self._ordered(tensors[0] if tensors else None, tensors, run)

    def _all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp, check: bool = True) -> None:
        reduce, scale = reduction(op, self.direct.size, tensor.dtype)
        flat = contiguous(tensor)
        self.direct.all_reduce_(flat, reduce, label=LABEL, check=check, scale=scale)
        if flat is not tensor:
            tensor.copy_(flat)

    def reduce(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        """An all-reduce into a copy everywhere but the root, whose tensor alone changes;
        the members first agree on the root too."""
        tensor = single(tensors, "reduce")
        reduction(opts.reduceOp, self.direct.size, tensor.dtype)  # refused before any communication

        def run() -> None:
            self.direct.agree_on_call(Kind.REDUCE, tensor, opts.rootRank, label=LABEL)
            target = tensor if self.direct.rank == opts.rootRank else tensor.clone()
            self._all_reduce(target, opts.reduceOp, check=False)
        return self._ordered(tensor, tensors, run)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: object = None) -> dist.Work:
        reduce, scale = reduction(op_of(opts), self.direct.size, input.dtype)
        if not (output.is_cuda or self._host_is_device):
            self._reduce_scatter_into(output, input, reduce, scale)
            return completed([output])
        return self._ordered(output, [output], lambda: self._reduce_scatter_into(output, input, reduce, scale), input)

    def _reduce_scatter_into(self, output: torch.Tensor, input: torch.Tensor, reduce: object, scale: float) -> None:
        out = contiguous(output)
        self.direct.reduce_scatter_into(out, contiguous(input), label=LABEL, op=reduce)
        if scale != 1.0:
            out.mul_(scale)
        if out is not output:
            output.copy_(out)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                       opts: object = None) -> dist.Work:
        output, blocks = single(outputs, "reduce_scatter"), single(inputs, "reduce_scatter")
        check_like(blocks, self.direct.size, output, "reduce_scatter", "input_list")
        return self._ordered(output, outputs, lambda: self._reduce_scatter_base(
            output, torch.cat([b.reshape(-1) for b in blocks]), opts), *blocks)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: object = None) -> dist.Work:
        return self._each(self._reduce_scatter_base, outputs, inputs, opts)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # -- gathers and broadcasts ----------------------------------------------------------------
    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: object = None) -> dist.Work:
        if output.numel() != input.numel() * self.direct.size or output.dtype != input.dtype:
            raise InvalidArgumentError(f"{LABEL} all_gather_into_tensor: the output holds {output.numel()} "
                                       f"{output.dtype} elements, not {self.direct.size} times the input's "
                                       f"{input.numel()} {input.dtype}")
        if not (input.is_cuda or self._host_is_device):
            self._all_gather_into(output, input)
            return completed([output])
        return self._ordered(input, [output], lambda: self._all_gather_into(output, input), input)

    def _all_gather_into(self, output: torch.Tensor, input: torch.Tensor) -> None:
        out = contiguous(output)
        self.direct.all_gather_into(out, contiguous(input), label=LABEL)
        if out is not output:
            output.copy_(out)

    all_gather_single = _allgather_base

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts: object = None) -> dist.Work:
        input, parts = single(inputs, "all_gather"), single(outputs, "all_gather")
        check_like(parts, self.direct.size, input, "all_gather", "tensor_list")

        def run() -> None:
            gathered = torch.empty((self.direct.size, *input.shape), dtype=input.dtype, device=input.device)
            self.direct.all_gather_into(gathered, contiguous(input), label=LABEL)
            for part, value in zip(parts, gathered.unbind(0)):
                part.copy_(value.view_as(part))
        return self._ordered(input, parts, run, input)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: object = None) -> dist.Work:
        return self._each(self._allgather_base, outputs, inputs, opts)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: object = None) -> dist.Work:
        return self._ordered(inputs[0] if inputs else None, [t for parts in outputs for t in parts],
                             lambda: self._each(lambda parts, input, o: self.allgather([parts], [input], o),
                                                outputs, inputs, opts), *inputs)

    def _each(self, call: Callable, outputs: list, inputs: list, opts: object) -> dist.Work:
        """A coalesced call: ``call`` on each (output, input) pair, in order."""
        def run() -> None:
            for output, input in zip(outputs, inputs, strict=True):
                call(output, input, opts)
        return self._ordered(inputs[0] if inputs else None, outputs, run, *inputs)

    def broadcast(self, tensors: list[torch.Tensor], opts: object = None) -> dist.Work:
        tensor = single(tensors, "broadcast")

        def run() -> None:
            flat = contiguous(tensor)
            self.direct.broadcast_(flat, opts.rootRank, label=LABEL)
            if flat is not tensor:
                tensor.copy_(flat)
        return self._ordered(tensor, tensors, run)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: object = None) -> dist.Work:
        """Every member's tensor to the root, as an all-to-all that sends to the root only."""
        input, root, size = single(inputs, "gather"), opts.rootRank, self.direct.size
        mine = self.direct.rank == root
        if mine:
            check_like(single(outputs, "gather"), size, input, "gather", "gather_list")

        def run() -> None:
            self.direct.agree_on_call(Kind.GATHER, input, root, label=LABEL)
            got, _ = self.direct.all_to_all(contiguous(input).view(1, -1), [int(r == root) for r in range(size)],
                                            label=LABEL, received=[int(mine)] * size)
            if mine:
                for part, value in zip(outputs[0], got.unbind(0)):
                    part.copy_(value.view_as(part))
        return self._ordered(input, outputs[0] if mine else [], run, input)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: object = None) -> dist.Work:
        """The root's i-th tensor to member i, as an all-to-all that only the root sends in."""
        output, root, size = single(outputs, "scatter"), opts.rootRank, self.direct.size
        mine = self.direct.rank == root
        if mine:
            check_like(single(inputs, "scatter"), size, output, "scatter", "scatter_list")

        def run() -> None:
            if mine:
                rows = torch.stack([t.reshape(-1) for t in inputs[0]])
            else:
                rows = torch.empty((0, output.numel()), dtype=output.dtype, device=output.device)
            self.direct.agree_on_call(Kind.SCATTER, output, root, label=LABEL)
            out = contiguous(output)
            self.direct.all_to_all(rows, [int(mine)] * size, label=LABEL,
                                   received=[int(r == root) for r in range(size)], out=out.view(1, -1))
            if out is not output:
                output.copy_(out)
        return self._ordered(output, outputs, run, *(inputs[0] if mine else ()))

    # -- all-to-all --------------------------------------------------------------------------
    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: object = None) -> dist.Work:
        """``all_to_all_single``: rows of dim 0, evenly split when no sizes are given."""
        size = self.direct.size
        sends = list(input_split_sizes) or even_split(input, size, "input")
        expected = list(output_split_sizes) or even_split(output, size, "output")

        def run() -> None:
            out = contiguous(output)
            _, got = self.direct.all_to_all(rows_of(input), sends, label=LABEL, out=rows_of(out))
            expect_counts(got, expected, self.direct, "all_to_all_single", "output_split_sizes")
            if out is not output:
                output.copy_(out)
        return self._ordered(input, [output], run, input)

    all_to_all_single = alltoall_base

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: object = None) -> dist.Work:
        """Tensor i to member i, packed into one all-to-all of flat elements."""
        def run() -> None:
            send = torch.cat([t.reshape(-1) for t in inputs]).view(-1, 1)
            wanted = [t.numel() for t in outputs]
            out = torch.empty((sum(wanted), 1), dtype=send.dtype, device=send.device)
            _, got = self.direct.all_to_all(send, [t.numel() for t in inputs], label=LABEL, out=out)
            expect_counts(got, wanted, self.direct, "all_to_all", "the output tensors' sizes")
            for output, part in zip(outputs, out.view(-1).split(wanted)):
                output.copy_(part.view_as(output))
        return self._ordered(inputs[0] if inputs else None, outputs, run, *inputs)

    def barrier(self, opts: object = None) -> dist.Work:
        """The members' hosts meet (on a device, once the messages posted before are issued)."""
        self._issue()
        self.direct.barrier(label=LABEL)
        return completed([])

    # -- coalescing: every call above has been started on return -------------------------------
    def _start_coalescing(self, device: torch.device) -> None:
        return None

    def _end_coalescing(self, device: torch.device) -> dist.Work:
        """The sends and receives posted since go as one group; the work covers everything the
        group's stream was given."""
        on = torch.device(device) if device is not None else None
        if on is None or not self._covers(on):
            return completed([])
        self._issue()
        stream = self._stream(on)
        return StreamWork(on, stream, streams.api().record(stream), [], ())

    # -- point to point ----------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        """Posted at once (never blocking), as ``batch_isend_irecv`` needs; a CUDA tensor's
        payload goes over NCCL when the group next issues its messages (see the module)."""
        tensor = single(tensors, "send")
        if self._on_device(tensor):
            return self._post(self._device_messages(tensor.device).send(tensor, dst, tag), tensors)
        request = self.direct.send(tensor.detach(), dst, tag)
        peer = self.direct.ranks[dst]
        return HostWork([Marked(self.direct, request, f"a {LABEL} send", f"{LABEL} send to rank {peer}", peer)],
                        tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        """Posted at once; waiting checks that the sender sent this tensor's dtype and shape."""
        tensor = single(tensors, "recv")
        kind, what = f"a {LABEL} receive", f"{LABEL} receive from rank {self.direct.ranks[src]}"
        if self._on_device(tensor):
            into = tensor if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format)
            message = self._device_messages(tensor.device).recv(into, src, tag, kind=kind, what=what)
            return self._post(message, tensors, () if into is tensor else (lambda: tensor.copy_(into),))
        into = tensor if tensor.is_contiguous() else torch.empty(tensor.shape, dtype=tensor.dtype)
        request = self.direct.irecv_into(into, src, tag, kind=kind, what=what)
        return HostWork([request], tensors, () if into is tensor else (lambda: tensor.copy_(into),))

    def _post(self, message: DeviceMessage, tensors: list[torch.Tensor],
              after: tuple[Callable[[], object], ...] = ()) -> dist.Work:
        self._posted.append(message)
        return MessageWork(message, self._issue, tensors, after)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> dist.Work:
        raise UnsupportedOperationError(f"{LABEL} recv without a source: psrt's backend receives from a named "
                                        "rank only (pass src=)")
