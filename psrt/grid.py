"""The DP × CP × TP × PP process grid: every rank's coordinates, its process sets and its
pipeline neighbours.

Axes are laid out with tensor parallelism innermost, then context, then data, then
pipeline (Megatron's and picotron's order), over the world ranks sorted by host: TP
groups, which communicate in every layer, share a host whenever the hosts' slot counts
are multiples of the TP size; CP groups, which pass key/value blocks in every attention,
come next; PP neighbours, which exchange one activation per micro-batch, may cross hosts.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from psrt.errors import ArgumentTypeError, InvalidArgumentError
from psrt.runtime import Runtime, given
from psrt.topology import ProcessSet


class Axis(enum.Enum):
    DP = "dp"
    TP = "tp"
    PP = "pp"
    CP = "cp"


@dataclass(frozen=True)
class Coordinates:
    """A rank's place on the grid: its index along each axis."""

    dp: int
    tp: int
    pp: int
    cp: int = 0

    def along(self, axis: Axis) -> int:
        return getattr(self, axis.value)


@dataclass(frozen=True)
class GridShape:
    """Sizes along each axis; ``ep`` (expert parallelism) splits the data-parallel axis."""

    dp: int
    tp: int
    pp: int
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in [axis.value for axis in Axis] + ["ep"]:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ArgumentTypeError(f"{name} must be an int, got {value!r}")
            if value < 1:
                raise InvalidArgumentError(f"{name} must be at least 1, got {value}")
        if self.dp % self.ep:
            raise InvalidArgumentError(f"ep = {self.ep} does not divide dp = {self.dp}: experts are sharded over "
                                       "data-parallel ranks, so the expert-parallel size must divide the "
                                       "data-parallel one")

    @property
    def size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def check_fits(self, world_size: int) -> None:
        if self.size != world_size:
            sizes = f"dp × tp × pp = {self.dp} × {self.tp} × {self.pp}" if self.cp == 1 else \
                f"dp × cp × tp × pp = {self.dp} × {self.cp} × {self.tp} × {self.pp}"
            raise InvalidArgumentError(f"{sizes} = {self.size} does not match the {world_size} ranks of the job; "
                                       f"choose sizes whose product is {world_size}")

    def coordinates(self, position: int) -> Coordinates:
        """The coordinates of the ``position``-th rank in host order (TP varies fastest, then CP, DP, PP)."""
        return Coordinates(tp=position % self.tp, cp=(position // self.tp) % self.cp,
                           dp=(position // (self.tp * self.cp)) % self.dp,
                           pp=position // (self.tp * self.cp * self.dp))

    def position(self, at: Coordinates) -> int:
        return ((at.pp * self.dp + at.dp) * self.cp + at.cp) * self.tp + at.tp

    def groups(self, *axes: Axis) -> list[list[int]]:
        """Positions of every group spanning ``axes`` (the other coordinates fixed), in a fixed
        order, each listed by increasing position (for one axis: by its coordinate)."""
        others = [a for a in Axis if a not in axes]
        found: dict[tuple[int, ...], list[int]] = {}
        for position in range(self.size):
            at = self.coordinates(position)
            found.setdefault(tuple(at.along(a) for a in others), []).append(position)
        return list(found.values())

    def expert_groups(self) -> tuple[list[list[int]], list[list[int]]]:
        """Positions of the EP groups (ep consecutive data-parallel ranks, same TP, PP and CP
        coordinates) and of the expert-data-parallel groups (the ranks holding the same
        experts: same TP and PP coordinates and data-parallel rank modulo ep, any CP)."""
        experts: dict[tuple[int, ...], list[int]] = {}
        replicas: dict[tuple[int, ...], list[int]] = {}
        for position in range(self.size):
            at = self.coordinates(position)
            experts.setdefault((at.tp, at.pp, at.cp, at.dp // self.ep), []).append(position)
            replicas.setdefault((at.tp, at.pp, at.dp % self.ep), []).append(position)
        return list(experts.values()), list(replicas.values())


class ProcessGrid:
    """The DP × CP × TP × PP layout of the job.

    ``dp_set``, ``tp_set`` and ``pp_set`` are ordinary registered process sets; a
    set's rank order follows the coordinate along its axis, so ``tp_set.rank() ==
    coords.tp`` and ``pp_set.rank() == coords.pp``.  With ``cp`` > 1 there are two more:
    ``cp_set`` (the ranks sharing one sequence) and ``dp_cp_set`` (every rank holding the
    same parameters: data-parallel optimizers reduce gradients over it, since each CP rank
    holds the gradient of its own tokens).  With ``cp=1`` ``cp_set`` is None (no context
    parallelism: ring attention is ordinary attention) and ``dp_cp_set`` is ``dp_set``.
    With ``ep`` > 1 experts are sharded over ``ep_set`` (ep consecutive data-parallel ranks)
    and ``edp_set`` holds the ranks with the same experts, over which their gradients are
    reduced; with ``ep=1`` ``ep_set`` is None and ``edp_set`` is ``dp_cp_set``.  Ranks are
    placed in host order, TP varying fastest, then CP, DP and PP.

    Collective: every rank of the world constructs the same grid, in the same order relative to
    other process-set registrations (construction registers its process sets).

    :param dp: data-parallel size, an int >= 1; default 1.
    :param tp: tensor-parallel size, an int >= 1; default 1.
    :param pp: pipeline-parallel size (stages), an int >= 1; default 1.
    :param cp: context-parallel size, an int >= 1; default 1.  The product
        ``dp × cp × tp × pp`` must equal the number of ranks.
    :param ep: expert-parallel size, an int >= 1 that divides ``dp``; default 1.
    :param runtime: the psrt runtime whose world it lays out; default None: the current one.
        Keyword only.
    """

    def __init__(self, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, *,
                 runtime: Runtime | None = None) -> None:
        self.runtime = given(runtime)
        self.shape = GridShape(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
        topology = self.runtime.topology
        self.shape.check_fits(topology.world.size)
        self._world_rank_at = topology.host_order()  # position on the grid -> world rank
        position = self._world_rank_at.index(topology.world.rank)
        self.coords = self.shape.coordinates(position)
        self._sets: dict[tuple[Axis, ...], ProcessSet] = {}
        self._registered: list[ProcessSet] = []
        for axes, groups in world_groups(self.shape, self._world_rank_at).items():
            for ranks in groups:
                self._registered.append(topology.add_process_set(ProcessSet(ranks)))
                if topology.world.rank in ranks:
                    self._sets[axes] = self._registered[-1]

    @property
    def dp_set(self) -> ProcessSet:
        return self._sets[(Axis.DP,)]

    @property
    def tp_set(self) -> ProcessSet:
        return self._sets[(Axis.TP,)]

    @property
    def pp_set(self) -> ProcessSet:
        return self._sets[(Axis.PP,)]

    @property
    def cp_set(self) -> ProcessSet | None:
        return self._sets.get((Axis.CP,))

    @property
    def dp_cp_set(self) -> ProcessSet:
        return self._sets.get((Axis.DP, Axis.CP), self.dp_set)

    @property
    def ep_set(self) -> ProcessSet | None:
        return self._sets.get(EXPERTS)

    @property
    def edp_set(self) -> ProcessSet:
        return self._sets.get(EXPERT_REPLICAS, self.dp_cp_set)

    def world_rank(self, dp: int, tp: int, pp: int, cp: int = 0) -> int:
        """The world rank at these coordinates (no communication).

        :param dp: the data-parallel coordinate, in ``[0, dp)``.
        :param tp: the tensor-parallel coordinate, in ``[0, tp)``.
        :param pp: the pipeline stage, in ``[0, pp)``.
        :param cp: the context-parallel coordinate, in ``[0, cp)``; default 0.
        """
        return self._world_rank_at[self.shape.position(Coordinates(dp=dp, tp=tp, pp=pp, cp=cp))]

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
        return None if self.is_last_stage else self.world_rank(at.dp, at.tp, at.pp + 1, at.cp)

    @property
    def prev_rank(self) -> int | None:
        """World rank of the previous pipeline stage (gradients go there), or None on the first."""
        at = self.coords
        return None if self.is_first_stage else self.world_rank(at.dp, at.tp, at.pp - 1, at.cp)

    def free(self) -> None:
        """Unregister this grid's process sets; nothing may still be pending on them.

        Collective: every rank of the world calls it, in the same order, like the registration.
        """
        topology = self.runtime.topology
        for process_set in self._registered:
            topology.remove_process_set(process_set)
        self._registered.clear()

    def __repr__(self) -> str:
        at, shape = self.coords, self.shape
        cp = f", cp={shape.cp}" if shape.cp > 1 else ""
        ep = f", ep={shape.ep}" if shape.ep > 1 else ""
        return (f"ProcessGrid(dp={shape.dp}, tp={shape.tp}, pp={shape.pp}{cp}{ep}; "
                f"this rank at dp={at.dp}, tp={at.tp}, pp={at.pp}{f', cp={at.cp}' if cp else ''})")


def world_groups(shape: GridShape, world_rank_at: list[int]) -> dict[tuple[Axis, ...], list[list[int]]]:
    """Every group of every axis (TP, DP, PP, and with CP the CP and DP × CP groups) as world
    ranks, given the world rank at each grid position (host order); checked before any is
    registered."""
    spans = [(Axis.TP,), (Axis.DP,), (Axis.PP,)] + ([(Axis.CP,), (Axis.DP, Axis.CP)] if shape.cp > 1 else [])
    groups = {axes: [[world_rank_at[p] for p in group] for group in shape.groups(*axes)] for axes in spans}
    if shape.ep > 1:
        experts, replicas = shape.expert_groups()
        groups[EXPERTS] = [[world_rank_at[p] for p in group] for group in experts]
        groups[EXPERT_REPLICAS] = [[world_rank_at[p] for p in group] for group in replicas]
    for axes, members in groups.items():
        for ranks in members:
            _check_axis_order(axes, ranks)
    return groups


# keys of the expert-parallel sets among the grid's sets (spans of DP, named for messages)
EXPERTS, EXPERT_REPLICAS = ("ep",), ("edp",)


def _check_axis_order(axes: tuple, ranks: list[int]) -> None:
    """A process set orders its members by world rank; the grid needs that order to be the
    coordinate order, which holds when each host's ranks are consecutive (placement by
    slot, mpirun's and psrun's default)."""
    if ranks != sorted(ranks):
        raise InvalidArgumentError(
            f"the {' × '.join(getattr(a, 'value', a) for a in axes)} group {ranks} of the host-sorted grid is not "
            "in increasing "
            "world-rank order: launch with each host's ranks consecutive (--map-by slot, the default)")
