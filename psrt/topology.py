"""Who is where: the world, local (same host) and cross (one per host) groups,
and process sets, the explicit groups every collective runs over.

A :class:`ProcessSet` is a plain description (a sorted list of world ranks);
registering it with :meth:`Topology.add_process_set` splits the world
communicator so that its members get a communicator of their own.  The later
DP, TP and PP groups of the process grid are process sets too.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Sequence

import torch

from psrt.comm.base import Communicator
from psrt.comm.direct import DirectGroup
from psrt.comm.hierarchical import HierarchicalCommunicator, hierarchical_or_none
from psrt.comm import streams
from psrt.comm.staged import device_transport
from psrt.comm.stats import CommStats
from psrt.comm.watchdog import Watchdog
from psrt.errors import ArgumentTypeError, InvalidArgumentError, ProcessSetError

GLOBAL_PROCESS_SET_ID = 0


class ProcessSet:
    """A group of world ranks that collectives can run over (Horovod's ``ProcessSet``).

    ``ProcessSet([0, 2])`` only describes the group; it becomes usable after
    ``add_process_set`` (or ``init(process_sets=[...])``), which every rank of
    the world must call in the same order.
    """

    def __init__(self, ranks: Iterable[int] | None = None) -> None:
        self.ranks: list[int] | None = None if ranks is None else _validate_ranks(ranks)
        self.process_set_id: int | None = None
        self._topology: Topology | None = None

    def _bound(self) -> Topology:
        if self._topology is None:
            raise ProcessSetError(f"{self!r} is not registered; call add_process_set() on "
                                  "every rank first")
        return self._topology

    @property
    def topology(self) -> Topology:
        """The topology the set is registered with: what a layer given the set reaches its
        direct group, check setting and counts through (raises while unregistered)."""
        return self._bound()

    def included(self) -> bool:
        """Whether the calling rank is a member."""
        return self._bound().communicator_or_none(self) is not None

    def size(self) -> int:
        return len(self._bound().ranks_of(self))

    def rank(self) -> int:
        """The caller's rank within the set, or -1 if it is not a member."""
        comm = self._bound().communicator_or_none(self)
        return -1 if comm is None else comm.rank

    def __repr__(self) -> str:
        members = "all ranks" if self.ranks is None else self.ranks
        return f"ProcessSet(id={self.process_set_id}, ranks={members})"


def _validate_ranks(ranks: Iterable[int]) -> list[int]:
    try:
        listed = list(ranks)
    except TypeError:
        raise ArgumentTypeError(f"process set ranks must be a sequence of ints, got "
                                f"{type(ranks).__name__}") from None
    for rank in listed:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise ArgumentTypeError(f"process set ranks must be ints, got {rank!r} "
                                    f"({type(rank).__name__})")
    if not listed:
        raise InvalidArgumentError("a process set needs at least one rank")
    if len(set(listed)) != len(listed):
        raise InvalidArgumentError(f"process set ranks {listed} contain duplicates")
    return sorted(listed)


class Topology:
    """The world, local and cross communicators, and the registered process sets."""

    def __init__(self, world: Communicator, local: Communicator, cross: Communicator,
                 global_set: ProcessSet, watchdog: Watchdog, *,
                 hierarchical_allreduce: bool = False, tuned: bool = False, tp_check_shapes: bool = True) -> None:
        """Collective over ``world``.  ``hierarchical_allreduce`` makes the global set's host
        allreduces hierarchical where that helps; else, with ``tuned``, a job over several
        hosts gets the hierarchical communicator too, for the tuning table to choose it by
        size (see :mod:`psrt.comm.tuning.measure`).  ``tp_check_shapes``: whether tensor-parallel
        collectives on the direct groups run the agreement check (``PSRT_TP_CHECK_SHAPES``)."""
        self.world, self.local, self.cross = world, local, cross
        self.tp_check_shapes = tp_check_shapes
        #: Collectives the parallel layers run on the direct groups, by family
        #: ("tensor-parallel", "context-parallel", "expert-parallel"): counts and seconds.
        self.stats: defaultdict[str, CommStats] = defaultdict(CommStats)
        self._watchdog = watchdog  # registering sets and placing ranks wait on every rank
        # Registering process sets happens on the caller's thread while the engine
        # thread runs collectives on the sets' communicators: it gets its own.
        self._registry = world.split(0, key=world.rank)
        self._communicators: dict[int, Communicator | None] = {GLOBAL_PROCESS_SET_ID: world}
        # NCCL communicators, made on first use by (process set id, CUDA device index)
        self._device_communicators: dict[tuple[int, int], Communicator] = {}
        # Direct groups, for traffic the caller's thread runs itself (tensor and pipeline
        # parallelism), by process set id
        self._direct: dict[int, DirectGroup] = {}
        self._made_for_others: list[DirectGroup] = []  # by direct_over
        self._direct[GLOBAL_PROCESS_SET_ID] = self._direct_group(self._registry.split(0, key=world.rank),
                                                                 global_set, GLOBAL_PROCESS_SET_ID)
        # The engine's communicator for the global set's host tensors (see transport()).
        self._hierarchical = (hierarchical_or_none(world, local, forced=hierarchical_allreduce)
                              if hierarchical_allreduce or tuned else None)
        self._sets: dict[int, ProcessSet] = {GLOBAL_PROCESS_SET_ID: global_set}
        self._next_id = GLOBAL_PROCESS_SET_ID + 1
        global_set.process_set_id = GLOBAL_PROCESS_SET_ID
        global_set._topology = self

    @property
    def hierarchical(self) -> HierarchicalCommunicator | None:
        """The global set's hierarchical communicator, where the job has one."""
        return self._hierarchical

    def ranks_of(self, process_set: ProcessSet) -> list[int]:
        return list(range(self.world.size)) if process_set.ranks is None else process_set.ranks

    def add_process_set(self, process_set: ProcessSet | Sequence[int]) -> ProcessSet:
        """Register a process set; collective over the world, same order on every rank."""
        if not isinstance(process_set, ProcessSet):
            process_set = ProcessSet(process_set)
        if process_set.process_set_id is not None:
            raise ProcessSetError(f"{process_set!r} is already registered")
        ranks = self.ranks_of(process_set)
        out_of_range = [r for r in ranks if not 0 <= r < self.world.size]
        if out_of_range:
            raise ProcessSetError(f"process set ranks {out_of_range} are outside the world "
                                  f"of size {self.world.size}")
        me = self.world.rank
        with self._watchdog.waiting("a process-set registration",
                                    f"rank {me}'s registration of a process set of ranks {ranks} (every rank must "
                                    "register the same sets in the same order)", range(self.world.size)):
            everyone = self._registry.allgather_object(ranks)
            comm, direct = self._register(ranks, everyone)
        set_id, self._next_id = self._next_id, self._next_id + 1
        self._communicators[set_id] = comm
        if direct is not None:
            self._direct[set_id] = self._direct_group(direct, process_set, set_id)
        self._sets[set_id] = process_set
        process_set.process_set_id, process_set._topology = set_id, self
        return process_set

    def _register(self, ranks: list[int], everyone: list[list[int]]
                  ) -> tuple[Communicator | None, Communicator | None]:
        """The set's communicators (None where this rank is not a member), once every rank
        has asked for the same set."""
        disagreeing = [r for r, theirs in enumerate(everyone) if theirs != ranks]
        if disagreeing:
            raise ProcessSetError(f"add_process_set called with different ranks: rank "
                                  f"{self.world.rank} passed {ranks}, rank {disagreeing[0]} "
                                  f"passed {everyone[disagreeing[0]]}")
        me = self.world.rank
        comm = self._registry.split(0 if me in ranks else None, key=me)
        direct = self._registry.split(0 if me in ranks else None, key=me)  # see direct()
        return comm, direct

    def remove_process_set(self, process_set: ProcessSet) -> None:
        """Forget a registered process set and free its communicator."""
        if process_set.process_set_id == GLOBAL_PROCESS_SET_ID:
            raise ProcessSetError("the global process set cannot be removed")
        comm = self._registered(process_set)
        self._free_device_communicators(process_set.process_set_id)
        del self._communicators[process_set.process_set_id]
        del self._sets[process_set.process_set_id]
        process_set.process_set_id, process_set._topology = None, None
        if comm is not None:
            comm.free()

    def _registered(self, process_set: ProcessSet) -> Communicator | None:
        if not isinstance(process_set, ProcessSet):
            raise ArgumentTypeError(f"process_set must be a psrt ProcessSet, got "
                                    f"{type(process_set).__name__}")
        set_id = process_set.process_set_id
        if set_id is None or self._sets.get(set_id) is not process_set:
            raise ProcessSetError(f"{process_set!r} is not registered; call add_process_set() "
                                  "on every rank first")
        return self._communicators[set_id]

    def host_order(self) -> list[int]:
        """World ranks sorted by host, then by rank on the host; collective over the world.

        The process grid lays its axes out in this order so that the innermost axis
        (tensor parallelism) stays on one host whatever ``--map-by`` placed where.
        """
        with self._watchdog.waiting("a process-set registration", f"rank {self.world.rank}'s exchange of host "
                                    "places (every rank builds the process grid)", range(self.world.size)):
            host = min(self.local.allgather_object(self.world.rank))  # a host is known by its lowest rank
            places = self._registry.allgather_object((host, self.local.rank))
        return sorted(range(self.world.size), key=lambda rank: places[rank])

    def host_place(self) -> tuple[int, int]:
        """This rank's host's index among the hosts of the world, in the order of their lowest
        ranks, and the number of hosts (torchrun's node rank and node count); collective over
        the world.

        A host's lowest rank is its local rank 0, whose cross group holds one rank per host in
        world order: what it sees there holds for the whole host.
        """
        with self._watchdog.waiting("start-up", f"rank {self.world.rank}'s exchange of its host's place among the "
                                    "hosts (every rank sets torchrun's variables in psrt.init())",
                                    range(self.world.size)):
            host, hosts = self.local.allgather_object((self.cross.rank, self.cross.size))[0]
        return host, hosts

    def communicator_or_none(self, process_set: ProcessSet) -> Communicator | None:
        return self._registered(process_set)

    def process_set(self, set_id: int) -> ProcessSet:
        """The registered process set with this id."""
        return self._sets[set_id]

    def communicator(self, process_set: ProcessSet) -> Communicator:
        """The communicator of ``process_set``; raises if the caller is not a member."""
        comm = self._registered(process_set)
        if comm is None:
            raise ProcessSetError(f"rank {self.world.rank} is not a member of {process_set!r}")
        return comm

    def transport(self, process_set: ProcessSet, device: torch.device) -> Communicator:
        """The communicator that carries tensors on ``device``: MPI for host memory, NCCL
        (created on first use, collectively over the set's members) for CUDA memory, or
        host staging where members share a GPU (:mod:`psrt.comm.staged`).

        With hierarchical allreduce on (and several hosts, some with several ranks), the
        global set's host communicator reduces on each host first; other sets stay flat,
        as in Horovod.
        """
        host = self.communicator(process_set)
        cuda = streams.api()
        if not cuda.covers(device):
            if process_set.process_set_id == GLOBAL_PROCESS_SET_ID and self._hierarchical is not None:
                return self._hierarchical
            return host
        index = cuda.index(device)
        key = (process_set.process_set_id, index)
        comm = self._device_communicators.get(key)
        if comm is None:
            comm = device_transport(host, torch.device(device.type, index))
            self._device_communicators[key] = comm
        return comm

    def direct(self, process_set: ProcessSet) -> DirectGroup:
        """The set's direct group (:mod:`psrt.comm.direct`), made with the set on the
        registering thread: checked collectives and messages the calling thread issues
        itself, on communicators apart from the engine thread's (two threads must never run
        collectives on one communicator)."""
        return self._direct[self._registered_id(process_set)]

    def direct_over(self, ranks: Sequence[int], *, key: str, name: str) -> DirectGroup:
        """A direct group of world ``ranks`` (the caller among them) made by those ranks
        alone, for groups (``torch.distributed.new_group``'s) whose non-members never call
        in; collective over ``ranks``, every member passing the same ``key`` (see
        :class:`DirectGroup`).  Freed with the topology."""
        with self._watchdog.waiting("a process-set registration",
                                    f"rank {self.world.rank}'s creation of a group of ranks {list(ranks)}", ranks):
            group = DirectGroup(self._registry.subgroup(ranks), ranks, self._watchdog, key=key, name=name)
        self._made_for_others.append(group)
        return group

    def release(self, group: DirectGroup) -> None:
        """Free a group :meth:`direct_over` made (once; a group already freed is left alone)."""
        if group in self._made_for_others:
            self._made_for_others.remove(group)
            group.free()

    def _direct_group(self, host: Communicator, process_set: ProcessSet, set_id: int) -> DirectGroup:
        """Direct traffic's group over ``host``, with this topology's watchdog."""
        return DirectGroup(host, self.ranks_of(process_set), self._watchdog, key=f"process set {set_id}",
                           name=lambda: repr(process_set))

    def _registered_id(self, process_set: ProcessSet) -> int:
        self.communicator(process_set)
        return process_set.process_set_id

    def _free_device_communicators(self, set_id: int | None) -> None:
        for key in [k for k in self._device_communicators if set_id is None or k[0] == set_id]:
            self._device_communicators.pop(key).free()
        for key in [k for k in self._direct if set_id is None or k == set_id]:
            self._direct.pop(key).free()

    def free(self) -> None:
        self._free_device_communicators(None)
        for group in self._made_for_others:
            group.free()
        for set_id, comm in list(self._communicators.items()):
            if set_id != GLOBAL_PROCESS_SET_ID and comm is not None:
                comm.free()
            process_set = self._sets[set_id]
            process_set._topology = None
            if set_id != GLOBAL_PROCESS_SET_ID:
                process_set.process_set_id = None
        if self._hierarchical is not None:
            self._hierarchical.free()
        for comm in (self._registry, self.local, self.cross, self.world):
            comm.free()
