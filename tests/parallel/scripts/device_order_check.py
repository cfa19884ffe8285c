"""The GPU data path's ordering, checked without a GPU: every step runs with host memory playing
the device's (``tests/fake_device.py``: streams, events and NCCL calls recorded), and must
show no host wait, no collective that did not wait for its producer's ready event, no use of
a collective's memory before its consumer waited, no memory freed before its last use; and
give the results of the same computation in one process.

Two controls break the order on purpose and must be seen.  Run as
``psrun -np 2 python device_order_check.py``; rank 0 prints one JSON line per check.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for fake_device

import _harness  # noqa: E402
import fake_device  # noqa: E402
import psrt.runtime  # noqa: E402
import psrt.torch as hvd  # noqa: E402
from psrt import pp  # noqa: E402
from psrt.comm.base import ElementwiseOp  # noqa: E402
from psrt.errors import CollectiveMismatchError  # noqa: E402
from psrt.grid import ProcessGrid  # noqa: E402
from psrt.zero import ZeroOptimizer  # noqa: E402

CUDA: fake_device.FakeCuda | None = None
STEPS = 3
TIGHT = {"rtol": 1e-10, "atol": 1e-12}


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4)).double()


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(4, 8, generator=generator, dtype=torch.float64),
            torch.randn(4, 4, generator=generator, dtype=torch.float64))


def _reference(optimizer_class, **options) -> torch.nn.Module:
    """The same training in one process: every rank's batch at once (the loss is a mean over
    equal batches, so the average of the ranks' gradients is the whole batch's)."""
    model = _mlp()
    optimizer = optimizer_class(model.parameters(), **options)
    for step in range(STEPS):
        batches = [_batch(step, rank) for rank in range(hvd.size())]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def _train(model, step_once) -> None:
    """Train for STEPS steps; the fake's findings of every step after the first must be none."""
    for step in range(STEPS):
        CUDA.clear()
        step_once(*_batch(step, hvd.rank()))
        problems = CUDA.problems()
        assert not problems, f"step {step}: {len(problems)} problems, first: {problems[:3]}"
        assert CUDA.collectives, f"step {step} ran no collective on the fake device"


def _matches(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(mine.detach(), theirs.detach(), **TIGHT, msg=f"parameter {name}")


def check_dp_step(key: str) -> None:
    model = _mlp()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(),
                                         bucketing=hvd.Bucketing(first_bucket_bytes=256, bucket_bytes=1024,
                                                                 overlap=True))

    def step(x, y) -> None:
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    _train(model, step)
    _matches(model, _reference(torch.optim.SGD, lr=0.1))


def check_zero_step(key: str, stage: int) -> None:
    model = _mlp()
    optimizer = ZeroOptimizer(model, torch.optim.SGD, stage=stage, lr=0.1, reduce_bucket_size=200,
                              allgather_bucket_size=200, overlap=True)

    def step(x, y) -> None:
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    _train(model, step)
    with optimizer.gathered_parameters():
        _matches(model, _reference(torch.optim.SGD, lr=0.1))


def check_zero3_prefetches_before_compute(key: str) -> None:
    """Once the order is known, the gathers of the units a unit prefetches start before the
    wait for its own gather (which then negotiates them in the same round, so they are issued
    before its compute, not after)."""
    model = _mlp()
    optimizer = ZeroOptimizer(model, torch.optim.SGD, stage=3, lr=0.1, allgather_bucket_size=200)
    gatherer = optimizer.gatherer
    log: list[tuple[str, int]] = []
    for index, unit in enumerate(gatherer.units):
        for group in unit.groups:
            start, finish = group.start_gather, group.finish_gather
            group.start_gather = lambda start=start, index=index: (log.append(("gather", index)), start())[1]
            group.finish_gather = lambda finish=finish, index=index: (log.append(("wait", index)), finish())[1]
        unit.module.register_forward_pre_hook(lambda module, args, index=index: log.append(("compute", index)))

    def step(x, y) -> None:
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    step(*_batch(0, hvd.rank()))
    ahead, _ = gatherer.prefetch_lists()
    assert any(ahead), f"no unit prefetches anything: {ahead}"
    log.clear()
    step(*_batch(1, hvd.rank()))
    for position, (what, index) in enumerate(log):
        if what == "compute":
            waited = max(i for i, event in enumerate(log[:position]) if event == ("wait", index))
            started = {unit for kind, unit in log[:waited] if kind == "gather"}
            missing = [unit for unit in ahead[index] if unit not in started]
            assert not missing, f"unit {index} waited for its gather before those of {missing} started: {log}"


def _blocks() -> list[torch.nn.Module]:
    """_mlp's layers as pipeline blocks."""
    layers = list(_mlp())
    return [torch.nn.Sequential(*layers[0:2]), torch.nn.Sequential(*layers[2:4]), layers[4]]


def check_pipeline_1f1b_step(key: str) -> None:
    """A 1F1B step over every rank (one stage each), four micro-batches: activations and their
    gradients go over the fake NCCL on the point-to-point stream, the loss stays on the device;
    loss and parameters after each step must be one process's on the whole batch."""
    grid = ProcessGrid(dp=1, tp=1, pp=hvd.size())
    stage = pp.PipelineStage(_blocks(), grid.pp_set)
    pipe = pp.Pipeline(stage, torch.nn.functional.mse_loss, microbatches=4, schedule="1f1b")
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.1)
    reference = torch.nn.Sequential(*_blocks())
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = (torch.cat(b) for b in zip(*[_batch(step, rank) for rank in range(hvd.size())]))
        CUDA.clear()
        loss = pipe.step(x if grid.is_first_stage else None, y if grid.is_last_stage else None)
        problems = [p for rank in hvd.allgather_object(CUDA.problems()) for p in rank]  # every rank stops alike
        assert not problems, f"step {step}: {len(problems)} problems, first: {problems[:3]}"
        messages = [stream for what, stream, _ in CUDA.collectives if what.startswith(("send", "receive"))]
        assert len(messages) == 2 * 4 and CUDA.compute not in messages, \
            f"step {step}: {len(messages)} messages, expected 8 off the compute stream"
        optimizer.step()
        optimizer.zero_grad()
        expected = torch.nn.functional.mse_loss(reference(x), y)
        expected.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        torch.testing.assert_close(loss, expected.detach(), **TIGHT, msg=f"step {step}'s loss")
    mine = dict(stage.named_parameters())
    for name, theirs in reference.named_parameters():
        if name in mine:
            torch.testing.assert_close(mine[name].detach(), theirs.detach(), **TIGHT, msg=f"parameter {name}")


