"""The runtime is an explicit object: what lives as long as one ``init()`` is held by it.

Handles, made-up collective names and the parallel layers' statistics belong to the
runtime, so a new ``init()`` starts them afresh; the objects that keep using the
runtime are given it and refuse anything else.  One process, no launcher.
"""
from __future__ import annotations

import pytest
import torch

import psrt.torch as hvd
from psrt import cp, ep, tp
from psrt import runtime as runtimes
from psrt.engine.names import Names
from psrt.errors import ArgumentTypeError, InvalidArgumentError, NotInitializedError
from psrt.grid import ProcessGrid
from psrt.pp import Pipeline, PipelineStage
from psrt.ps import KVStore
from psrt.zero import ZeroOptimizer


@pytest.fixture(autouse=True)
def initialised():
    hvd.init()
    yield
    hvd.shutdown()


def test_names_follow_one_convention():
    names = Names()
    assert [names.unnamed("allreduce"), names.unnamed("allgather")] == ["allreduce.noname.0", "allgather.noname.1"]
    assert [names.instance("zero", 0), names.instance("zero", 0), names.instance("zero", 3),
            names.instance("DistributedOptimizer", 0)] == ["zero.set0.0", "zero.set0.1", "zero.set3.0",
                                                           "DistributedOptimizer.set0.0"]


def test_a_new_runtime_starts_its_names_afresh():
    first = runtimes.current()
    first.names.unnamed("allreduce")
    assert first.names.instance("zero", 0) == "zero.set0.0"
    hvd.shutdown()
    hvd.init()
    second = runtimes.current()
    assert second is not first
    assert second.names.unnamed("allreduce") == "allreduce.noname.0"
    assert second.names.instance("zero", 0) == "zero.set0.0"


def test_optimizers_name_their_collectives_by_kind_and_set():
    model = torch.nn.Linear(3, 2)
    ZeroOptimizer(model, torch.optim.SGD, stage=1, lr=0.1)
    hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
    names = runtimes.current().names
    assert names.instance("zero", 0) == "zero.set0.1"
    assert names.instance("DistributedOptimizer", 0) == "DistributedOptimizer.set0.1"


def test_a_handle_does_not_outlive_its_runtime():
    handle = hvd.allreduce_async(torch.ones(2))
    assert runtimes.current().handles.poll(handle) in (True, False)
    hvd.shutdown()
    hvd.init()
    with pytest.raises(InvalidArgumentError, match=f"handle {handle} is unknown"):
        hvd.synchronize(handle)


def test_handles_are_released_once():
    handle = hvd.allreduce_async(torch.ones(2))
    assert torch.equal(hvd.synchronize(handle), torch.ones(2))
    with pytest.raises(InvalidArgumentError, match="already synchronized"):
        hvd.poll(handle)
    with pytest.raises(ArgumentTypeError, match="handle must be the int"):
        hvd.synchronize("0")


def test_layer_statistics_belong_to_the_runtime():
    stats = tp.stats()
    assert stats is runtimes.current().stats["tensor-parallel"]
    stats.counts["all_reduce"] += 3
    hvd.shutdown()
    hvd.init()
    assert not tp.stats().counts and tp.stats() is not stats
    assert cp.stats() is runtimes.current().stats["context-parallel"]
    assert ep.stats() is runtimes.current().stats["expert-parallel"]


def test_objects_are_given_the_current_runtime_by_default():
    grid = ProcessGrid(dp=1)
    assert grid.runtime is runtimes.current()
    assert ProcessGrid(dp=1, runtime=runtimes.current()).runtime is runtimes.current()
    zero = ZeroOptimizer(torch.nn.Linear(2, 2), torch.optim.SGD, stage=2, lr=0.1, runtime=runtimes.current())
    assert zero.runtime is runtimes.current()
    stage = PipelineStage([torch.nn.Linear(2, 2)], grid.pp_set)
    pipeline = Pipeline(stage, torch.nn.functional.mse_loss, microbatches=1)
    assert pipeline.runtime is runtimes.current()


@pytest.mark.parametrize("build", [
    lambda runtime: ProcessGrid(dp=1, runtime=runtime),
    lambda runtime: ZeroOptimizer(torch.nn.Linear(2, 2), torch.optim.SGD, lr=0.1, runtime=runtime),
    lambda runtime: Pipeline(PipelineStage([torch.nn.Linear(2, 2)], hvd.global_process_set),
                             torch.nn.functional.mse_loss, microbatches=1, runtime=runtime),
    lambda runtime: KVStore(runtime=runtime),
], ids=["ProcessGrid", "ZeroOptimizer", "Pipeline", "KVStore"])
def test_objects_refuse_what_is_not_a_runtime(build):
    with pytest.raises(ArgumentTypeError, match="runtime must be a psrt Runtime.*got str"):
        build("current")


def test_a_shut_down_runtime_is_refused():
    old = runtimes.current()
    hvd.shutdown()
    hvd.init()
    with pytest.raises(NotInitializedError, match="was shut down"):
        ProcessGrid(dp=1, runtime=old)


def test_a_store_outside_parameter_server_mode_names_the_launch_flag():
    with pytest.raises(InvalidArgumentError, match="--num-servers"):
        KVStore(runtime=runtimes.current())
