"""The typed internal API between psrt's strategies and the engine: a :class:`Channel`.

A strategy (the gradient reducer's bucket strategies, ZeRO's reduce-scatters and gathers,
the parameter-server client's coordination, elastic commits, the Horovod-shaped functions
themselves) is handed the channel of its process set when it is built, builds :class:`Work`
objects through it, starts them, and waits on those objects.  Nothing here looks up a current
runtime or hands out integer handles: those belong to the Horovod-shaped facade
(``psrt.torch``), a thin layer over this one for users' scripts.

Every work is named: ranks match works by name whatever order they submit them in, and
every rank must agree on a work's descriptor (collective, dtype, shape, device, and what the
builder adds as ``agreed``), else it fails on every rank with one message naming both.  An
unnamed work (``name=None``) is named from the runtime's counter and stays out of the
response cache, so every rank must make its unnamed calls in the same order.

Building a work does not submit it: :meth:`Channel.start` queues it for the engine thread
(asynchronous), :meth:`Channel.run` queues it and waits, running the engine's cycles on the
calling thread, :meth:`Channel.wait` waits for a started one.
"""
from __future__ import annotations

import pickle
from typing import Callable, Sequence

import torch

from psrt.comm.base import Communicator, ElementwiseOp
from psrt.engine.engine import Engine
from psrt.engine.names import Names
from psrt.engine.work import Announcement, BufferSpec, Descriptor, Reduction, Route, Work

Finish = Callable[[object], object]
Execute = Callable[[Communicator, Communicator], object]

_HOST = torch.device("cpu")


class PreparedAllreduce:
    """An allreduce worked out once for buffers of fixed dtypes and sizes (a bucket's, a
    training loop's): its announcement, reused by every work it builds, and the express
    path's route where the engine can take one."""

    __slots__ = ("announcement", "device", "route")

    def __init__(self, announcement: Announcement, device: torch.device, route: Route | None) -> None:
        self.announcement, self.device, self.route = announcement, device, route

    def work(self, buffers: list[torch.Tensor], finish: Finish | None = None) -> Work:
        """The work reducing ``buffers`` in place (contiguous, of the prepared dtypes and
        sizes)."""
        return Work(self.announcement, device=self.device, buffers=buffers, finish=finish)


