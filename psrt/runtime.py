"""The process-wide runtime: configuration, topology, engine and their bookkeeping, created
by ``init()``.

One runtime exists per process between ``init()`` and ``shutdown()``.  Everything
that lives as long as it does is held by the :class:`Runtime` object, not by module
globals: the async handles, the counters that name unnamed collectives, the
communication statistics of the parallel layers.  Objects that keep using the
runtime (``ProcessGrid``, ``Pipeline``, ``KVStore``, ``ZeroOptimizer``) are given it,
defaulting to :func:`current`; the Horovod-shaped free functions (``psrt.rank()``,
``hvd.allreduce``...) read it through :func:`current`, which raises a clear error
before ``init()``.
"""
from __future__ import annotations

import atexit
import importlib
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol, Sequence

from psrt.comm import bootstrap, crowding
from psrt.comm.tuning import measure as tuner
from psrt.comm.mpi import MpiCommunicator
from psrt.comm.stats import CommStats
from psrt.comm.tuning.table import TuningTable
from psrt.comm.prober import MpiProber
from psrt.comm.watchdog import Watchdog
from psrt.config import Config, config_from_env
from psrt.engine import Channel, Engine
from psrt.engine.handles import HandleTable
from psrt.engine.names import Names
from psrt.errors import ArgumentTypeError, CheckpointError, NotInitializedError, ProcessSetError
from psrt.rank_env import export_rank_variables
from psrt.topology import ProcessSet, Topology

#: The set of all ranks; usable once ``init()`` has run.
global_process_set = ProcessSet()


class RoleLink(Protocol):
    """A worker's link to ranks of the job that took another role at start-up (the
    parameter servers): closed by ``shutdown()`` before the engine stops, released after
    the topology is freed."""

    def close(self) -> None: ...

    def release(self) -> None: ...


class Finishing(Protocol):
    """Work that outlives the call that began it (a process set's background checkpoint
    writer, :mod:`psrt.background_save`): ``shutdown()`` finishes it first."""

    def finish(self) -> str | None:
        """Wait for the work and stop; returns a failure of it that nobody was told of."""


#: What a rank that took another role than worker runs instead of returning from ``init()``.
Serve = Callable[[], None]
#: How a mode that gives some ranks of the job another role splits the job at start-up:
#: given the job's communicator, the configuration and the watchdog, it returns (the
#: workers' world, this worker's link, None) on a worker, (None, None, what it serves) on
#: a rank of the other role.
RoleSplit = Callable[[MpiCommunicator, Config, Watchdog], "tuple[MpiCommunicator | None, RoleLink | None, Serve | None]"]

# The modes that split the job into roles, by the setting that turns one on, and the
# package that implements it: the package registers its split (:func:`register_role_split`)
# when imported, and init() imports it by name only when the setting is on, so this
# runtime never depends on the layers built upon it.
_ROLE_PACKAGES = {"num_servers": "psrt.ps"}
_role_splits: dict[str, RoleSplit] = {}


def register_role_split(setting: str, split: RoleSplit) -> None:
    """Have ``init()`` split the job with ``split`` whenever the configuration's ``setting``
    is on (called by the package that implements the mode, when it is imported)."""
    _role_splits[setting] = split


@dataclass(eq=False)
class Runtime:
    config: Config
    topology: Topology
    engine: Engine
    watchdog: Watchdog  # stall reports for every wait on other ranks
    ps: RoleLink | None = None  # parameter-server mode: this worker's link to the servers
    names: Names = field(default_factory=Names)  # what unnamed collectives are called
    #: What the Horovod-shaped calls worked out (validated arguments, prepared works), by the
    #: arguments that made them, for repeated calls to reuse (see psrt.torch._common.remember).
    calls: dict[tuple, object] = field(default_factory=dict)
    #: The channels made so far, by process set id (see :meth:`channel`).
    channels: dict[int, Channel] = field(default_factory=dict)
    #: The background checkpoint writers made so far, by process set id (see psrt.background_save).
    savers: dict[int, Finishing] = field(default_factory=dict)
    handles: HandleTable = field(init=False)  # the *_async calls not yet synchronized

    def __post_init__(self) -> None:
        self.handles = HandleTable(self.engine.wait)

    def channel(self, process_set: ProcessSet | None = None) -> Channel:
        """The engine channel of ``process_set`` (default: the global set), which this rank
        must be a member of: what psrt's strategies are handed when built (see
        :mod:`psrt.engine.channel`)."""
        process_set = global_process_set if process_set is None else process_set
        topology = self.topology
        topology.communicator(process_set)  # raises for an unregistered set or a non-member
        channel = self.channels.get(process_set.process_set_id)
        if channel is None:
            channel = self.channels[process_set.process_set_id] = Channel(
                self.engine, self.names, process_set.process_set_id, topology.ranks_of(process_set),
                topology.world.rank)
        return channel

    @property
    def stats(self) -> defaultdict[str, CommStats]:
        """Collectives run by the parallel layers outside the engine, by family
        ("tensor-parallel", "context-parallel", "expert-parallel"): counts and seconds
        (kept by the topology, whose direct groups run them)."""
        return self.topology.stats


