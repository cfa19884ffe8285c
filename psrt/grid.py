"""The DP × TP × PP process grid: every rank's coordinates, its three process sets
and its pipeline neighbours.

Axes are laid out with tensor parallelism innermost, then data, then pipeline
(Megatron's default order), over the world ranks sorted by host: TP groups, which
communicate in every layer, share a host whenever the hosts' slot counts are
multiples of the TP size; PP neighbours, which exchange one activation per
micro-batch, may cross hosts.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from psrt import runtime
from psrt.errors import ArgumentTypeError, InvalidArgumentError
from psrt.topology import ProcessSet


class Axis(enum.Enum):
    DP = "dp"
    TP = "tp"
    PP = "pp"


@dataclass(frozen=True)
class Coordinates:
    """A rank's place on the grid: its index along each axis."""

    dp: int
    tp: int
    pp: int

    def along(self, axis: Axis) -> int:
        return getattr(self, axis.value)


@dataclass(frozen=True)
class GridShape:
    dp: int
    tp: int
    pp: int

    def __post_init__(self) -> None:
        for axis in Axis:
            value = getattr(self, axis.value)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ArgumentTypeError(f"{axis.value} must be an int, got {value!r}")
            if value < 1:
                raise InvalidArgumentError(f"{axis.value} must be at least 1, got {value}")

    @property
    def size(self) -> int:
        return self.dp * self.tp * self.pp

    def check_fits(self, world_size: int) -> None:
        if self.size != world_size:
            raise InvalidArgumentError(
                f"dp × tp × pp = {self.dp} × {self.tp} × {self.pp} = {self.size} does not match "
                f"the {world_size} ranks of the job; choose sizes whose product is {world_size}")

    def coordinates(self, position: int) -> Coordinates:
        """The coordinates of the ``position``-th rank in host order (TP varies fastest)."""
        return Coordinates(dp=(position // self.tp) % self.dp, tp=position % self.tp,
                           pp=position // (self.tp * self.dp))

    def position(self, at: Coordinates) -> int:
        return (at.pp * self.dp + at.dp) * self.tp + at.tp

    def groups(self, axis: Axis) -> list[list[int]]:
        """Positions of every group along ``axis`` (the other two coordinates fixed), in a
        fixed order, each listed by increasing coordinate along ``axis``."""
        others = [a for a in Axis if a is not axis]
        found: dict[tuple[int, int], list[int]] = {}
        for position in range(self.size):
            at = self.coordinates(position)
            found.setdefault((at.along(others[0]), at.along(others[1])), []).append(position)
        return [sorted(group, key=lambda p: self.coordinates(p).along(axis)) for group in found.values()]


class ProcessGrid:
    """The DP × TP × PP layout of the job; collective over the world on construction.

    ``dp_set``, ``tp_set`` and ``pp_set`` are ordinary registered process sets; a
    set's rank order follows the coordinate along its axis, so ``tp_set.rank() ==
    coords.tp`` and ``pp_set.rank() == coords.pp``.  Every rank must build the
    same grid, in the same order relative to other process-set registrations.
    """

    def __init__(self, dp: int = 1, tp: int = 1, pp: int = 1) -> None:
        self.shape = GridShape(dp=dp, tp=tp, pp=pp)
        topology = runtime.current().topology
        self.shape.check_fits(topology.world.size)
        self._world_rank_at = topology.host_order()  # position on the grid -> world rank
        position = self._world_rank_at.index(topology.world.rank)
        self.coords = self.shape.coordinates(position)
        self._sets: dict[Axis, ProcessSet] = {}
        self._registered: list[ProcessSet] = []
        for axis, groups in world_groups(self.shape, self._world_rank_at).items():
            for ranks in groups:
                self._registered.append(topology.add_process_set(ProcessSet(ranks)))
                if topology.world.rank in ranks:
                    self._sets[axis] = self._registered[-1]

    @property
    def dp_set(self) -> ProcessSet:
        return self._sets[Axis.DP]

    @property
    def tp_set(self) -> ProcessSet:
        return self._sets[Axis.TP]

    @property
    def pp_set(self) -> ProcessSet:
        return self._sets[Axis.PP]

    def world_rank(self, dp: int, tp: int, pp: int) -> int:
        """The world rank at these coordinates."""
        return self._world_rank_at[self.shape.position(Coordinates(dp=dp, tp=tp, pp=pp))]

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.shape.pp - 1

    @property
    def next_rank(self) -> int | None:
        """World rank of the next pipeline stage (activations go there), or None on the last."""
        at = self.coords
        return None if self.is_last_stage else self.world_rank(at.dp, at.tp, at.pp + 1)

    @property
    def prev_rank(self) -> int | None:
        """World rank of the previous pipeline stage (gradients go there), or None on the first."""
        at = self.coords
        return None if self.is_first_stage else self.world_rank(at.dp, at.tp, at.pp - 1)

    def free(self) -> None:
        """Unregister this grid's process sets (collective, like their registration)."""
        topology = runtime.current().topology
        for process_set in self._registered:
            topology.remove_process_set(process_set)
        self._registered.clear()

    def __repr__(self) -> str:
        at = self.coords
        return (f"ProcessGrid(dp={self.shape.dp}, tp={self.shape.tp}, pp={self.shape.pp}; "
                f"this rank at dp={at.dp}, tp={at.tp}, pp={at.pp})")


def world_groups(shape: GridShape, world_rank_at: list[int]) -> dict[Axis, list[list[int]]]:
    """Every group of every axis (TP, DP, PP) as world ranks, given the world rank at each
    grid position (host order); checked before any is registered."""
    groups = {axis: [[world_rank_at[p] for p in group] for group in shape.groups(axis)]
              for axis in (Axis.TP, Axis.DP, Axis.PP)}
    for axis, members in groups.items():
        for ranks in members:
            _check_axis_order(axis, ranks)
    return groups


def _check_axis_order(axis: Axis, ranks: list[int]) -> None:
    """A process set orders its members by world rank; the grid needs that order to be the
    coordinate order, which holds when each host's ranks are consecutive (placement by
    slot, mpirun's and psrun's default)."""
    if ranks != sorted(ranks):
        raise InvalidArgumentError(
            f"the {axis.value} group {ranks} of the host-sorted grid is not in increasing world-rank "
            "order: launch with each host's ranks consecutive (--map-by slot, the default)")
