"""A machine profile: the measured figures the cost model turns FLOPs and bytes into seconds.

``psrt plan --measure`` (:mod:`psrt.plan.probe`) writes one as JSON; ``psrt plan --machine
FILE`` reads it back.  Every figure is per rank with every rank of the probe busy at once,
as in a training step.  ``--machine a100|h100|h200`` picks a GPU node built from published
figures (:mod:`psrt.plan.gpus`).  Without a profile the planner uses :func:`default_machine`,
the figures of one probe run on psrt's 2-core development VM, labelled as such.
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
    ``attention`` lists (head dim, FLOP/s) of causal fused attention, forward and backward.
    ``layer_overhead_s`` is what a tiny transformer block's forward and backward cost (dispatch
    and small kernels), charged per block and micro-batch; ``tp_layer_overhead_s`` and
    ``sp_layer_overhead_s`` what a tiny block split over the probe's ranks costs more, without
    and with sequence parallelism (its layers' and collectives' fixed costs, the ranks waiting
    for each other); ``elementwise_s_per_byte`` what the
    rest of a block's forward and backward (GELU, LayerNorm, additions, copies) costs per byte
    of the activations it keeps, measured on a mid-sized block.
    ``engine_allreduce``: ``hvd.allreduce`` (data parallelism and ZeRO); ``direct_allreduce``:
    the direct path's collectives (tensor parallelism); ``p2p``: pipeline messages.
    ``optimizer_s_per_param``: one Adam step per parameter; ``memcpy_bandwidth``: bytes copied
    per second.

    Nodes: with ``ranks_per_node`` > 0, the links above are those inside a node, and a group
    of ranks that spans nodes reaches the others through ``inter_node``, one rank's own link
    out of its node (its NIC); 0 means one kind of link whatever the ranks (a probe's
    figures).  ``memory_per_rank``: bytes each rank has (0: unknown).
    """

    name: str
    measured: bool
    matmul: tuple[tuple[int, float], ...]
    attention: tuple[tuple[int, float], ...]
    layer_overhead_s: float
    tp_layer_overhead_s: float
    sp_layer_overhead_s: float
    elementwise_s_per_byte: float
    engine_allreduce: Link
    direct_allreduce: Link
    p2p: Link
    optimizer_s_per_param: float
    memcpy_bandwidth: float
    ranks_per_node: int = 0
    inter_node: Link | None = None
    memory_per_rank: int = 0
    details: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("matmul", "attention"):
            points = getattr(self, name)
            if not points:
                raise InvalidArgumentError(f"a machine profile needs at least one {name} measurement")
            object.__setattr__(self, name, tuple(sorted((int(n), float(f)) for n, f in points)))
            for n, flops in getattr(self, name):
                if n < 1 or not flops > 0:
                    raise InvalidArgumentError(f"{name} entry ({n}, {flops}) must have a size >= 1 and FLOP/s > 0")
        for name in ("layer_overhead_s", "tp_layer_overhead_s", "sp_layer_overhead_s", "elementwise_s_per_byte",
                     "optimizer_s_per_param"):
            if not getattr(self, name) >= 0:
                raise InvalidArgumentError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("engine_allreduce", "direct_allreduce", "p2p"):
            link = getattr(self, name)
            if not (link.latency_s >= 0 and link.bandwidth > 0):
                raise InvalidArgumentError(f"{name} needs latency_s >= 0 and bandwidth > 0, got {link}")
        if not self.memcpy_bandwidth > 0:
            raise InvalidArgumentError(f"memcpy_bandwidth must be > 0, got {self.memcpy_bandwidth!r}")
        if self.ranks_per_node < 0 or self.memory_per_rank < 0:
            raise InvalidArgumentError(f"ranks_per_node and memory_per_rank must be >= 0, got {self.ranks_per_node} "
                                       f"and {self.memory_per_rank}")
        if self.ranks_per_node and not (self.inter_node and self.inter_node.latency_s >= 0
                                        and self.inter_node.bandwidth > 0):
            raise InvalidArgumentError(f"a profile with ranks_per_node needs an inter_node link with latency_s >= 0 "
                                       f"and bandwidth > 0, got {self.inter_node}")

    def group_link(self, link: Link, size: int, stride: int, *, messages: bool = False) -> Link:
        """``link`` for a group of ``size`` ranks ``stride`` apart in host order (psrt's grid puts
        TP fastest, then CP, DP and PP).  Inside one node it is ``link``.  Collectives of a
        group spanning nodes run one ring per rank it has in a node, each through that rank's
        NIC, so their bus bandwidth is that many NICs' (at most ``link``'s), at the slower
        latency; point-to-point ``messages`` (and a group whose blocks do not tile the nodes)
        get one NIC."""
        n = self.ranks_per_node
        if not n or size <= 1 or n % (size * stride) == 0:
            return link
        tiles = (size * stride) % n == 0 and n % stride == 0
        per_node = n // stride if tiles and not messages else 1
        return Link(latency_s=max(link.latency_s, self.inter_node.latency_s),
                    bandwidth=min(link.bandwidth, per_node * self.inter_node.bandwidth))

    def flops(self, n: float) -> float:
        """FLOP/s of a product of the volume of an n × n one."""
        return _interpolate(self.matmul, n)

    def matmul_seconds(self, m: int, k: int, n: int) -> float:
        """An (m × k) @ (k × n) product."""
        return 2.0 * m * k * n / self.flops((m * k * n) ** (1 / 3))

    def attention_seconds(self, flops: float, head_dim: int) -> float:
        """Attention work of ``flops`` (forward or backward) with heads of ``head_dim``."""
        return flops / _interpolate(self.attention, head_dim)

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
                       attention=tuple(tuple(point) for point in data["attention"]),
                       layer_overhead_s=float(data["layer_overhead_s"]),
                       tp_layer_overhead_s=float(data["tp_layer_overhead_s"]),
                       sp_layer_overhead_s=float(data["sp_layer_overhead_s"]),
                       elementwise_s_per_byte=float(data["elementwise_s_per_byte"]),
                       optimizer_s_per_param=float(data["optimizer_s_per_param"]),
                       memcpy_bandwidth=float(data["memcpy_bandwidth"]), details=dict(data.get("details", {})),
                       ranks_per_node=int(data.get("ranks_per_node", 0)),
                       inter_node=Link(**data["inter_node"]) if data.get("inter_node") else None,
                       memory_per_rank=int(data.get("memory_per_rank", 0)), **links)
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"not a psrt machine profile ({type(exc).__name__}: {exc}); write one with "
                                       "`psrt plan --measure`") from exc