def check_ddp_over_the_psrt_backend(key: str) -> None:
    """DistributedDataParallel over torch.distributed's "psrt" backend, with buckets small
    enough for several all-reduces a step: each runs on the group's own stream after the
    backward's ready event, DDP's reducer waits on its future (a stream wait), and the
    parameters equal one process's."""
    if not dist.is_initialized():
        dist.init_process_group("psrt")
    model = _mlp()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1024 / 2**20)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    group = dist.group.WORLD

    def step(x, y) -> None:
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        reduced = [stream for what, stream, _ in CUDA.collectives if what == "allreduce"]
        assert reduced and CUDA.compute not in reduced, f"all-reduces on {reduced}, not the group's stream"

    _train(model, step)
    _matches(model, _reference(torch.optim.SGD, lr=0.1))
    n, rank = hvd.size(), hvd.rank()  # a ring of sends and receives, waited for from the caller's stream
    x, into = torch.arange(4.0) + rank, torch.empty(4)
    CUDA.clear()
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, (rank + 1) % n, group),
                                    dist.P2POp(dist.irecv, into, (rank - 1) % n, group)])
    for work in works:
        work.wait()
    torch.testing.assert_close(into * 1, torch.arange(4.0) + (rank - 1) % n)
    assert not CUDA.problems(), CUDA.problems()[:3]


def check_a_mismatched_device_receive_names_both_ranks(key: str) -> None:
    """A receive of another shape than was sent, over the fake NCCL: the receiver raises when
    it waits, naming both ranks and both tensors; the payload was still taken off the link, so
    the next message arrives whole."""
    if not dist.is_initialized():
        dist.init_process_group("psrt")
    n, rank = hvd.size(), hvd.rank()
    dist.all_reduce(torch.ones(1))  # every member makes the group's device transport
    dist.send(torch.zeros(4), (rank + 1) % n)
    try:
        dist.recv(torch.empty(5), (rank - 1) % n)
        raise AssertionError("a receive of 5 elements took a message of 4")
    except CollectiveMismatchError as exc:
        assert "expects a float32 tensor of shape (5,) but rank" in str(exc), exc
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((3,), float(rank)), (rank + 1) % n),
                                    dist.P2POp(dist.irecv, into := torch.empty(3), (rank - 1) % n)])
    for work in works:
        work.wait()
    assert torch.equal(into * 1, torch.full((3,), float((rank - 1) % n))), into


def check_control_a_consumer_that_does_not_wait_is_seen(key: str) -> None:
    """Read an allreduce's buffer after starting it, before waiting: the fake must say so."""
    channel = psrt.runtime.current().channel(hvd.global_process_set)
    buffer = torch.ones(16, dtype=torch.float64)
    CUDA.clear()
    work = channel.start(channel.allreduce([buffer], name=key))
    work.wait()  # enqueued (on the host), not yet waited for by this stream
    _ = buffer * 2
    channel.wait(work)
    assert any("without waiting" in p for p in CUDA.unwaited), f"unseen: {CUDA.problems()}"


def check_control_a_collective_that_ignores_its_producer_is_seen(key: str) -> None:
    """Write a buffer on one stream and reduce it from another without the ready event."""
    data = psrt.runtime.current().topology.transport(hvd.global_process_set, torch.device("cpu"))
    other = CUDA.new_stream(torch.device("cpu"))
    buffer = torch.ones(16, dtype=torch.float64)
    CUDA.clear()
    buffer.mul_(3)  # on the compute stream
    with CUDA.using(other):
        data.allreduce(buffer, ElementwiseOp.SUM)
    assert CUDA.unready, f"unseen: {CUDA.problems()}"


def main() -> None:
    global CUDA
    psrt.runtime.shutdown()  # under the job server psrt is running: start again, on the fake device
    with fake_device.install() as cuda:
        CUDA = cuda
        hvd.init()
        checks = _harness.Checks()
        checks.add("control/a_consumer_that_does_not_wait_is_seen", check_control_a_consumer_that_does_not_wait_is_seen)
        checks.add("control/a_collective_that_ignores_its_producer_is_seen",
                   check_control_a_collective_that_ignores_its_producer_is_seen)
        checks.add("dp/step", check_dp_step)
        for stage in (1, 2, 3):
            checks.add(f"zero{stage}/step", check_zero_step, stage)
        checks.add("zero3/prefetches_before_compute", check_zero3_prefetches_before_compute)
        checks.add("pp/1f1b_step", check_pipeline_1f1b_step)
        checks.add("c10d/ddp_step", check_ddp_over_the_psrt_backend)
        checks.add("c10d/a_mismatched_receive_names_both_ranks", check_a_mismatched_device_receive_names_both_ranks)
        _harness.run(checks)
        if dist.is_initialized():
            dist.destroy_process_group()
        hvd.shutdown()


if __name__ == "__main__":
    main()
