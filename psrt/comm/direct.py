"""The direct layer: checked collectives and messages that the calling thread runs itself.

Tensor- and pipeline-parallel traffic and parameter-server requests sit on a step's
critical path.  They cannot afford the engine thread's negotiation (about 0.4 ms a call on
a CPU host) and do not need it: every rank makes the same calls in the same order by
construction.  What negotiation would have caught, they get here, once for all of them:

* one header format and one dtype table (:mod:`psrt.comm.header`), by which messages and
  calls say what they carry;
* one cross-rank agreement check (:mod:`psrt.comm.agreement`): a small all-reduce of the
  call's digest tells every rank whether all made the same call, else every rank raises
  the same :class:`~psrt.errors.CollectiveMismatchError` naming two ranks and what each
  passed;
* one watchdog, handed to the group by whoever opened it, which marks every wait: a peer
  that stops answering is named, never waited for silently;
* waits for messages that spin briefly and then nap (:func:`psrt.comm.poll.wait_politely`);
  collectives wait in the transport's own blocking calls instead, which are faster than
  polling: MPI's blocking all-reduce picks its best algorithm (its non-blocking one of
  256 KB takes 1.7 times as long on 2 ranks), and its wait drives the collective's steps.

A :class:`DirectGroup` runs on a communicator of its own, never the engine thread's (two
threads must not run collectives on one communicator).  The caller guarantees what MPI
requires: every member calls the group's collectives in the same order.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence

import torch

from psrt.comm.agreement import Agreement
from psrt.comm.base import Communicator, ElementwiseOp, Request, all_of
from psrt.comm.deadlock import DIRECT, RECEIVE
from psrt.comm.header import HEADER_WORDS, MAX_DIMS, Header, Kind, check_divisible
from psrt.comm.keyed import OP_ARGS, ONCE, KnownCalls
from psrt.comm.nccl import NcclCommunicator
from psrt.comm.poll import wait_politely
from psrt.comm import streams
from psrt.comm.staged import device_transport
from psrt.comm.waits import Text, Wait
from psrt.comm.watchdog import Watchdog
from psrt.errors import CollectiveMismatchError, CommunicationError, InvalidArgumentError

#: What a barrier agrees on: no data
_NO_DATA = torch.empty(0)


class DirectGroup:
    """The members of one process set (or the ranks of a job), for direct traffic.

    ``host`` is a communicator of the group's own; ``ranks[r]`` names its rank r to the
    watchdog, as a rank of psrt's world or, with ``job_ranks``, of the whole job (the
    parameter servers are outside psrt's world).  ``name`` says what the group is in
    stall reports and errors (a function is evaluated only when one is written).
    Collectives take a ``label`` saying who runs them ("tensor-parallel"), for the same
    texts, and ``check``, whether to run the agreement check first: on every call (True), or
    once per (collective, dtype, shape, op) (``"once"``, :mod:`psrt.comm.keyed`; on every
    call where the watchdog has no breaker to end a mismatch).  A CUDA communicator is
    made on a device's first collective, collectively over the members.  ``key`` tells the
    group apart from any other of the same members, alike on every member (a process set's
    id): deadlock detection compares the members' calls by it.
    """

    def __init__(self, host: Communicator, ranks: Sequence[int], watchdog: Watchdog, *, key: object,
                 name: Text = "a direct group", job_ranks: bool = False) -> None:
        self.host, self.ranks = host, tuple(ranks)
        self.rank, self.size = host.rank, host.size
        self._watchdog, self._name, self._job_ranks = watchdog, name, job_ranks
        self._devices: dict[int, Communicator] = {}
        self._agreement = Agreement(host, self.ranks, lambda: self.name)
        self._marks: dict[tuple, Wait] = {}  # by (label, call, thread): see _collective
        self._calls = 0  # collectives begun on the group: see _collective
        self._ident = f"{key} of ranks {self.ranks}"  # the group, the same on every member
        self._known = KnownCalls(host, self._agreement, self._ident, lambda: self.name)
        self._breaker = getattr(watchdog, "breaker", None)
        if self._breaker is not None:
            self._breaker.register(self._known)

    @property
    def agreements(self) -> int:
        """How many agreement checks (each one small all-reduce) the group has run."""
        return self._agreement.exchanges

    @property
    def name(self) -> str:
        return self._name() if callable(self._name) else self._name

    def transport(self, device: torch.device) -> Communicator:
        """The communicator that carries tensors on ``device`` (NCCL for CUDA memory, host
        staging where members share a GPU: :mod:`psrt.comm.staged`)."""
        cuda = streams.api()
        if not cuda.covers(device):
            return self.host
        index = cuda.index(device)
        comm = self._devices.get(index)
        if comm is None:
            comm = self._devices[index] = device_transport(self.host, torch.device(device.type, index))
        return comm

    # -- waits ------------------------------------------------------------------------------
    def waiting(self, kind: str, what: Text, peers: Sequence[int] | None = None, *, ident: tuple | None = None,
                needs: Callable[[], Sequence[int] | None] | None = None) -> Wait:
        """Mark the calling thread as waiting on ``peers`` (ranks as the group names them;
        default every member) for the block's duration; ``ident`` and ``needs`` make it a
        call (see :class:`~psrt.comm.waits.Wait`)."""
        peers = self.ranks if peers is None else peers
        if self._job_ranks:
            return self._watchdog.waiting(kind, what, job_peers=peers, ident=ident, needs=needs)
        return self._watchdog.waiting(kind, what, peers, ident=ident, needs=needs)

    def wait(self, request: Request, kind: str, what: Text, peers: Sequence[int] | None = None) -> None:
        """Wait for ``request`` politely, marked for the watchdog."""
        if not request.test():
            with self.waiting(kind, what, peers):
                wait_politely(request)

    def _collective(self, label: str, call: str) -> Wait:
        """The mark of the group's next collective, made once per (label, call, thread): a
        mark serves one thread, and making one costs more than a small collective's other
        Python.  Its identity, the group and the collective's number in it, is the same on
        every member (they call the group's collectives in the same order)."""
        key = (label, call, threading.get_ident())
        mark = self._marks.get(key)
        if mark is None:
            me = self.ranks[self.rank]
            mark = self._marks[key] = self.waiting(f"a {label} collective",
                                                   lambda: f"{label} {call} on rank {me} over {self.name}")
        self._calls += 1
        mark.ident = (DIRECT, self._ident, self._calls)
        return mark

    @staticmethod
    def _complete(comm: Communicator, request: Request) -> None:
        """Host collectives complete here (in MPI's own wait); CUDA ones are ordered on the
        stream, so the host need not wait for them."""
        if not isinstance(comm, NcclCommunicator):
            request.wait()

    # -- agreement --------------------------------------------------------------------------
    def _prepare(self, kind: Kind, tensor: torch.Tensor, label: str, check: bool | str, args: tuple[int, ...] = (),
                 mark: Wait | None = None, op: ElementwiseOp | None = None) -> Communicator:
        """What every collective does first, inside its marked wait ``mark``; returns the
        communicator that carries its data (a channel of its own, for ``check="once"``).
        ``"once"`` checks every call where nothing could end a mismatch: without a breaker,
        or off the thread whose calls deadlock detection watches (the main thread)."""
        if not self._agreement.settled:
            self._agreement.settle(label, check)
        if check:
            breaker = self._breaker
            if check != ONCE or mark is None or breaker is None or \
                    breaker.watched_thread not in (None, threading.get_ident()):
                self._agreement.on_call(kind, tensor, label, args)
            else:
                comm = self._known.route(kind, tensor, label, args if op is None else args + OP_ARGS[op], mark)
                if comm is not None:
                    return comm
        return self.transport(tensor.device)

    def agree(self, header: Header, label: str) -> None:
        """Raise the same :class:`CollectiveMismatchError` on every member unless all passed
        equal headers: one small all-reduce (the maximum of the digest and of its negation)
        when they did, and a gather of the headers, to name what differs, when they did not.
        Collective over the group; the caller marks the wait."""
        self._agreement.check(header, label)

    # -- collectives ------------------------------------------------------------------------
    def all_reduce_(self, tensor: torch.Tensor, op: ElementwiseOp = ElementwiseOp.SUM, *, label: str,
                    check: bool = True, scale: float = 1.0) -> torch.Tensor:
        """Reduce a contiguous ``tensor`` in place over the group, then multiply it by
        ``scale`` (an average's 1/size, folded into the reduction where the transport can);
        returns it."""
        mark = self._collective(label, "all_reduce")
        with mark:
            self._prepare(Kind.ALL_REDUCE, tensor, label, check, (), mark, op).allreduce(tensor, op, scale)
            if self._known.broken is not None:
                self._known.after()
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int, *, label: str, check: bool = True) -> torch.Tensor:
        """Every member's ``tensor`` concatenated along ``dim``, in group-rank order."""
        send = tensor.contiguous()
        out = torch.empty((self.size, *send.shape), dtype=send.dtype, device=send.device)
        self.all_gather_into(out, send, label=label, check=check)
        return out.flatten(0, 1) if dim == 0 else torch.cat(out.unbind(0), dim=dim)

    def all_gather_into(self, out: torch.Tensor, tensor: torch.Tensor, *, label: str, check: bool = True) -> None:
        """Every member's contiguous ``tensor``, one after another in group-rank order, into
        the contiguous ``out`` of ``size`` times its elements."""
        mark = self._collective(label, "all_gather")
        with mark:
            comm = self._prepare(Kind.ALL_GATHER, tensor, label, check, (), mark)
            self._complete(comm, comm.allgatherv(tensor.view(-1), out.view(-1), [tensor.numel()] * self.size))
            if self._known.broken is not None:
                self._known.after()

    def reduce_scatter(self, tensor: torch.Tensor, dim: int, *, label: str, check: bool = True,
                       op: ElementwiseOp = ElementwiseOp.SUM) -> torch.Tensor:
        """Reduce over the group, then keep this member's block of ``dim`` (which the group's
        size must divide: checked after the agreement, so every member raises alike)."""
        send = torch.stack(tensor.chunk(self.size, dim)) if dim != 0 and not tensor.shape[dim] % self.size else tensor
        block = (tensor.shape[0] // self.size, *tensor.shape[1:]) if dim == 0 else send.shape[1:]
        out = torch.empty(block, dtype=tensor.dtype, device=tensor.device)
        self.reduce_scatter_into(out, send.contiguous(), label=label, check=check, op=op, given=(tensor, dim))
        return out

    def reduce_scatter_into(self, out: torch.Tensor, tensor: torch.Tensor, *, label: str, check: bool = True,
                            op: ElementwiseOp = ElementwiseOp.SUM,
                            given: tuple[torch.Tensor, int] | None = None) -> None:
        """Reduce the contiguous ``tensor`` over the group and keep this member's block (its
        ``size``-th part, in group-rank order) in the contiguous ``out``.  ``given`` is the
        caller's tensor ``tensor`` was laid out from and the dim it splits: the agreement
        names its shape, and that dim must split evenly (checked after the agreement)."""
        mark = self._collective(label, "reduce_scatter")
        with mark:
            comm = self._prepare(Kind.REDUCE_SCATTER, tensor if given is None else given[0], label, check, (), mark, op)
            if given is not None:
                check_divisible(*given, self.size, label)
            if tensor.numel() != out.numel() * self.size:
                raise InvalidArgumentError(f"{label} reduce_scatter: the input has {tensor.numel()} elements, "
                                           f"not {self.size} times the output's {out.numel()}")
            self._complete(comm, comm.reduce_scatter(tensor.view(-1), out.view(-1), [out.numel()] * self.size, op))
            if self._known.broken is not None:
                self._known.after()

    def broadcast_(self, tensor: torch.Tensor, root: int, *, label: str, check: bool = True) -> torch.Tensor:
        """Copy member ``root``'s contiguous ``tensor`` into every member's, in place."""
        with self._collective(label, "broadcast"):
            self._prepare(Kind.BROADCAST, tensor, label, check, (root,))
            comm = self.transport(tensor.device)
            self._complete(comm, comm.broadcast(tensor, root))
        return tensor

    def agree_on_call(self, kind: Kind, tensor: torch.Tensor, root: int, *, label: str, check: bool = True) -> None:
        """The agreement check alone, for a rooted call the caller then makes of other
        calls (a gather as an all-to-all): every member raises alike unless all passed the
        same kind, dtype, shape and root."""
        with self._collective(label, kind.name.lower()):
            self._prepare(kind, tensor, label, check, (root,))

    def barrier(self, *, label: str, check: bool = True) -> None:
        """Return once every member has entered the barrier (after agreeing that every member
        called a barrier)."""
        with self._collective(label, "barrier"):
            self._prepare(Kind.BARRIER, _NO_DATA, label, check)
            self.host.barrier().wait()

    def all_to_all(self, tensor: torch.Tensor, send_rows: Sequence[int], *, label: str,
                   received: Sequence[int] | None = None, out: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, list[int]]:
        """Send ``send_rows[r]`` consecutive rows of ``tensor`` to member r; returns the rows
        received (in member order, in ``out`` when given) and how many came from each member.
        The members first exchange their row counts and row shapes and dtypes, so one that
        sends rows of another shape is an error on every member, naming both, never a misread
        buffer, and rows that do not fit ``out`` are an error naming their sender.  A caller
        that has already agreed on both with the members passes ``received`` (the rows coming
        from each) and skips that exchange."""
        with self._collective(label, "all_to_all"):
            if len(send_rows) != self.size or sum(send_rows) != tensor.shape[0]:
                raise InvalidArgumentError(f"{label} all_to_all: send_rows {list(send_rows)} must give one count "
                                           f"per member ({self.size}) summing to the {tensor.shape[0]} rows")
            send = tensor.contiguous()
            row = math.prod(send.shape[1:])
            if out is not None and (out.dtype != send.dtype or math.prod(out.shape[1:]) != row):
                raise InvalidArgumentError(f"{label} all_to_all: rows of {out.dtype} of shape {tuple(out.shape[1:])} "
                                           f"cannot hold rows of {send.dtype} of shape {tuple(send.shape[1:])}")
            if received is None:
                received = self._agreement.rows(send, send_rows, label)
            received = list(received)
            if out is None:
                out = torch.empty((sum(received), *send.shape[1:]), dtype=send.dtype, device=send.device)
            elif out.shape[0] != sum(received):
                raise CollectiveMismatchError(
                    f"{label} all_to_all over {self.name}: rank {self.ranks[self.rank]} has room for "
                    f"{out.shape[0]} rows but the members send it {received} (rank r sends the r-th count)")
            comm = self.transport(send.device)
            self._complete(comm, comm.alltoallv(send.view(-1), [r * row for r in send_rows], out.view(-1),
                                                [r * row for r in received]))
        return out, received

    def allgather_object(self, value: object, *, label: str | None = None) -> list:
        """Every member's small picklable ``value``, in group-rank order (on the host); with
        ``label``, the wait is marked as that user's check, else the caller marks it."""
        if label is None:
            return self.host.allgather_object(value)
        with self._collective(label, "check"):
            return self.host.allgather_object(value)

    def broadcast(self, tensor: torch.Tensor, root: int) -> Request:
        """Start copying member ``root``'s host ``tensor`` into everyone's (a small exchange
        whose wait the caller marks)."""
        return self.host.broadcast(tensor, root)

    # -- messages ---------------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dest: int, tag: int, ident: int = 0) -> Request:
        """Start sending a header (``ident``, dtype, shape) and then ``tensor``'s data to
        member ``dest``; keep the request until it completes."""
        payload = tensor.detach().contiguous()
        return all_of([self.send_header(payload, dest, tag, ident), self.host.isend(payload, dest, tag)])

    def send_header(self, tensor: torch.Tensor, dest: int, tag: int, ident: int = 0) -> Request:
        """Start sending the header of a message of ``tensor`` (``ident``, dtype, shape) alone, for
        a payload that travels another way (a device's: :mod:`psrt.comm.device_messages`)."""
        header = Header.of(Kind.MESSAGE, tensor, ident)
        if not header.complete:
            raise CommunicationError(f"a direct message carries a tensor of at most {MAX_DIMS} dimensions of a "
                                     f"supported dtype, got {tensor.dtype} of shape {tuple(tensor.shape)}")
        return self.host.isend(header.encode(), dest, tag)

    def recv_header(self, source: int, tag: int, *, kind: str, what: Text) -> Header:
        """The header of the next message from member ``source`` on ``tag`` (its payload is the
        caller's to receive), once in; the wait is marked as ``kind``/``what``."""
        words = torch.empty(HEADER_WORDS, dtype=torch.int64)
        return self._header_of(self.host.irecv(words, source, tag), words, source, tag, kind, what)

    def recv(self, source: int, tag: int, *, kind: str, what: Text) -> tuple[Header, torch.Tensor]:
        """The next message :meth:`send` sent from member ``source`` on ``tag``: its header
        and a new host tensor holding its data.  The wait is marked as ``kind``/``what``."""
        header = self.recv_header(source, tag, kind=kind, what=what)
        with self.waiting(kind, what, (self.ranks[source],)):
            tensor = torch.empty(header.shape, dtype=header.dtype)
            wait_politely(self.host.irecv(tensor, source, tag))
        return header, tensor

    def _header_of(self, request: Request, words: torch.Tensor, source: int, tag: int, kind: str,
                   what: Text) -> Header:
        """The header ``request`` receives into ``words`` from member ``source``, once in.  A
        receive needs its sender until the header is in (a call, for deadlock detection); the
        data then follows by itself."""
        with self.waiting(kind, what, (self.ranks[source],), ident=(RECEIVE, self._ident, source, tag)):
            wait_politely(request)
        header = Header.decode(words.tolist())
        if not header.complete:
            raise CommunicationError(f"rank {self.ranks[source]} sent a header this psrt cannot read "
                                     f"({words.tolist()}): are all ranks running the same psrt?")
        return header

    def irecv_into(self, tensor: torch.Tensor, source: int, tag: int, *, kind: str, what: Text) -> Request:
        """Start receiving the next message :meth:`send` sent from member ``source`` on
        ``tag`` into the contiguous host ``tensor``.  Waiting on the request (marked as
        ``kind``/``what``) raises, naming the sender, if the message is not a tensor of
        ``tensor``'s dtype and shape."""
        words = torch.empty(HEADER_WORDS, dtype=torch.int64)
        header = self.host.irecv(words, source, tag)
        data = self.host.irecv(tensor, source, tag)  # matched after the header: MPI keeps their order
        return _ReceiveInto(self, header, data, words, tensor, source, tag, kind, what)

    def free(self) -> None:
        """Release the group's communicators (device ones first: they sit on the host one)."""
        for comm in self._devices.values():
            comm.free()
        self._devices.clear()
        if self._breaker is not None:
            self._breaker.unregister(self._known)
        self._known.free()
        self._agreement.free()
        self.host.free()


class _ReceiveInto(Request):
    """A receive into a caller's tensor whose wait checks what was sent (:meth:`DirectGroup.irecv_into`)."""

    def __init__(self, group: DirectGroup, header: Request, data: Request, words: torch.Tensor,
                 tensor: torch.Tensor, source: int, tag: int, kind: str, what: Text) -> None:
        self._group, self._header, self._data, self._words = group, header, data, words
        self._tensor, self._source, self._tag, self._kind, self._what = tensor, source, tag, kind, what
        self._checked = False

    def _check(self) -> None:
        if self._checked:
            return
        group, sender = self._group, self._group.ranks[self._source]
        got = group._header_of(self._header, self._words, self._source, self._tag, self._kind, self._what)
        room = Header.of(Kind.MESSAGE, self._tensor)
        if (got.dtype, got.shape) != (room.dtype, room.shape):
            self._data.cancel()  # so that it never takes the sender's next message
            raise CollectiveMismatchError(
                f"a receive on rank {group.ranks[group.rank]} from rank {sender} over {group.name} (tag {self._tag}) "
                f"expects a {room.describe_tensor()} but rank {sender} sent a {got.describe_tensor()}")
        self._checked = True

    def test(self) -> bool:
        if not self._checked and not self._header.test():
            return False
        self._check()
        return self._data.test()

    def wait(self) -> None:
        self._check()
        if not self._data.test():
            with self._group.waiting(self._kind, self._what, (self._group.ranks[self._source],)):
                wait_politely(self._data)

    def cancel(self) -> None:
        self._header.cancel()
        self._data.cancel()

