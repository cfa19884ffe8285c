"""Runs a pipeline schedule: one executor for every schedule, driven by the per-rank
action list that :mod:`psrt.pp.schedule` builds and :mod:`psrt.pp.simulate` checks."""
from __future__ import annotations

from typing import Callable

import torch

from psrt.ep.moe import aux_loss_share
from psrt.errors import ArgumentTypeError, InvalidArgumentError
from psrt.pp import schedule as schedules
from psrt.pp.p2p import TIED_VALUE_TAG, StageLink
from psrt.pp.rounds import message_rounds
from psrt.pp.schedule import Action
from psrt.pp.simulate import check
from psrt.pp.stage import PipelineStage
from psrt.pp.step import StepProfile, StepRun
from psrt.pp.tied import check_schedule
from psrt.runtime import Runtime, given

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Pipeline:
    """Forward and backward of ``microbatches`` micro-batches through the stages.

    ``step(inputs, targets)`` takes the batch on the first stage and the targets on the
    last (other stages pass None), splits both into equal micro-batches, runs the
    schedule, and returns the loss on every stage: the mean (``loss_reduction="mean"``)
    or the sum of the micro-batch losses.  Gradients accumulate in the stage's
    parameters; a data-parallel optimizer over the DP set reduces them after the
    step's last backward (``backward_passes_per_step=microbatches`` for
    ``DistributedOptimizer``; ZeRO reduces in ``step()``).  An :class:`psrt.ep.MoE` layer's
    aux-loss gradient is shared out over the micro-batches (each carries ``coef / m``), in
    both reductions.  Construction does not communicate.

    Collective: every rank of the stage's pipeline set calls ``step()``, in the same order (see
    :meth:`step`).

    :param stage: this rank's :class:`PipelineStage`; its layout decides interleaving: a stage
        built with ``chunks`` > 1 runs the interleaved schedule, one with a single chunk 1F1B
        unless ``schedule`` names another.
    :param loss_fn: ``loss_fn(output, target)``, a scalar loss of one micro-batch, run on the
        last stage.
    :param microbatches: m, the micro-batches per step: a positive int that divides the batch
        (for the interleaved schedule, a multiple of the number of stages).  Keyword only, as
        are all that follow.
    :param schedule: None (the default: what the stage calls for), or the name of one that fits
        it: ``"gpipe"``/``"afab"``, ``"1f1b"``, ``"zb-h1"``, or ``"interleaved"`` for a stage with
        ``chunks`` > 1.  One that does not fit the stage is an error.
    :param loss_reduction: ``"mean"`` (the default) or ``"sum"`` of the micro-batch losses.
    :param runtime: the psrt runtime the stages talk through; default None: the current one.
    """

    def __init__(self, stage: PipelineStage, loss_fn: LossFn, *, microbatches: int, schedule: str | None = None,
                 loss_reduction: str = "mean", runtime: Runtime | None = None) -> None:
        self.runtime = given(runtime)
        if not isinstance(stage, PipelineStage):
            raise ArgumentTypeError(f"stage must be a PipelineStage, got {type(stage).__name__}")
        if loss_reduction not in ("mean", "sum"):
            raise InvalidArgumentError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        schedule = _schedule_for(stage, schedule)
        plan = schedules.build(schedule, stage.stages, microbatches, stage.chunks)
        check(plan, microbatches, stage.chunks)
        self.actions = plan[stage.rank]
        self._plan, self._rounds = plan, None
        self.tie_points = check_schedule(stage.ties, self.actions, stage.rank, microbatches)
        self.stage, self.loss_fn = stage, loss_fn
        self.microbatches, self.schedule, self.loss_reduction = microbatches, schedule, loss_reduction
        self._host = self.runtime.topology.direct(stage.process_set)
        self.link = StageLink(self._host)
        self.profile = StepProfile()

    def _waiting(self, what: str):
        ranks = self.runtime.topology.ranks_of(self.stage.process_set)
        return self.runtime.watchdog.waiting("a pipeline step",
                                        lambda: f"pipeline rank {self.stage.rank}'s wait for {what} "
                                                f"(pipeline world ranks {ranks})", ranks)

    def step(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step of the schedule: every micro-batch's forward and backward through the
        stages; gradients accumulate in the stage's parameters.  The stages first check, in one
        exchange, that all run the same schedule and that the batch splits into equal
        micro-batches, so a problem raises the same error on every stage.

        Collective: every rank of the stage's pipeline set (``stage.process_set``) calls it, in the
        same order.

        :param inputs: the batch, on the first stage (None elsewhere): its first dimension is split
            into the micro-batches.
        :param targets: the targets, on the last stage (None elsewhere), split the same way.
        :returns: the step's loss (mean or sum of the micro-batch losses), on every stage, as a
            float64 tensor on the stage's device: on a GPU the step never waits for the device
            itself (except to move a shared parameter's value or gradient, and where ranks share
            a GPU), and reading the loss (``.item()``) is where the host waits for it.
        """
        with self._waiting("the agreement at the start of a pipeline step"):
            self._agree(inputs, targets)
            device = next(self.stage.parameters(), torch.empty(0)).device
            on_device = self.link.on_device(device) is not None  # made here, by every stage at once
        self._share_tied_values()
        run = StepRun(self, _split(inputs, self.microbatches), _split(targets, self.microbatches))
        with aux_loss_share(self.stage, 1.0 / self.microbatches):  # one MoE aux term per step, not per micro-batch
            loss = run.execute()
        if on_device:  # stream-ordered on the device: the host reads the loss when it needs it
            self._host.broadcast_(loss, self.stage.stages - 1, label="pipeline", check=False)
        else:
            with self._waiting("the loss broadcast at the end of a pipeline step"):
                self._host.broadcast(loss, root=self.stage.stages - 1).wait()
        self.profile = run.profile
        return loss.squeeze(0)

    def _message_rounds(self) -> dict[Action, int]:
        """This rank's rounds of device messages (:mod:`psrt.pp.rounds`), found at the first step
        on a device and kept."""
        if self._rounds is None:
            self._rounds = message_rounds(self._plan)[self.stage.rank]
        return self._rounds

    def _share_tied_values(self) -> None:
        """Every shared parameter's owner sends its value (as the last optimizer step left it)
        to the ranks holding copies, which take it before their first forward."""
        sends = []
        for tie in self.stage.ties:
            if tie.is_owner:
                sends += [self.link.send(tie.tensor, peer, TIED_VALUE_TAG, tie.index) for peer in tie.peers]
            else:
                value = self.link.recv_tied(tie.owner, TIED_VALUE_TAG, tie.index, tie.tensor)
                with torch.no_grad():
                    tie.tensor.copy_(value)
        with self._waiting("the delivery of its shared parameters' values"):
            for request in sends:
                request.wait()

    def _agree(self, inputs: torch.Tensor | None, targets: torch.Tensor | None) -> None:
        """Every stage checks, in one exchange, that all run the same schedule, that the
        batch is there and splits into equal micro-batches: any problem raises the same
        error on every stage, so none is left waiting for a message."""
        stage = self.stage
        first, last = stage.rank == 0, stage.rank == stage.stages - 1
        mine = (self.schedule, self.microbatches, stage.chunks, stage.cut,
                _rows("inputs", inputs, first), _rows("targets", targets, last))
        everyone = self._host.allgather_object(mine)
        for rank, theirs in enumerate(everyone):
            if theirs[:3] != mine[:3]:
                raise InvalidArgumentError(
                    f"pipeline stages disagree: stage {stage.rank} runs {mine[0]!r} with {mine[1]} micro-batches "
                    f"and {mine[2]} chunks, stage {rank} runs {theirs[0]!r} with {theirs[1]} and {theirs[2]}")
            if theirs[3] != mine[3]:
                raise InvalidArgumentError(
                    f"pipeline stages cut the model differently: stage {stage.rank} gives the virtual stages the "
                    f"blocks {list(mine[3])}, stage {rank} {list(theirs[3])}; give every rank the same split or "
                    "balance (and the same model)")
        rows, target_rows = everyone[0][4], everyone[-1][5]
        for what, value in (("first", rows), ("last", target_rows)):
            if isinstance(value, str):
                raise InvalidArgumentError(f"the {what} pipeline stage {value}")
        if rows != target_rows:
            raise InvalidArgumentError(f"the first stage has a batch of {rows} rows but the last stage has "
                                       f"{target_rows} rows of targets")
        if rows % self.microbatches:
            raise InvalidArgumentError(f"a batch of {rows} rows does not split into {self.microbatches} "
                                       "micro-batches of equal size")


def _schedule_for(stage: PipelineStage, schedule: str | None) -> str:
    """The schedule to run: the one the stage's chunks call for, or the one named, which must
    agree with them (interleaving is chosen by ``PipelineStage(chunks=)`` alone)."""
    interleaved = stage.chunks > 1
    if schedule is None:
        return "interleaved" if interleaved else "1f1b"
    if not isinstance(schedule, str):
        raise ArgumentTypeError(f"schedule must be a str or None, got {type(schedule).__name__}")
    if (schedule.lower() == "interleaved") != interleaved:
        holds = f"holds {stage.chunks} model chunks per rank" if interleaved else "holds one model chunk per rank"
        fix = ("leave schedule unset, or build the stage with chunks=1 for another schedule" if interleaved else
               "build the PipelineStage with chunks=v > 1 to interleave, or leave schedule unset for 1F1B")
        raise InvalidArgumentError(f"schedule {schedule!r} does not fit the PipelineStage, which {holds}: {fix}")
    return schedule


def _rows(what: str, tensor: object, needed: bool) -> int | str | None:
    """The batch size of a stage's inputs or targets, or what is wrong with them (as text,
    so that the problem travels to every stage before anyone raises)."""
    if not needed:
        return None
    if tensor is None:
        return f"needs the {what}"
    if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
        return f"needs the {what} as a tensor with a batch dimension, got {type(tensor).__name__}"
    return tensor.shape[0]


def _split(batch: torch.Tensor | None, microbatches: int) -> list[torch.Tensor] | None:
    return None if batch is None else list(batch.chunk(microbatches))
