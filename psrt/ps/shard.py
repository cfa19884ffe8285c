"""One chunk of one key on its server: the value, its optimizer, and the clocks that
decide when a push is applied and when a pull may be answered.

The rules of the three consistency modes live here, apart from any messaging,
so they can be tested with plain tensors:

* ``received[w]`` counts the pushes worker ``w`` has announced, ``applied[w]``
  those whose gradient is already in the value.  A pull from ``w`` is answered
  only once every push ``w`` sent before it is applied.
* sync: a push waits until every worker has pushed for the same step; then
  the step's gradients are summed in worker order, scaled, and applied as one
  update, and every worker's ``applied`` advances together.
* async: each push is applied on arrival.
* bounded (max staleness τ): a worker's k-th push is applied once every active
  worker's first k + 1 - τ pushes have arrived, so no worker's updates run more
  than τ steps ahead of the slowest, and a pull (which waits for the worker's
  own pushes) blocks a worker that is more than τ steps ahead until the slowest
  catches up.  With τ = 0 each step's pushes are applied together, after all of
  them arrived, and every read sees exactly the previous steps: sync mode's
  values (up to rounding: one update per push instead of one per step).

With reduce="mean" every gradient is scaled by 1/num_workers: in sync mode
that is the mean of the step; in the other modes a round of one push per
worker moves the parameters as far as one sync step, which is what makes
bounded mode with τ = 0 and SGD compute what sync mode does.  Without an
optimizer a push is a value, not a gradient: sync mode stores the step's
mean (or sum), the other modes store each push as it is.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Sequence

import torch

from psrt.comm.buffers import host_buffer
from psrt.errors import ArgumentTypeError, InvalidArgumentError
from psrt.ps.protocol import Mode


@dataclass(frozen=True)
class Consistency:
    mode: Mode
    max_staleness: int  # only for Mode.BOUNDED
    scale: float        # applied to every gradient: 1/num_workers for "mean", 1 for "sum"


@dataclass(frozen=True)
class OptimizerSpec:
    """A torch.optim class by name and its hyperparameters (JSON-friendly)."""

    name: str
    hyperparameters: dict

    def build(self, param: torch.nn.Parameter) -> torch.optim.Optimizer:
        cls = getattr(torch.optim, self.name, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise InvalidArgumentError(f"unknown optimizer {self.name!r}: expected the name of a "
                                       "torch.optim class such as 'SGD' or 'Adam'")
        options = {k: tuple(v) if isinstance(v, list) else v for k, v in self.hyperparameters.items()}
        return cls([param], **options)


_OPTIMIZERS = {name.lower(): name for name in dir(torch.optim)
               if isinstance(getattr(torch.optim, name), type)
               and issubclass(getattr(torch.optim, name), torch.optim.Optimizer)
               and name != "Optimizer"}


def optimizer_spec(optimizer: str | type, hyperparameters: dict) -> OptimizerSpec:
    """The spec of ``optimizer`` (a torch.optim class or its name) with ``hyperparameters``,
    checked on the worker before anything is sent (by building it once)."""
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        name = optimizer.__name__
    elif isinstance(optimizer, str):
        name = optimizer
    else:
        raise ArgumentTypeError(f"optimizer must be a torch.optim class or its name, got {optimizer!r}")
    if name.lower() not in _OPTIMIZERS:
        raise InvalidArgumentError(f"unknown optimizer {name!r}: expected one of torch.optim's, "
                                   f"e.g. {sorted(_OPTIMIZERS.values())[:6]}")
    options = {k: list(v) if isinstance(v, tuple) else v for k, v in hyperparameters.items()}
    for k, v in options.items():
        if not isinstance(v, (int, float, bool, str, list, type(None))):
            raise ArgumentTypeError(f"optimizer option {k}={v!r} is not a number, bool, str or tuple")
    spec = OptimizerSpec(_OPTIMIZERS[name.lower()], options)
    spec.build(torch.nn.Parameter(torch.zeros(1)))  # raises torch's own message for a bad option
    return spec


@dataclass
class WaitingPull:
    worker: int
    tag: int
    target: int  # pushes of this worker that must be applied first
    since: float = field(default_factory=time.monotonic)
    reported: bool = False


@dataclass(frozen=True)
class ChunkMeta:
    key: str
    shape: tuple[int, ...]  # of the whole key
    dtype: torch.dtype
    offset: int
    numel: int

    def describe(self) -> str:
        return f"key {self.key!r} (elements {self.offset}..{self.offset + self.numel})"


class Shard:
    """A chunk's value and optimizer state, and the pushes and pulls waiting on it."""

    def __init__(self, meta: ChunkMeta, num_workers: int, consistency: Consistency) -> None:
        self.meta, self.consistency = meta, consistency
        self.num_workers = num_workers
        self.param: torch.nn.Parameter | None = None  # set by the first init with data
        self.optimizer: torch.optim.Optimizer | None = None
        self.received = [0] * num_workers
        self.applied = [0] * num_workers
        self.updates = 0        # optimizer steps (or assignments) applied
        self.pushes_applied = 0
        self.sending = 0        # replies still reading the value: no update until they finish
        self.failed: str | None = None  # why an update failed; the chunk refuses requests from then on
        self.staleness: Counter[int] = Counter()
        self.pulls: list[WaitingPull] = []
        self._arrivals: list[deque[torch.Tensor]] = [deque() for _ in range(num_workers)]  # data in, not applied
        self._free: list[torch.Tensor] = []
        self._grad: torch.Tensor | None = None

    # -- value and optimizer -------------------------------------------------------
    @property
    def value(self) -> torch.Tensor:
        assert self.param is not None, "shard used before its value arrived"
        return self.param.detach()

    def set_value(self, data: torch.Tensor) -> None:
        self.param = torch.nn.Parameter(data.reshape(-1), requires_grad=data.is_floating_point())
        self.optimizer = None

    def set_optimizer(self, spec: OptimizerSpec | None) -> None:
        """Use ``spec`` from now on (fresh state); ``None`` assigns pushed values (MXNet's
        KVStore without an updater)."""
        if self.param is not None:
            self.optimizer = None if spec is None else spec.build(self.param)

    def set_lr(self, lr: float) -> None:
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr

    # -- pushes ------------------------------------------------------------------------
    def spare_buffer(self) -> torch.Tensor:
        """A buffer to receive a push into: one an update left free, or a new one."""
        return self._free.pop() if self._free else host_buffer(self.meta.numel, self.meta.dtype)

    def expect_push(self, worker: int) -> torch.Tensor:
        """Count a push announced by ``worker``; returns a buffer for a push's data (the
        server receives this push into the buffer it posted ahead, and the next one into this)."""
        self.received[worker] += 1
        return self.spare_buffer()

    def arrived(self, worker: int, buffer: torch.Tensor) -> None:
        """``buffer`` holds ``worker``'s next announced push (a worker's arrive in order)."""
        self._arrivals[worker].append(buffer)

    def _head_arrived(self, worker: int) -> bool:
        return bool(self._arrivals[worker])

    def _arrived_total(self, worker: int) -> int:
        return self.applied[worker] + len(self._arrivals[worker])

    def _may_apply(self, worker: int, active: Sequence[int]) -> bool:
        """Whether ``worker``'s next push may be applied (bounded mode's gate)."""
        if self.consistency.mode != Mode.BOUNDED:
            return True
        slowest = min((self._arrived_total(w) for w in active), default=self.applied[worker] + 1)
        return self.applied[worker] + 1 - slowest <= self.consistency.max_staleness

    def apply_ready(self, active: Sequence[int] | None = None) -> int:
        """Apply every push the consistency mode allows (``active``: the workers that have not
        shut down, default all); returns how many updates ran."""
        if self.sending or self.param is None:
            return 0
        workers = range(self.num_workers)
        active = workers if active is None else active
        updates = 0
        if self.consistency.mode == Mode.SYNC:
            while all(self._head_arrived(w) for w in workers):
                buffers = [self._arrivals[w].popleft() for w in workers]
                total = self._sum(buffers)
                spent = self._update(total)
                if total is self._grad:
                    self._grad = spent
                else:
                    buffers = [spent if b is total else b for b in buffers]
                self._free.extend(buffers)
                self.applied = [n + 1 for n in self.applied]
                self.pushes_applied += len(buffers)
                updates += 1
            return updates
        for w in workers:
            while self._head_arrived(w) and self._may_apply(w, active):
                buffer = self._arrivals[w].popleft()
                if self.consistency.scale != 1.0 and self.optimizer is not None:  # a gradient, not a value
                    buffer.mul_(self.consistency.scale)
                self._free.append(self._update(buffer))
                self.applied[w] += 1
                self.pushes_applied += 1
                updates += 1
        return updates

    def _sum(self, buffers: Sequence[torch.Tensor]) -> torch.Tensor:
        if len(buffers) == 1:
            total = buffers[0]
        else:
            if self._grad is None:
                self._grad = host_buffer(self.meta.numel, self.meta.dtype)
            total = torch.add(buffers[0], buffers[1], out=self._grad)
            for buffer in buffers[2:]:
                total.add_(buffer)
        if self.consistency.scale != 1.0:
            total.mul_(self.consistency.scale)
        return total

    def _update(self, gradient: torch.Tensor) -> torch.Tensor:
        """Apply one update; returns the buffer it leaves free: ``gradient``'s, or after an
        assignment (no optimizer) the old value's, since assigning swaps the buffers."""
        self.updates += 1
        if self.optimizer is None:
            old, self.param.data = self.param.data, gradient
            return old
        self.param.grad = gradient
        self.optimizer.step()
        self.param.grad = None
        return gradient

    def pushes_in_flight(self) -> bool:
        """Whether some announced push is not yet applied."""
        return self.received != self.applied

    # -- pulls -------------------------------------------------------------------------
    def add_pull(self, worker: int, tag: int) -> None:
        self.pulls.append(WaitingPull(worker, tag, target=self.received[worker]))

    def _lead(self, worker: int, active: Sequence[int]) -> int:
        """How many steps ``worker`` is ahead of the slowest active worker."""
        others = [self.applied[w] for w in active] or [self.applied[worker]]
        return max(0, self.applied[worker] - min(others))

    def ready_pulls(self, active: Sequence[int]) -> list[WaitingPull]:
        """Remove and return the pulls that may be answered now (``active``: the workers
        that have not shut down), recording each one's staleness."""
        if self.param is None:
            return []
        ready, waiting = [], []
        for pull in self.pulls:
            lead = self._lead(pull.worker, active)
            allowed = self.applied[pull.worker] >= pull.target and not (
                self.consistency.mode == Mode.BOUNDED and lead > self.consistency.max_staleness)
            if allowed:
                self.staleness[lead] += 1
                ready.append(pull)
            else:
                waiting.append(pull)
        self.pulls = waiting
        return ready

    def missing_for(self, pull: WaitingPull, active: Sequence[int]) -> list[int]:
        """The workers that have yet to push what the waiting ``pull`` needs before it can be
        answered.  A push counts once announced: its data is then on its way, and the worker
        has done its part (deadlock detection relies on that, :func:`psrt.ps.stalls.holds`)."""
        if self.consistency.mode == Mode.SYNC:
            return [w for w in range(self.num_workers) if self.received[w] < pull.target]
        if self.consistency.mode == Mode.BOUNDED:
            mine = self.applied[pull.worker]
            if mine < pull.target:  # its own next push waits for the slowest to push
                return [w for w in active if self.received[w] < mine + 1 - self.consistency.max_staleness]
            return [w for w in active if self.received[w] < mine - self.consistency.max_staleness]
        return []

    # -- checkpoints ---------------------------------------------------------------------
    def state(self) -> dict:
        return {"key": self.meta.key, "offset": self.meta.offset, "numel": self.meta.numel,
                "shape": list(self.meta.shape), "dtype": str(self.meta.dtype),
                "value": self.value.clone(), "applied": list(self.applied), "updates": self.updates,
                "pushes_applied": self.pushes_applied,
                "optimizer": None if self.optimizer is None else self.optimizer.state_dict()}

    def restore(self, state: dict) -> None:
        """Take value, clocks and optimizer state from :meth:`state` of the same chunk."""
        self.value.copy_(state["value"])
        clock = min(state["applied"])  # a different worker count restarts every clock here
        same_workers = len(state["applied"]) == self.num_workers
        self.applied = list(state["applied"]) if same_workers else [clock] * self.num_workers
        self.received = list(self.applied)
        self.updates, self.pushes_applied = state["updates"], state["pushes_applied"]
        if state["optimizer"] is not None:
            if self.optimizer is None:
                raise InvalidArgumentError(
                    f"the checkpoint of {self.meta.describe()} has optimizer state but no optimizer "
                    "is set: call set_optimizer() before load()")
            self.optimizer.load_state_dict(state["optimizer"])
