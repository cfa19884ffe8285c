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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for fake_device

import _harness  # noqa: E402
import fake_device  # noqa: E402
import psrt.runtime  # noqa: E402
import psrt.torch as hvd  # noqa: E402
from psrt.comm.base import ElementwiseOp  # noqa: E402
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
        _harness.run(checks)
        hvd.shutdown()


if __name__ == "__main__":
    main()
