"""A machine profile: the measured figures the cost model turns FLOPs and bytes into seconds.

``psrt plan --measure`` (:mod:`psrt.plan.probe`) writes one as JSON; ``psrt plan --machine
FILE`` reads it back.  Every figure is per rank with every rank of the probe busy at once,
as in a training step.  Without a profile the planner uses :func:`default_machine`, the
figures of one probe run on psrt's 2-core development VM, labelled as such.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

from psrt.errors import ArgumentTypeError, InvalidArgumentError


@dataclass(frozen=True)
class Link:
    """A collective or message of ``nbytes`` costs ``latency_s`` plus its ring volume over
    ``bandwidth`` (bytes/s: bus bandwidth for collectives, payload bandwidth for messages)."""

    latency_s: float
    bandwidth: float

    def seconds(self, volume: float) -> float:
        return self.latency_s + volume / self.bandwidth

    @classmethod
    def fit(cls, points: list[tuple[float, float]]) -> Link:
        """From measured (volume, seconds): the bandwidth of the least-squares line, and the
        latency left of the smallest message's time once its volume is paid."""
        points = sorted(points)
        if not points or any(not (v > 0 and t > 0) for v, t in points):
            raise InvalidArgumentError(f"fitting a link needs positive (bytes, seconds) points, got {points}")
        mean_v = sum(v for v, _ in points) / len(points)
        mean_t = sum(t for _, t in points) / len(points)
        spread = sum((v - mean_v) ** 2 for v, _ in points)
        slope = sum((v - mean_v) * (t - mean_t) for v, t in points) / spread if spread else 0.0
        if not slope > 0:  # one size, or noise: the largest message's rate
            slope = points[-1][1] / points[-1][0]
        smallest_v, smallest_t = points[0]
        return cls(latency_s=max(0.0, smallest_t - smallest_v * slope), bandwidth=1.0 / slope)


@dataclass(frozen=True)
class Machine:
    """Figures per rank.

    ``matmul`` lists (n, FLOP/s) of n × n float matrix products; a product of other shapes
    runs at the rate of a square one of the same volume (interpolated in log-log).
    ``layer_overhead_s`` is what one small transformer block's forward and backward cost
    beyond their FLOPs (dispatch and small kernels), charged per block and micro-batch.
    ``engine_allreduce``: ``hvd.allreduce`` (data parallelism and ZeRO); ``direct_allreduce``:
    the direct path's collectives (tensor parallelism); ``p2p``: pipeline messages.
    ``optimizer_s_per_param``: one Adam step per parameter; ``memcpy_bandwidth``: bytes copied
    per second.
    """

    name: str
    measured: bool
    matmul: tuple[tuple[int, float], ...]
    layer_overhead_s: float
    engine_allreduce: Link
    direct_allreduce: Link
    p2p: Link
    optimizer_s_per_param: float
    memcpy_bandwidth: float
    details: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.matmul:
            raise InvalidArgumentError("a machine profile needs at least one matmul measurement")
        object.__setattr__(self, "matmul", tuple(sorted((int(n), float(f)) for n, f in self.matmul)))
        for n, flops in self.matmul:
            if n < 1 or not flops > 0:
                raise InvalidArgumentError(f"matmul entry ({n}, {flops}) must have n >= 1 and FLOP/s > 0")
        for name in ("layer_overhead_s", "optimizer_s_per_param"):
            if not getattr(self, name) >= 0:
                raise InvalidArgumentError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("engine_allreduce", "direct_allreduce", "p2p"):
            link = getattr(self, name)
            if not (link.latency_s >= 0 and link.bandwidth > 0):
                raise InvalidArgumentError(f"{name} needs latency_s >= 0 and bandwidth > 0, got {link}")
        if not self.memcpy_bandwidth > 0:
            raise InvalidArgumentError(f"memcpy_bandwidth must be > 0, got {self.memcpy_bandwidth!r}")

    def flops(self, n: float) -> float:
        """FLOP/s of a product of the volume of an n × n one."""
        points = self.matmul
        if n <= points[0][0] or len(points) == 1:
            return points[0][1]
        if n >= points[-1][0]:
            return points[-1][1]
        for (n0, f0), (n1, f1) in zip(points, points[1:]):
            if n0 <= n <= n1:
                w = math.log(n / n0) / math.log(n1 / n0)
                return math.exp((1 - w) * math.log(f0) + w * math.log(f1))
        raise AssertionError("unreachable")

    def matmul_seconds(self, m: int, k: int, n: int) -> float:
        """An (m × k) @ (k × n) product."""
        return 2.0 * m * k * n / self.flops((m * k * n) ** (1 / 3))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_dict(cls, data: dict) -> Machine:
        if not isinstance(data, dict):
            raise ArgumentTypeError(f"a machine profile is a JSON object, got {type(data).__name__}")
        try:
            links = {name: Link(**data[name]) for name in ("engine_allreduce", "direct_allreduce", "p2p")}
            return cls(name=str(data["name"]), measured=bool(data["measured"]),
                       matmul=tuple(tuple(point) for point in data["matmul"]),
                       layer_overhead_s=float(data["layer_overhead_s"]),
                       optimizer_s_per_param=float(data["optimizer_s_per_param"]),
                       memcpy_bandwidth=float(data["memcpy_bandwidth"]), details=dict(data.get("details", {})),
                       **links)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"not a psrt machine profile ({type(exc).__name__}: {exc}); write one with "
                                       "`psrt plan --measure`") from exc


def load_machine(path: str) -> Machine:
    """The profile in the JSON file ``path``."""
    with open(path, encoding="utf-8") as handle:
        try:
            data = json.load(handle)
        except json.JSONDecodeError as exc:
            raise InvalidArgumentError(f"{path} is not JSON ({exc}); write a profile with `psrt plan --measure`") \
                from exc
    return Machine.from_dict(data)


def default_machine() -> Machine:
    """Figures of one probe run on psrt's development VM (2 vCPUs, no GPU, 2 ranks, one torch
    thread each; 2026-11-24), not of the machine you are on: measure yours with
    ``psrt plan --measure``."""
    return Machine(
        name="default profile (NOT measured here: psrt's 2-core development VM, 2026-11-24)",
        measured=False,
        matmul=((64, 9.0e9), (128, 20.0e9), (256, 30.0e9), (512, 34.0e9), (1024, 35.0e9)),
        layer_overhead_s=1.0e-3,
        engine_allreduce=Link(latency_s=2.0e-4, bandwidth=2.0e9),
        direct_allreduce=Link(latency_s=1.0e-4, bandwidth=2.0e9),
        p2p=Link(latency_s=5.0e-5, bandwidth=3.0e9),
        optimizer_s_per_param=2.0e-9,
        memcpy_bandwidth=5.0e9,
    )
