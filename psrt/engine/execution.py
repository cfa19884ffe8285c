"""Running what a negotiation round agreed: fused allreduces and other collectives, in order.

Agreed allreduces are fused into as few messages as the fusion threshold allows
(:mod:`psrt.engine.fusion`), each message reduced in place or through a persistent fusion
buffer; other collectives run their work's ``execute``.  Each finished work is handed to
the submissions, which wake its waiter.  This belongs to the cycle (:mod:`psrt.engine.cycle`)
and keeps what only running needs: the communicators that carry tensors, by process set
and device; the fusion buffers; the timeline, on which every work's phases are recorded;
and Horovod's autotuner, which tries fusion thresholds and cycle times on the job's own
steps.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from typing import Iterator

import torch

from psrt.comm import streams
from psrt.comm.base import Communicator, ElementwiseOp
from psrt.comm.ranks import rank_ranges
from psrt.comm.waits import Wait
from psrt.comm.watchdog import Watchdog
from psrt.config import Config
from psrt.engine import fusion
from psrt.engine.autotune import Autotuner, Setting
from psrt.engine.negotiation import Response
from psrt.engine.submissions import Submissions
from psrt.engine.timeline import Timeline
from psrt.engine.work import Announcement, Route, Work, WorkKey
from psrt.errors import CollectiveMismatchError

logger = logging.getLogger("psrt")


class Execution:
    """Runs agreed responses (see the module's docstring)."""

    __slots__ = ("rank", "_everyone", "_topology", "_watchdog", "_submissions", "_config", "_fusion",
                 "_data_comms", "_timeline", "_autotuner", "_autotune_comm")

    def __init__(self, topology, config: Config, watchdog: Watchdog, submissions: Submissions) -> None:
        world = topology.world
        self.rank = world.rank
        self._everyone = tuple(range(world.size))
        self._topology = topology
        self._watchdog = watchdog
        self._submissions = submissions
        self._config = config
        self._fusion = fusion.FusionBuffers()
        self._data_comms: dict[tuple[int, torch.device], Communicator] = {}
        self._timeline: Timeline | None = None
        self._autotuner: Autotuner | None = None
        self._autotune_comm = world.split(0, key=world.rank) if config.autotune else None
        if self._autotune_comm is not None:
            self._autotuner = Autotuner(Setting(config.fusion_threshold, config.cycle_time_ms),
                                        warmup_samples=config.autotune_warmup_samples,
                                        steps_per_sample=config.autotune_steps_per_sample, share=self._rank0s_score,
                                        rank=self.rank, log=config.autotune_log)
            self._apply(self._autotuner.setting)
        if config.timeline:
            self.start_timeline(config.timeline, config.timeline_mark_cycles, asked_by="PSRT_TIMELINE")

    @property
    def cycle_time_s(self) -> float:
        return self._config.cycle_time_ms / 1000

    @property
    def timeline(self) -> Timeline | None:
        """The timeline being written, if any (read it once: it may be stopped meanwhile)."""
        return self._timeline

    # -- timeline -----------------------------------------------------------------------------
    def start_timeline(self, path: str, mark_cycles: bool, asked_by: str) -> None:
        """Write a timeline to ``path`` (on rank 0; other ranks ignore the call)."""
        if self.rank == 0:
            self.stop_timeline()
            self._timeline = Timeline(path, self.rank, mark_cycles, asked_by)

    def stop_timeline(self) -> None:
        timeline, self._timeline = self._timeline, None
        if timeline is not None:
            timeline.close()

    # -- running a round's responses ----------------------------------------------------------
    def run(self, responses: list[Response], local: dict[WorkKey, Work], mark: Wait) -> None:
        """Run ``responses`` in order, taking this rank's works out of ``local`` as they run."""
        stamped = self._timeline is not None
        if stamped:
            now = time.perf_counter()
            for response in responses:
                work = local.get(response.announcement.key)
                if work is not None:
                    work.ready = now
        for batch in fusion.plan(responses, self._config.fusion_threshold):
            mark.what = functools.partial(self._describe_batch, batch)
            mark.peers = batch.responses[0].announcement.ranks
            with mark:
                if batch.fused:
                    self._allreduce(batch.responses, local)
                else:
                    self._run_one(batch.responses[0], local)
        if self._autotuner is not None:
            self._autotune((r.announcement.key, r.announcement.reduction.nbytes) for r in responses
                           if r.announcement.reduction is not None and r.error is None)

    def express(self, route: Route, buffer: torch.Tensor, mark: Wait) -> None:
        """The express path's reduction of ``buffer`` (see :meth:`Cycle.express`), by the
        transport's call prepared for the buffer's address where it has one."""
        announcement = route.announcement
        if route.comm is None:
            route.comm = self._data_comm(announcement.reduction.set_id, buffer.device)
            route.describe = functools.partial(self._describe, announcement, 0)
        address = buffer.data_ptr()
        if address != route.address:
            route.address, route.prepared = address, route.comm.allreduce_at(buffer, route.op)
        mark.what, mark.peers = route.describe, announcement.ranks
        with mark:
            if route.prepared is not None:
                route.prepared(buffer, route.scale)
            else:
                route.comm.allreduce(buffer, route.op, route.scale)
        if self._autotuner is not None:
            self._autotune(((announcement.key, announcement.reduction.nbytes),))

    def _allreduce(self, responses: list[Response], local: dict[WorkKey, Work]) -> None:
        first = responses[0].announcement
        if self.rank not in first.ranks:
            return
        works = [local.pop(r.announcement.key, None) for r in responses]
        pieces = [p for r in responses for p in r.announcement.reduction.pieces]
        comm = self._data_comm(first.reduction.set_id, _device(first.reduction.device))
        phases: list[tuple[str, float, float]] = []
        devices = [work for work in works if work is not None and work.streams is not None]
        with _on_communication_stream(devices, "allreduce") if devices else contextlib.nullcontext():
            # A member without the work has joined: it contributes zeros (made on the stream
            # that uses them).
            buffers = [b for w, r in zip(works, responses)
                       for b in (w.buffers if w is not None else r.announcement.reduction.zeros())]
            for message in fusion.messages(pieces):
                piece = pieces[message[0]]
                self._reduce_message([buffers[i] for i in message], first.reduction.op, piece.scale, comm, phases)
        for work in works:
            if work is not None:
                self._finish(work, None, None, phases)

    def _reduce_message(self, buffers: list[torch.Tensor], op: ElementwiseOp, scale: float,
                        comm: Communicator, phases: list[tuple[str, float, float]]) -> None:
        """One allreduce carrying ``buffers``: in place when they are one tensor or lie back
        to back, else packed into the fusion buffer and unpacked after."""
        start = time.perf_counter()
        flat = buffers[0] if len(buffers) == 1 else fusion.contiguous_span(buffers)  # any shape: a flat array
        staged = flat is None
        if staged:
            flat = self._fusion.get(buffers[0].dtype, buffers[0].device, sum(b.numel() for b in buffers))
            fusion.pack(buffers, flat)
        packed = time.perf_counter()
        comm.allreduce(flat, op, scale)
        reduced = time.perf_counter()
        if staged:
            fusion.unpack(flat, buffers)
            end = time.perf_counter()
            phases += [("MEMCPY_IN_FUSION_BUFFER", start, packed), ("ALLREDUCE", packed, reduced),
                       ("MEMCPY_OUT_FUSION_BUFFER", reduced, end)]
        else:
            phases.append(("ALLREDUCE", start, reduced))

    def _run_one(self, response: Response, local: dict[WorkKey, Work]) -> None:
        work = local.pop(response.announcement.key, None)
        if work is None:
            return
        if response.error is not None:
            self._finish(work, None, CollectiveMismatchError(response.error), ())
            return
        set_id = work.announcement.key[0]
        host = self._topology.communicator(self._topology.process_set(set_id))
        data = self._data_comm(set_id, work.device)
        start = time.perf_counter()
        if work.streams is None:
            value = work.execute(host, data)
        else:
            with _on_communication_stream((work,), work.announcement.collective):
                value = work.execute(host, data)
        self._finish(work, value, None, ((work.announcement.collective.upper(), start, time.perf_counter()),))

    def _data_comm(self, set_id: int, device: torch.device) -> Communicator:
        """Looked up once per set and device (set ids are never reused)."""
        comm = self._data_comms.get((set_id, device))
        if comm is None:
            comm = self._data_comms[(set_id, device)] = self._topology.transport(
                self._topology.process_set(set_id), device)
        return comm

    def _finish(self, work: Work, value: object, error: BaseException | None, phases: tuple | list) -> None:
        timeline = self._timeline  # read once: stop_timeline() may clear it meanwhile
        if timeline is not None:
            _record(timeline, work, phases)
        self._submissions.finished(work, value, error)

    # -- watchdog descriptions ------------------------------------------------------------------
    def _describe_batch(self, batch: fusion.Batch) -> str:
        return self._describe(batch.responses[0].announcement, len(batch.responses) - 1)

    def _describe(self, first: Announcement, fused_with: int) -> str:
        more = f" (fused with {fused_with} more)" if fused_with else ""
        return f"rank {self.rank}'s {first.describe()}{more} over ranks {rank_ranges(first.ranks)}"

    # -- autotuning (see psrt.engine.autotune) ------------------------------------------------
    def _autotune(self, reduced) -> None:
        """Feed the autotuner what was just reduced (the same on every rank) and apply the
        setting it switches to, on every rank at this same response."""
        switch = self._autotuner.observe(reduced)
        if switch is not None:
            self._apply(switch)
        if self._autotuner.done:
            if self.rank == 0:
                logger.warning("psrt: autotuning settled on fusion threshold %d bytes, cycle time %g ms",
                               self._config.fusion_threshold, self._config.cycle_time_ms)
            self._autotuner = None

    def _apply(self, setting: Setting) -> None:
        self._config = dataclasses.replace(self._config, fusion_threshold=setting.fusion_threshold,
                                           cycle_time_ms=setting.cycle_time_ms)

    def _rank0s_score(self, score: float) -> float:
        """Rank 0's score (collective over the world: at the same response on every rank)."""
        value = torch.tensor([score], dtype=torch.float64)
        with self._watchdog.waiting("an autotuning step", "the broadcast of rank 0's score of a fusion setting",
                                    self._everyone):
            self._autotune_comm.broadcast(value, 0).wait()
        return float(value)

    def close(self) -> None:
        if self._autotune_comm is not None:
            self._autotune_comm.free()


@functools.cache
def _device(name: str) -> torch.device:
    return torch.device(name)


@contextlib.contextmanager
def _on_communication_stream(ordered, collective: str) -> Iterator[None]:
    """Run a block of device works (``ordered``: each with its stream dependencies) on their
    device's communication stream for ``collective``, after that stream has waited for every
    work's ready event; record the done event their consumers wait for
    (:mod:`psrt.comm.streams`).  Labelled ``psrt.<collective>`` on a profiler's trace."""
    cuda = streams.api()
    stream = streams.device_streams(ordered[0].device).for_collective(collective)
    with cuda.using(stream), torch.profiler.record_function(f"psrt.{collective}"):
        for work in ordered:
            cuda.wait(stream, work.streams.ready)
        yield
    done = cuda.record(stream)
    for work in ordered:
        work.streams.done = done


def _record(timeline: Timeline, work: Work, phases: tuple | list) -> None:
    """A completed work's phases on the timeline."""
    negotiated = work.negotiated or work.submitted
    ready = work.ready or negotiated
    start = phases[0][1] if phases else ready
    timeline.phase(work.name, "NEGOTIATE", work.submitted, negotiated)
    timeline.phase(work.name, "WAIT_FOR_OTHER_RANKS", negotiated, ready)
    timeline.phase(work.name, "QUEUE", ready, start)
    for phase, begin, end in phases:
        timeline.phase(work.name, phase, begin, end)
