"""Runs a pipeline schedule: one executor for every schedule, driven by the per-rank
action list that :mod:`psrt.pp.schedule` builds and :mod:`psrt.pp.simulate` checks."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from psrt import runtime
from psrt.comm.base import Request
from psrt.errors import ArgumentTypeError, InvalidArgumentError
from psrt.pp import schedule as schedules
from psrt.pp.p2p import BACKWARD_TAG, FORWARD_TAG, StageLink, message_id
from psrt.pp.schedule import Action, Op
from psrt.pp.simulate import Event, check
from psrt.pp.stage import PipelineStage

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class StepProfile:
    """What one step did on this rank: compute events (seconds from the step start), wall
    time, the most micro-batches held at once and the most activation bytes they held."""

    events: list[Event] = field(default_factory=list)
    wall: float = 0.0
    in_flight: int = 0
    peak_activation_bytes: int = 0

    @property
    def compute(self) -> float:
        return sum(e.end - e.start for e in self.events)

    @property
    def idle(self) -> float:
        return max(0.0, self.wall - self.compute)


class Pipeline:
    """Forward and backward of ``microbatches`` micro-batches through the stages.

    ``step(inputs, targets)`` takes the batch on the first stage and the targets on the
    last (other stages pass None), splits both into equal micro-batches, runs the
    schedule, and returns the loss on every stage: the mean (``loss_reduction="mean"``)
    or the sum of the micro-batch losses.  Gradients accumulate in the stage's
    parameters; a data-parallel optimizer over the DP set reduces them after the
    step's last backward (``backward_passes_per_step=microbatches`` for
    ``DistributedOptimizer``; ZeRO reduces in ``step()``).
    """

    def __init__(self, stage: PipelineStage, loss_fn: LossFn, *, microbatches: int, schedule: str = "1f1b",
                 loss_reduction: str = "mean") -> None:
        if not isinstance(stage, PipelineStage):
            raise ArgumentTypeError(f"stage must be a PipelineStage, got {type(stage).__name__}")
        if loss_reduction not in ("mean", "sum"):
            raise InvalidArgumentError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        plan = schedules.build(schedule, stage.stages, microbatches, stage.chunks)
        check(plan, microbatches, stage.chunks)
        self.actions = plan[stage.rank]
        self.stage, self.loss_fn = stage, loss_fn
        self.microbatches, self.schedule, self.loss_reduction = microbatches, schedule, loss_reduction
        self._link = StageLink(stage.process_set)
        self._host = runtime.current().topology.communicator(stage.process_set)
        self.profile = StepProfile()

    def step(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> torch.Tensor:
        self._agree(inputs, targets)
        run = _StepRun(self, _split(inputs, self.microbatches), _split(targets, self.microbatches))
        loss = run.execute()
        self._host.broadcast(loss, root=self.stage.stages - 1).wait()
        self.profile = run.profile
        return loss.squeeze(0)

    def _agree(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> None:
        """Every stage checks, in one exchange, that all run the same schedule and that the
        batch splits into equal micro-batches: disagreement raises on every rank alike."""
        stage = self.stage
        if stage.rank == 0 and inputs is None:
            raise InvalidArgumentError("the first pipeline stage needs the inputs")
        if stage.rank == stage.stages - 1 and targets is None:
            raise InvalidArgumentError("the last pipeline stage needs the targets")
        mine = (self.schedule, self.microbatches, stage.chunks, _rows(inputs) if stage.rank == 0 else None,
                _rows(targets) if stage.rank == stage.stages - 1 else None)
        everyone = self._host.allgather_object(mine)
        for rank, theirs in enumerate(everyone):
            if theirs[:3] != mine[:3]:
                raise InvalidArgumentError(
                    f"pipeline stages disagree: stage {stage.rank} runs {mine[0]!r} with {mine[1]} micro-batches "
                    f"and {mine[2]} chunks, stage {rank} runs {theirs[0]!r} with {theirs[1]} and {theirs[2]}")
        rows, target_rows = everyone[0][3], everyone[-1][4]
        if rows != target_rows:
            raise InvalidArgumentError(f"the first stage has a batch of {rows} rows but the last stage has "
                                       f"{target_rows} rows of targets")
        if rows % self.microbatches:
            raise InvalidArgumentError(f"a batch of {rows} rows does not split into {self.microbatches} "
                                       "micro-batches of equal size")


def _rows(tensor: torch.Tensor | None) -> int | None:
    if tensor is None:
        return None
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        raise ArgumentTypeError(f"pipeline inputs and targets must be tensors with a batch dimension, got "
                                f"{type(tensor).__name__}")
    return tensor.shape[0]


def _split(batch: torch.Tensor | None, microbatches: int) -> list[torch.Tensor] | None:
    return None if batch is None else list(batch.chunk(microbatches))


class _StepRun:
    """The state of one step: activations held between a micro-batch's forward and backward."""

    def __init__(self, pipeline: Pipeline, inputs, targets) -> None:
        self.p, self.inputs, self.targets = pipeline, inputs, targets
        self.stage, self.link = pipeline.stage, pipeline._link
        self.received: dict[tuple[int, int], torch.Tensor] = {}   # (k, chunk) -> input from the previous stage
        self.held: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, int]] = {}  # input, output, bytes
        self.grads: dict[tuple[int, int], torch.Tensor] = {}
        self.sends: list[Request] = []
        self.loss = torch.zeros(1, dtype=torch.float64)
        self.profile = StepProfile()
        self.live_bytes = 0
        self.device = next(self.stage.parameters(), torch.empty(0)).device
        self.parameter_storage = {p.data_ptr() for p in self.stage.parameters()}

    def execute(self) -> torch.Tensor:
        start = time.perf_counter()
        self.start = start
        try:
            for action in self.p.actions:
                self._do(action)
            for request in self.sends:
                request.wait()
        finally:
            self.held.clear()
        if self.p.loss_reduction == "mean":
            self.loss /= self.p.microbatches
        self.profile.wall = time.perf_counter() - start
        return self.loss

    def _peer(self, chunk: int, step: int) -> tuple[int, int]:
        """(set rank, virtual stage) of the stage ``step`` away from this chunk's."""
        stages = self.stage.stages
        virtual = chunk * stages + self.stage.rank
        return (virtual + step) % stages, virtual

    def _do(self, a: Action) -> None:
        key = (a.microbatch, a.chunk)
        if a.op is Op.RECV_FORWARD:
            source, virtual = self._peer(a.chunk, -1)
            x = self.link.recv(source, FORWARD_TAG, message_id(a.microbatch, virtual - 1), self.device)
            self.received[key] = x.requires_grad_()
        elif a.op is Op.FORWARD:
            self._timed(a, self._forward, a, key)
        elif a.op is Op.SEND_FORWARD:
            dest, virtual = self._peer(a.chunk, +1)
            self.sends.append(self.link.send(self.held[key][1], dest, FORWARD_TAG, message_id(a.microbatch, virtual)))
        elif a.op is Op.RECV_BACKWARD:
            source, virtual = self._peer(a.chunk, +1)
            self.grads[key] = self.link.recv(source, BACKWARD_TAG, message_id(a.microbatch, virtual + 1),
                                             self.device, like=self.held[key][1])
        elif a.op is Op.BACKWARD:
            self._timed(a, self._backward, a, key)
        else:  # SEND_BACKWARD
            dest, virtual = self._peer(a.chunk, -1)
            grad = self.received.pop(key).grad
            self.sends.append(self.link.send(grad, dest, BACKWARD_TAG, message_id(a.microbatch, virtual)))

    def _timed(self, a: Action, work: Callable, *args) -> None:
        begin = time.perf_counter()
        work(*args)
        end = time.perf_counter()
        self.profile.events.append(Event(self.stage.rank, a.op, a.microbatch, a.chunk,
                                         begin - self.start, end - self.start))

    def _forward(self, a: Action, key: tuple[int, int]) -> None:
        x = self.inputs[a.microbatch] if self.stage.is_first(a.chunk) else self.received[key]
        saved = _SavedBytes(self.parameter_storage)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            y = self.stage.run_chunk(a.chunk, x)
            if self.stage.is_last(a.chunk):
                loss = self.p.loss_fn(y, self.targets[a.microbatch])
                self.loss += loss.detach().double().cpu()
                y = loss / self.p.microbatches if self.p.loss_reduction == "mean" else loss
        self.held[key] = (x, y, saved.bytes)
        self.live_bytes += saved.bytes
        self.profile.peak_activation_bytes = max(self.profile.peak_activation_bytes, self.live_bytes)
        self.profile.in_flight = max(self.profile.in_flight, len(self.held))

    def _backward(self, a: Action, key: tuple[int, int]) -> None:
        _, y, saved = self.held.pop(key)
        if self.stage.is_last(a.chunk):
            y.backward()
        else:
            y.backward(self.grads.pop(key))
        self.live_bytes -= saved


class _SavedBytes:
    """Counts the bytes autograd saves for backward during a forward, leaving out parameters
    (``parameter_storage``: their data pointers) and counting shared storage once."""

    def __init__(self, parameter_storage: set[int]) -> None:
        self.bytes = 0
        self._seen = set(parameter_storage)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.data_ptr() not in self._seen:
            self._seen.add(tensor.data_ptr())
            self.bytes += tensor.numel() * tensor.element_size()
        return tensor
