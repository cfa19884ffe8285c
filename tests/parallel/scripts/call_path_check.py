"""A training step reaches MPI through its strategy's engine channel, not through the facade.

Every call on every thread is traced (``sys.setprofile`` and ``threading.setprofile``, set before
``psrt.init()`` so that the engine thread is traced too) while one step runs: a
``DistributedOptimizer`` step and a ZeRO-3 step must reach MPI (a method of the MPI transport
that moves tensor data runs: mpi4py's own methods are Cython functions, which a profiler does
not see) without calling any function ``psrt.torch`` exports (``hvd.allreduce_async_``,
``hvd.synchronize``...), the integer-handle table, or ``psrt.runtime.current()``.  A control
traces a plain ``hvd.allreduce`` and must find both, so the detector is known to see them.
"""
from __future__ import annotations

import sys
import threading
import types

import torch

import _harness
import psrt.runtime
import psrt.torch as hvd
from psrt.comm.mpi import MpiCommunicator
from psrt.engine.handles import HandleTable
from psrt.zero import ZeroOptimizer

#: The MPI transport's methods that move tensor data (negotiation rounds are persistent
#: allreduces of a few bytes, started elsewhere).
DATA_METHODS = {getattr(MpiCommunicator, name).__code__: name for name in
                ("allreduce_by", "iallreduce", "reduce_scatter_by", "allgatherv", "broadcast", "alltoallv")}


class CallTrace:
    """The functions called on any thread while recording."""

    def __init__(self) -> None:
        self.recording = False
        self.codes: set[types.CodeType] = set()
        self._lock = threading.Lock()

    def __call__(self, frame, event, arg) -> None:
        if self.recording and event == "call":
            with self._lock:
                self.codes.add(frame.f_code)

    @property
    def mpi(self) -> set[str]:
        """The data-moving MPI transport methods called."""
        return {DATA_METHODS[code] for code in self.codes if code in DATA_METHODS}

    def run(self, step) -> None:
        self.codes.clear()
        self.recording = True
        try:
            step()
        finally:
            self.recording = False


def _forbidden() -> dict[types.CodeType, str]:
    """The code of every function the Horovod-shaped facade exports, the handle table's and
    ``runtime.current``'s: what psrt's own strategies must not go through."""
    codes = {}
    for name in hvd.__all__:
        value = getattr(hvd, name)
        if isinstance(value, types.FunctionType):
            codes[value.__code__] = f"psrt.torch.{name}"
    for name in ("register", "poll", "synchronize"):
        codes[getattr(HandleTable, name).__code__] = f"HandleTable.{name}"
    codes[psrt.runtime.current.__code__] = "psrt.runtime.current"
    return codes


def _passed_through(trace: CallTrace) -> list[str]:
    forbidden = _forbidden()
    return sorted(forbidden[code] for code in trace.codes if code in forbidden)


TRACE = CallTrace()


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(hvd.rank())
    return torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)


def check_the_detector_sees_the_facade(key: str) -> None:
    TRACE.run(lambda: hvd.allreduce(torch.ones(2), name=key))
    seen = _passed_through(TRACE)
    assert "psrt.torch.allreduce" in seen and "psrt.runtime.current" in seen, f"the control saw only {seen}"
    assert TRACE.mpi, "the control reached no MPI collective"


def _assert_channel_only(what: str) -> None:
    seen = _passed_through(TRACE)
    assert not seen, f"{what} went through {seen}"
    assert TRACE.mpi, f"{what} reached no MPI collective"


def check_a_distributed_optimizer_step_goes_through_its_channel(key: str) -> None:
    for overlap in (True, False):
        model = _mlp()
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                             named_parameters=model.named_parameters(),
                                             bucketing=hvd.Bucketing(first_bucket_bytes=64, bucket_bytes=256,
                                                                     overlap=overlap))
        x, y = _batch()

        def step() -> None:
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()

        step()  # the first step caches each bucket's call
        TRACE.run(step)
        _assert_channel_only(f"a DistributedOptimizer step (overlap={overlap})")


def check_a_zero3_step_goes_through_its_channel(key: str) -> None:
    model = _mlp()
    optimizer = ZeroOptimizer(model, torch.optim.AdamW, stage=3, lr=1e-3)
    x, y = _batch()

    def step() -> None:
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    step()
    TRACE.run(step)
    _assert_channel_only("a ZeRO-3 step")


def main() -> None:
    psrt.runtime.shutdown()  # under the job server psrt is running: start again, traced from the start
    threading.setprofile(TRACE)
    sys.setprofile(TRACE)
    try:
        hvd.init()
        checks = _harness.Checks()
        checks.add("control/the_detector_sees_the_facade", check_the_detector_sees_the_facade)
        checks.add("dp/step_goes_through_its_channel", check_a_distributed_optimizer_step_goes_through_its_channel)
        checks.add("zero3/step_goes_through_its_channel", check_a_zero3_step_goes_through_its_channel)
        _harness.run(checks)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    hvd.shutdown()


if __name__ == "__main__":
    main()
