"""Pipeline parallelism: a model given as a list of blocks is cut into stages, one per
rank of the PP process set, and micro-batches stream through them following a
schedule that is built and checked as a plain value before one executor runs it."""
from psrt.models.stage_layout import StageLayout
from psrt.pp.executor import Pipeline
from psrt.pp.step import StepProfile
from psrt.pp.partition import balanced_split, explicit_split
from psrt.pp.schedule import Action, Op, build, gpipe, interleaved_one_f_one_b, one_f_one_b, zero_bubble_h1
from psrt.pp.simulate import Event, bubble_fraction, check, in_flight, makespan, simulate
from psrt.pp.cut import SplitStage, split
from psrt.pp.stage import PipelineStage
from psrt.pp.timeline import render

__all__ = [
    "Action", "Event", "Op", "Pipeline", "PipelineStage", "SplitStage", "StageLayout", "StepProfile", "balanced_split", "bubble_fraction",
    "build", "check", "explicit_split", "gpipe", "in_flight", "interleaved_one_f_one_b", "makespan",
    "one_f_one_b", "render", "simulate", "split", "zero_bubble_h1",
]