_runtime: Runtime | None = None
_exit_hook_installed = False
_parameter_servers_gone = False  # this worker's shutdown let the servers exit


def init(process_sets: Iterable[ProcessSet | Sequence[int]] | None = None) -> None:
    """Start the runtime: MPI (or a size-1 singleton), host layout, process sets.

    Idempotent: a second call while initialised does nothing.  If it fails on one rank of a
    job, it ends the job with the reason (the other ranks would wait for that rank forever),
    unless ``PSRT_ABORT_ON_EXCEPTION=0``; then it raises (if only registering
    ``process_sets`` failed, psrt is initialised and ``shutdown()`` stops it).

    In parameter-server mode (``PSRT_NUM_SERVERS`` > 0) a server rank serves
    inside this call and exits the process once every worker has shut down;
    on worker ranks the world (``rank()``, ``size()``, every collective) is
    the workers only.

    Collective: every rank of the world calls it, in the same order (under a launcher, every
    rank of the job, before any other psrt call).

    :param process_sets: process sets to register as :func:`add_process_set` does, in order:
        :class:`ProcessSet` objects or lists of world ranks; default None (none but the global
        set).  Every rank must pass the same sets.
    """
    global _runtime
    if _runtime is not None:
        return
    job_rank, job_size = bootstrap.start_mpi()
    config, watchdog = None, None
    try:
        config = config_from_env()
        crowding.configure(config.waits)
        if config.abort_on_exception:  # first, so that no failure below leaves the others waiting
            bootstrap.install_abort_on_exception()
        bootstrap.check_launcher_agrees()
        bootstrap.check_thread_level()
        if config.num_servers and _parameter_servers_gone:
            raise NotInitializedError("psrt cannot start again in parameter-server mode: the servers "
                                      "exited when the workers shut down")
        watchdog = Watchdog(config.stall_check_time_s, config.stall_shutdown_time_s, bootstrap.abort_job,
                            rank=job_rank)
        runtime, serve = _start(config, watchdog, job_size)
        if serve is None:
            _runtime = runtime  # from here on, shutdown() can stop what runs
            _install_exit_hook()
            export_rank_variables(runtime.topology)
            for process_set in process_sets or ():
                runtime.topology.add_process_set(process_set)
    except Exception as exc:
        if config is None or config.abort_on_exception:
            bootstrap.fail_init(exc)
        if watchdog is not None and _runtime is None:
            watchdog.stop()
        raise
    if serve is not None:  # a parameter server: serve until every worker has shut down, then exit
        serve()
        watchdog.stop()
        bootstrap.watch_finalization()
        raise SystemExit(0)


def _install_exit_hook() -> None:
    """Shut down at exit, before mpi4py finalises MPI (it does so after every exit handler)."""
    global _exit_hook_installed
    if not _exit_hook_installed:
        atexit.register(_at_exit)
        _exit_hook_installed = True


def _at_exit() -> None:
    """psrt's exit handler: shut down (collective, watched), then have the wait for the other
    ranks in MPI's finalisation watched too.  A background save that failed unseen is told."""
    try:
        shutdown()
    except CheckpointError as exc:
        sys.stderr.write(f"psrt: {exc}\n")
    bootstrap.watch_finalization()


def _start(config: Config, watchdog: Watchdog, job_size: int) -> tuple[Runtime | None, Callable[[], None] | None]:
    """Meet the other ranks and build the runtime; for a parameter server, return instead
    the function that serves."""
    arrivals = bootstrap.Arrivals()
    watchdog.speaks_unprobed = arrivals.speaks
    with watchdog.waiting("start-up", arrivals.describe):
        watchdog.attach(MpiProber(arrivals.meet()))
    everyone = range(job_size)
    with watchdog.waiting("start-up", f"psrt.init() on rank {watchdog.rank} (creating communicators, finding or "
                          "measuring the allreduce tuning table)", job_peers=everyone):
        job = bootstrap.job_communicator(config)
        world, link, serve = job, None, None
        split = _role_split(config)
        if split is not None:
            world, link, serve = split(job, config, watchdog)
            if serve is not None:
                return None, serve
        hosts = bootstrap.host_groups(world)
        topology = Topology(hosts.world, hosts.local, hosts.cross, global_process_set, watchdog,
                            hierarchical_allreduce=config.hierarchical_allreduce,
                            tuned=tuner.in_use(config, hosts.world), tp_check_shapes=config.tp_check_shapes)
        tuner.establish(hosts.world, hosts.local, topology.hierarchical, config)
        engine = Engine(topology, config, watchdog)
    return Runtime(config=config, topology=topology, engine=engine, watchdog=watchdog, ps=link), None