def _interpolate(points: tuple[tuple[int, float], ...], x: float) -> float:
    """The rate at ``x``, log-log between measured points, flat beyond them."""
    if x <= points[0][0] or len(points) == 1:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    for (x0, f0), (x1, f1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            w = math.log(x / x0) / math.log(x1 / x0)
            return math.exp((1 - w) * math.log(f0) + w * math.log(f1))
    raise AssertionError("unreachable")


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
    thread each, idle otherwise; 2026-11-24 20:58 UTC, ``psrun -np 2 python -m psrt.plan.probe
    --threads 1``), rounded, not of the machine you are on: measure yours with ``psrt plan --measure``."""
    return Machine(
        name="default profile (NOT measured here: psrt's 2-core development VM, 2026-11-24)",
        measured=False,
        matmul=((64, 24e9), (128, 33e9), (256, 34e9), (512, 33e9), (1024, 34e9)),
        attention=((16, 7.0e9), (64, 11e9), (128, 12e9)),
        layer_overhead_s=1.6e-3,
        tp_layer_overhead_s=0.8e-3,
        sp_layer_overhead_s=2.8e-3,
        elementwise_s_per_byte=3.0e-9,
        engine_allreduce=Link(latency_s=83e-6, bandwidth=2.4e9),
        direct_allreduce=Link(latency_s=47e-6, bandwidth=2.8e9),
        p2p=Link(latency_s=82e-6, bandwidth=4.7e9),
        optimizer_s_per_param=8.1e-9,
        memcpy_bandwidth=4.7e9,
    )