class Channel:
    """One process set's way into the engine (see the module's docstring).

    ``ranks`` are the set's world ranks, ``rank`` this rank's index among them."""

    __slots__ = ("_engine", "_names", "set_id", "ranks", "rank", "size")

    def __init__(self, engine: Engine, names: Names, set_id: int, ranks: Sequence[int], world_rank: int) -> None:
        self._engine, self._names = engine, names
        self.set_id, self.ranks = set_id, tuple(ranks)
        self.rank, self.size = self.ranks.index(world_rank), len(self.ranks)

    # -- starting and waiting ---------------------------------------------------------------
    def start(self, work: Work, wake: bool = True) -> Work:
        """Queue ``work`` for the engine thread; returns it, to wait on.  ``wake=False`` for a
        work the caller is about to wait for (with others it starts first): the thread that
        waits runs the cycle, and the engine thread is left asleep."""
        return self._engine.submit(work, wake)

    def run(self, work: Work) -> object:
        """Queue ``work`` and return its output, running the engine on this thread meanwhile."""
        return self._engine.run(work)

    def wait(self, work: Work) -> object:
        """The output of a started ``work`` (or its error), running the engine on this thread
        until it is done."""
        return self._engine.wait(work)

    def express(self, prepared: PreparedAllreduce, buffer: torch.Tensor) -> bool:
        """Reduce ``buffer`` (one contiguous tensor) by ``prepared``'s express path if the
        engine can (see :meth:`Engine.express`); False when nothing ran (start a work)."""
        return prepared.route is not None and self._engine.express(prepared.route, buffer)

    # -- naming -----------------------------------------------------------------------------
    def announce(self, collective: str, name: str | None, descriptor: Descriptor,
                 reduction: Reduction | None = None) -> Announcement:
        """What ranks negotiate about a call.  Unnamed calls get Horovod's counter-based name
        (see :mod:`psrt.engine.names`) and stay out of the response cache, since their names
        never repeat."""
        return Announcement(
            key=(self.set_id, name if name is not None else self._names.unnamed(collective)),
            ranks=self.ranks, descriptor=(("collective", collective), *descriptor),
            reduction=reduction, cacheable=name is not None)

    # -- building works -----------------------------------------------------------------------
    def execute(self, collective: str, name: str | None, descriptor: Descriptor, device: torch.device,
                run: Execute, finish: Finish | None = None) -> Work:
        """A work that runs ``run(host, data)`` on the thread running the cycle, given the set's
        host communicator and the one carrying tensors on ``device``."""
        return Work(self.announce(collective, name, descriptor), device=device, execute=run, finish=finish)

    def prepare_allreduce(self, like: Sequence[torch.Tensor], *, name: str | None, op: ElementwiseOp,
                          scales: Sequence[float], agreed: Descriptor = ()) -> PreparedAllreduce:
        """An in-place allreduce of buffers shaped as ``like`` (one device), each multiplied by
        its ``scales`` entry as it is reduced; the engine may fuse it with others.  ``agreed``:
        what else every rank must pass alike."""
        first = like[0]
        if len(like) == 1:
            layout: Descriptor = (("dtype", first.dtype), ("shape", tuple(first.shape)))
        else:
            layout = (("dtypes", tuple(t.dtype for t in like)), ("shapes", tuple(tuple(t.shape) for t in like)))
        reduction = Reduction(self.set_id, str(first.device), op,
                              tuple(BufferSpec(t.numel(), t.dtype, s) for t, s in zip(like, scales)))
        announcement = self.announce("allreduce", name, (*layout, ("device", first.device.type), *agreed),
                                     reduction)
        route = self._engine.route(announcement) if len(like) == 1 and name is not None else None
        return PreparedAllreduce(announcement, first.device, route)

    def allreduce(self, buffers: list[torch.Tensor], *, name: str | None, op: ElementwiseOp = ElementwiseOp.SUM,
                  scale: float = 1.0, finish: Finish | None = None) -> Work:
        """Reduce ``buffers`` (contiguous, one device) in place, each scaled by ``scale``."""
        prepared = self.prepare_allreduce(buffers, name=name, op=op, scales=[scale] * len(buffers))
        return prepared.work(buffers, finish)

    def reduce_scatter(self, send: torch.Tensor, out: torch.Tensor, counts: Sequence[int], *, name: str | None,
                       op: ElementwiseOp = ElementwiseOp.SUM, scale: float = 1.0, agreed: Descriptor | None = None,
                       finish: Finish | None = None) -> Work:
        """Reduce ``send`` (contiguous) over the set into ``out``: this rank's block, whose size is
        ``counts[self.rank]`` elements; blocks follow the set's rank order.  ``scale`` multiplies
        the block afterwards (1/size for an average).  Every rank must agree on dtype, shape,
        device and ``agreed`` (default: the op and the scale).  The work's output is ``out``
        unless ``finish`` says otherwise."""
        counts = list(counts)

        def run(host: Communicator, data: Communicator) -> torch.Tensor:
            data.reduce_scatter(send.view(-1), out.view(-1), counts, op).wait()
            if scale != 1.0:
                out.mul_(scale)
            return out

        if agreed is None:
            agreed = (("op", op.name), ("scale", scale))
        descriptor = (("dtype", send.dtype), ("shape", tuple(send.shape)), ("device", send.device.type), *agreed)
        return self.execute("reducescatter", name, descriptor, send.device, run, finish)

    def allgather_into(self, part: torch.Tensor, whole: torch.Tensor, *, name: str | None) -> Work:
        """Gather every rank's ``part`` (contiguous, equally sized) into ``whole`` in set-rank
        order; the work's output is ``whole``."""
        send = part.reshape(-1)

        def run(host: Communicator, data: Communicator) -> torch.Tensor:
            data.allgatherv(send, whole.view(-1), [send.numel()] * self.size).wait()
            return whole

        descriptor = (("dtype", part.dtype), ("device", part.device.type), ("numel", send.numel()))
        return self.execute("allgather_into", name, descriptor, part.device, run)

    def broadcast(self, tensor: torch.Tensor, root_rank: int, *, name: str | None, agreed: Descriptor = (),
                  finish: Finish | None = None) -> Work:
        """Overwrite ``tensor`` (contiguous) with world rank ``root_rank``'s, in place."""
        root = self.ranks.index(root_rank)

        def run(host: Communicator, data: Communicator) -> None:
            data.broadcast(tensor, root).wait()

        descriptor = (("dtype", tensor.dtype), ("device", tensor.device.type), ("shape", tuple(tensor.shape)),
                      ("root_rank", root_rank), *agreed)
        return self.execute("broadcast", name, descriptor, tensor.device, run, finish)

    def barrier(self, *, name: str | None = "barrier") -> Work:
        """Completes once every rank of the set has started it."""
        return self.execute("barrier", name, (), _HOST, lambda host, data: host.barrier().wait())

    # -- Python objects (blocking) --------------------------------------------------------------
    def allgather_object(self, obj: object, *, name: str) -> list:
        """Every rank's ``obj`` (pickled: only between ranks that trust each other), in set-rank
        order."""
        payload = _to_bytes(obj)

        def run(host: Communicator, data: Communicator) -> list:
            sizes = host.exchange_counts([payload.numel()] * host.size)
            gathered = torch.empty(sum(sizes), dtype=torch.uint8)
            host.allgatherv(payload, gathered, sizes).wait()
            return [_from_bytes(chunk) for chunk in gathered.split(sizes)]

        return self.run(self.execute("allgather_object", name, (), _HOST, run))

    def broadcast_object(self, obj: object, root_rank: int, *, name: str) -> object:
        """World rank ``root_rank``'s ``obj`` on every rank (pickled: only between ranks that
        trust each other); on the root, ``obj`` itself."""
        root = self.ranks.index(root_rank)
        payload = _to_bytes(obj) if root == self.rank else None

        def run(host: Communicator, data: Communicator) -> object:
            length = torch.tensor([0 if payload is None else payload.numel()], dtype=torch.int64)
            host.broadcast(length, root).wait()
            received = payload if payload is not None else torch.empty(int(length), dtype=torch.uint8)
            host.broadcast(received, root).wait()
            return obj if payload is not None else _from_bytes(received)

        return self.run(self.execute("broadcast_object", name, (("root_rank", root_rank),), _HOST, run))


def _to_bytes(obj: object) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)


def _from_bytes(payload: torch.Tensor) -> object:
    return pickle.loads(memoryview(payload.numpy()))