def _role_split(config: Config) -> RoleSplit | None:
    """The split of the one mode the configuration turns on, if any (its package, imported
    here if the script has not, registers it)."""
    for setting, package in _ROLE_PACKAGES.items():
        if getattr(config, setting):
            if setting not in _role_splits:
                importlib.import_module(package)
            return _role_splits[setting]
    return None


def shutdown() -> None:
    """Stop the engine on every rank and release psrt's communicators; ``init()`` may be
    called again afterwards.

    Other ranks' pending collectives then fail with a message naming this rank,
    rather than waiting for it forever.  psrt calls it at exit when the script has not.
    A background save in flight is waited for first; if one failed and no save or ``wait()``
    since raised its error, shutdown raises it (as :class:`~psrt.errors.CheckpointError`)
    once everything is stopped.

    Collective: every rank of the world calls it (or reaches exit), in the same order, as
    ``MPI_Finalize`` is: a rank's shutdown returns once every rank has called it.
    """
    global _runtime
    if _runtime is not None:
        unseen = [failure for failure in (saver.finish() for saver in _runtime.savers.values()) if failure]
        runtime, _runtime = _runtime, None
        if runtime.ps is not None:
            global _parameter_servers_gone
            _parameter_servers_gone = True
            runtime.ps.close()
        runtime.engine.shutdown()
        runtime.watchdog.stop()
        runtime.topology.free()
        if runtime.ps is not None:
            runtime.ps.release()
        if unseen:
            raise CheckpointError(f"a background save failed and no save or wait() since reported it: "
                                  f"{'; '.join(unseen)}")


def tuning_table() -> TuningTable:
    """The tuning table this job's host allreduces and reduce-scatters of the global set
    follow: which algorithm (MPI's own, psrt's ring, hierarchical) carries each size, and
    what it was measured for (``key``; None for the fixed table of ``PSRT_TUNE=off``).
    The same on every rank.  See the data-parallel guide's tuning section."""
    return current().topology.world.choice.table


def is_initialized() -> bool:
    return _runtime is not None


def current() -> Runtime:
    if _runtime is None:
        raise NotInitializedError("psrt is not initialised: call psrt.init() "
                                  "(or hvd.init()) before using it")
    return _runtime


def given(runtime: object) -> Runtime:
    """The runtime an object was given, or the current one when it was given none."""
    if runtime is None:
        return current()
    if not isinstance(runtime, Runtime):
        raise ArgumentTypeError(f"runtime must be a psrt Runtime (psrt.runtime.current()), got "
                                f"{type(runtime).__name__}")
    if runtime is not _runtime:  # one runtime at a time: any other was shut down
        raise NotInitializedError("the runtime given was shut down; pass the current one "
                                  "(psrt.runtime.current()) or none")
    return runtime


def rank() -> int:
    """This process's rank in the world."""
    return current().topology.world.rank


def size() -> int:
    """Number of processes in the world."""
    return current().topology.world.size


def local_rank() -> int:
    """Rank among the processes on this host."""
    return current().topology.local.rank


def local_size() -> int:
    """Number of processes on this host."""
    return current().topology.local.size


def cross_rank() -> int:
    """Index of this host among the hosts (rank among processes with this local rank)."""
    return current().topology.cross.rank


def cross_size() -> int:
    """Number of hosts (processes with this local rank)."""
    return current().topology.cross.size


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set so that collectives can run over it.

    Collective: every rank of the world calls it, in the same order, with the same ranks (a
    rank outside the set too).

    :param process_set: a :class:`ProcessSet` not registered yet, or a list of distinct world
        ranks.
    :returns: the registered set (the one given, or a new one for a list of ranks).
    """
    return current().topology.add_process_set(process_set)


def remove_process_set(process_set: ProcessSet) -> None:
    """Forget a process set; none of this rank's operations on it may still be pending.

    Collective: every rank of the world calls it, in the same order.

    :param process_set: a set registered by :func:`add_process_set` (not the global set).
    """
    runtime = current()
    set_id = process_set.process_set_id if isinstance(process_set, ProcessSet) else None
    pending = runtime.engine.pending_in(set_id) if set_id is not None else []
    if pending:
        raise ProcessSetError(f"cannot remove {process_set!r}: operations {pending} on it are "
                              "still pending; synchronize them first")
    runtime.channels.pop(set_id, None)
    runtime.topology.remove_process_set(process_set)


def join() -> int:
    """This rank has run out of data: until every rank has joined, contribute zeros to the
    other ranks' allreduces.  Returns the last rank to join (the same on every rank)."""
    return current().engine.join()


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing a Chrome-trace timeline (rank 0 writes it; call on every rank)."""
    current().engine.start_timeline(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop writing the timeline and close its file (valid JSON from then on)."""
    current().engine.stop_timeline()
