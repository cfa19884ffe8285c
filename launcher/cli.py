"""The ``psrun`` command: parse flags, build the mpirun command line, run it.

Usage and configuration errors print one ``psrun: error: ...`` line and exit
with 2 before anything is launched; once the job runs, psrun exits with the
job's own exit code.
"""
from __future__ import annotations

import argparse
import math
import os
import shlex
import signal
import sys
import threading
from collections.abc import Mapping, Sequence

from launcher.addresses import is_local_host

from launcher.blacklist import MAX_COOLDOWN_S, MIN_COOLDOWN_S, check_cooldown_range
from launcher.command import (
    IMPLICIT_OVERSUBSCRIBE,
    LaunchError,
    build_command,
    check_implicit_oversubscription,
    detect_mpi,
    find_mpirun,
    plan_launch,
    rank_hosts,
)
from launcher.contract import ENV_NUM_SERVERS, ENV_TIMELINE, ENV_TIMELINE_MARK_CYCLES
from launcher.elastic import ElasticSettings, Launch, RunJob, Supervisor
from launcher.hostfile import (
    Host,
    HostfileError,
    hosts_from_slurm,
    parse_count,
    parse_hostfile,
    parse_hosts,
)
from launcher.listeners import Listener, note, watch_launcher
from launcher.monitor import JobCommand, JobResult, run_job
from launcher.mpi import launcher_environment, library_of

__all__ = ["main", "make_parser"]

USAGE_ERROR = 2
# torch's switch for its CPU allocator to put tensors of 2 MiB and more on transparent huge
# pages. MPI's shared-memory transfers of such a tensor (a gradient bucket) then run as fast
# as on numpy's arrays, which numpy already places so: on Open MPI 5 a 4 MiB allreduce of a
# torch tensor took 1.19 x, a 16 MiB one 1.6 x, the time of the same call on a numpy array
# without it (benchmarks/RESULTS.md, "Allreduce tuned against the MPI it sits on").
THP_VARIABLE = "THP_MEM_ALLOC_ENABLE"
# More ranks than any job psrun could start: a typo.
_MAX_RANKS = 1_000_000


def _rank_count(text: str) -> int:
    """A count of ranks (-np, --min-np, --max-np, --num-servers): plain decimal digits, at
    least 1 (``int()`` would take ``1_0`` too)."""
    try:
        return parse_count(text, "rank count", _MAX_RANKS)
    except HostfileError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _restart_count(text: str) -> int:
    """--restarts: plain decimal digits, 0 or more."""
    if text and set(text) == {"0"}:
        return 0
    try:
        return parse_count(text, "restart count", _MAX_RANKS)
    except HostfileError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="psrun",
        description="Launch a psrt job with mpirun (Open MPI or MPICH).",
        epilog="Inside a SLURM allocation the hosts come from SLURM unless -H or --hostfile is given. "
               "Variables named PSRT_* and HOROVOD_* are passed to every rank, and PATH, PYTHONPATH and "
               "LD_LIBRARY_PATH too when some host is not this machine. A job on this machine alone keeps "
               "Open MPI's ranks on shared memory (--mca btl self,sm) unless you choose the btl yourself.",
        allow_abbrev=False,
    )
    parser.add_argument("-np", "-n", "--num-proc", dest="num_proc", type=_rank_count, metavar="N",
                        help="number of ranks (default: all slots; this machine's CPU count without hosts)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", metavar="HOST:N,...",
                       help="hosts and their slots, e.g. host1:4,host2:4 (no :N means 1 slot)")
    where.add_argument("--hostfile", metavar="FILE",
                       help="hostfile in Open MPI (host slots=4) or MPICH (host:4) format")
    parser.add_argument("--oversubscribe", action="store_true",
                        help="allow more ranks than slots (on this machine alone psrun adds it by itself, "
                             f"with a warning, up to {IMPLICIT_OVERSUBSCRIBE} ranks per CPU or slot)")
    remote = parser.add_argument_group(
        "remote hosts", "How mpirun reaches hosts other than this one; a job on this machine alone ignores these.")
    remote.add_argument("--launch-agent", metavar="CMD",
                        help="command that starts the MPI's daemon on a host, called like ssh: CMD HOST "
                             "COMMAND... (default: ssh). Open MPI: plm_rsh_agent, words split at spaces; "
                             "MPICH (Hydra): -launcher-exec, one executable without arguments")
    remote.add_argument("--network-interface", action="append", default=[], metavar="NAME[,NAME]",
                        help="network interfaces for MPI and runtime traffic, e.g. eth0 or ib0; the names must "
                             "be the same on every host (Open MPI: btl_tcp_if_include and oob_tcp_if_include; "
                             "MPICH: -iface, one name)")
    remote.add_argument("--network-cidr", action="append", default=[], metavar="CIDR[,CIDR]",
                        help="IPv4 networks for MPI and runtime traffic, e.g. 10.0.0.0/24: works where "
                             "interface names differ between hosts (Open MPI only)")
    parser.add_argument("--mpirun", metavar="PATH",
                        help="mpirun to use (default: next to this Python, then on PATH)")
    parser.add_argument("--mpi-args", default="", metavar="ARGS",
                        help='extra mpirun arguments, split like a shell would, e.g. "--mca btl tcp,self" '
                             '(a single flag needs the = form: --mpi-args=--tag-output)')
    parser.add_argument("--timeline-filename", metavar="PATH",
                        help="record a timeline of every rank's collectives in PATH, a Chrome "
                             f"trace (sets {ENV_TIMELINE} on every rank, as horovodrun does)")
    parser.add_argument("--timeline-mark-cycles", action="store_true",
                        help="mark the engine's cycles in the timeline "
                             f"(sets {ENV_TIMELINE_MARK_CYCLES}=1 on every rank)")
    parser.add_argument("--num-servers", type=_rank_count, metavar="S",
                        help="parameter-server mode: S ranks become servers, the rest workers "
                             f"(sets {ENV_NUM_SERVERS}=S on every rank)")
    elastic = parser.add_argument_group(
        "elastic training", "Relaunch the job when ranks fail or hosts come, continuing from its last "
        "state.commit() (scripts use psrt.torch.elastic, Horovod's elastic API). Any of these flags turns it on.")
    elastic.add_argument("--min-np", type=_rank_count, metavar="N", help="fewest ranks to run with (default: -np, else 1); "
                         "every launch takes every usable slot up to --max-np, as Horovod's does, and -np is "
                         "then how many slots the first launch waits for")
    elastic.add_argument("--max-np", type=_rank_count, metavar="M", help="most ranks to run with (default: all slots)")
    elastic.add_argument("--host-discovery-script", metavar="SCRIPT",
                         help="executable printing the usable hosts, one HOST or HOST:SLOTS per line; run "
                              "again every second while the job runs, and while waiting for hosts")
    elastic.add_argument("--restarts", type=_restart_count, metavar="K",
                         help="relaunches allowed after failures (default 3; new hosts do not count)")
    elastic.add_argument("--elastic-timeout", type=_seconds, default=600.0, metavar="S",
                         help="how long to wait for --min-np slots before failing (default 600)")
    elastic.add_argument("--blacklist-cooldown-range", type=float, nargs=2, metavar=("LOW", "HIGH"),
                         help="a slot group that lost a rank comes back after LOW * 2^n seconds (n: its "
                              "losses so far, plus up to LOW at random), within LOW..HIGH, as in Horovod "
                              f"({MIN_COOLDOWN_S:g} <= LOW <= HIGH <= {MAX_COOLDOWN_S:g}; default: it stays out)")
    elastic.add_argument("--elastic-dir", metavar="DIR",
                         help="where commits are kept between launches, on a filesystem every host sees "
                              "(default: a temporary directory, removed when the job succeeds; jobs on "
                              "other hosts must name one)")
    parser.add_argument("--no-listener-note", action="store_true",
                        help="do not say which addresses the MPI launcher listens on beyond loopback "
                             "(see the trust model in docs/guides/cluster.md)")
    parser.add_argument("--verbose", action="store_true",
                        help="print the mpirun command line to stderr before running it, and show all of "
                             "the job's output once it fails (without it psrun shows the failing rank's "
                             "traceback once and puts the rest in a log file it names)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the mpirun command line to stdout and exit without running it (elastic: "
                             "the first launch's, with the hosts usable now)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the program each rank runs")
    return parser


def _seconds(text: str) -> float:
    """A duration flag's value: a finite number of seconds above zero (``nan`` would wait forever)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number of seconds above 0")
    return value


def _hosts(args: argparse.Namespace, env: Mapping[str, str], merge: bool = True) -> tuple[Host, ...] | None:
    """The hosts the user asked for, or SLURM's, or None for this machine (``merge=False``:
    a repeated host's entries stay apart, as elastic slot groups)."""
    if args.hosts is not None:
        return parse_hosts(args.hosts, merge)
    if args.hostfile is not None:
        return parse_hostfile(args.hostfile, merge)
    return hosts_from_slurm(env)


def _rank_env(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The variables psrun's own flags set on every rank."""
    settings = []
    if args.num_servers is not None:
        if args.num_proc is not None and args.num_servers >= args.num_proc:
            raise LaunchError(f"--num-servers {args.num_servers} leaves no worker among -np {args.num_proc} "
                              "ranks; use fewer servers or more ranks")
        settings.append((ENV_NUM_SERVERS, str(args.num_servers)))
    if args.timeline_filename is not None:
        settings.append((ENV_TIMELINE, args.timeline_filename))
    if args.timeline_mark_cycles:
        settings.append((ENV_TIMELINE_MARK_CYCLES, "1"))
    return settings


def _comma_list(values: Sequence[str]) -> list[str]:
    """Every item of repeated, comma-separated flag values (``a,b --flag c`` gives a, b, c)."""
    return [item.strip() for value in values for item in value.split(",")]


def _launcher(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[Launch, RunJob]:
    """Validate what does not depend on the hosts; returns the function that writes the
    mpirun command line for given hosts, rank count and extra rank variables (raises on
    bad input), and the function that runs such a command line."""
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    try:
        mpi_args = shlex.split(args.mpi_args)
    except ValueError as e:
        raise LaunchError(f"--mpi-args {args.mpi_args!r}: {e}") from None
    if not command:  # checked before probing mpirun, the slowest step
        raise LaunchError("no command given; usage: psrun -np N [options] command ...")
    rank_env = _rank_env(args)
    mpirun = find_mpirun(args.mpirun, python=sys.executable, path=env.get("PATH", os.defpath))
    flavour, version = detect_mpi(mpirun, env)
    mpirun_env = launcher_environment(mpirun, env)
    if mpirun_env.get("PATH") != env.get("PATH"):  # mpirun's own directory first; the ranks keep the user's PATH
        rank_env.append(("PATH", env.get("PATH", os.defpath)))
    library = library_of(mpirun, flavour)
    if library is not None and "MPI4PY_LIBMPI" not in env:  # the ranks load this mpirun's own MPI
        rank_env.append(("MPI4PY_LIBMPI", library))
    if THP_VARIABLE not in env:
        rank_env.append((THP_VARIABLE, "1"))
    def launch(hosts: tuple[Host, ...] | None, num_proc: int | None, extra_env: Sequence[tuple[str, str]]
               ) -> JobCommand:
        plan, warnings = plan_launch(
            flavour=flavour, mpirun=mpirun, command=command,
            num_proc=num_proc, hosts=hosts, local_cpus=os.cpu_count() or 1,
            oversubscribe=args.oversubscribe, as_root=os.geteuid() == 0, mpi_args=mpi_args,
            rank_env=[*rank_env, *extra_env], launch_agent=args.launch_agent,
            network_interfaces=_comma_list(args.network_interface), network_cidrs=_comma_list(args.network_cidr),
            version=version,
        )
        for warning in warnings:
            print(warning, file=sys.stderr, flush=True)
        return JobCommand(tuple(build_command(plan, env)), plan.num_proc if plan.rank_stderr else 0,
                          rank_hosts(plan))

    noted: list[list[Listener]] = []  # said once per psrun, elastic relaunches included

    def run(command: JobCommand) -> JobResult:
        if args.no_listener_note or noted:
            return run_job(command, mpirun_env, verbose=args.verbose)
        spans_hosts = not all(map(is_local_host, set(command.rank_hosts)))

        def say(found: list[Listener]) -> None:
            noted.append(found)
            print(note(flavour.value, found, spans_hosts=spans_hosts), file=sys.stderr, flush=True)

        stop = threading.Event()
        watcher = watch_launcher(say, stop)
        try:
            return run_job(command, mpirun_env, verbose=args.verbose)
        finally:  # no note after the job's own last words
            stop.set()
            watcher.join(timeout=5.0)

    return launch, run


def _prepare(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[JobCommand, RunJob]:
    """Validate everything; the mpirun command line and what runs it. Raises on bad input."""
    hosts = _hosts(args, env)
    launch, run = _launcher(args, env)
    return launch(hosts, args.num_proc, ()), run


def _is_elastic(args: argparse.Namespace) -> bool:
    return any(value is not None for value in (args.min_np, args.max_np, args.host_discovery_script,
                                               args.restarts, args.elastic_dir, args.blacklist_cooldown_range))


def _elastic(args: argparse.Namespace, env: Mapping[str, str]) -> Supervisor:
    """The supervisor of an elastic job; raises on bad flags before anything runs."""
    static = None if args.host_discovery_script else _hosts(args, env, merge=False)
    if static is None and not args.host_discovery_script:  # this machine: -np slots, else its CPUs
        wanted, cpus = max(args.num_proc or 1, args.min_np or 1), os.cpu_count() or 1
        if not args.oversubscribe:
            check_implicit_oversubscription(wanted, cpus, f"{cpus} local CPUs", "-np/--min-np")
        static = (Host("localhost", args.num_proc or max(cpus, wanted)),)
    if args.host_discovery_script and (args.hosts or args.hostfile):
        raise LaunchError("--host-discovery-script replaces -H and --hostfile: give one source of hosts")
    min_np = args.min_np if args.min_np is not None else (args.num_proc or 1)  # counts are >= 1 (parsed)
    max_np = args.max_np if args.max_np is not None else 1 << 30  # as many as there are slots
    restarts = 3 if args.restarts is None else args.restarts
    if max_np < min_np:
        raise LaunchError(f"--min-np {min_np} and --max-np {max_np}: need 1 <= min-np <= max-np")
    cooldown = tuple(args.blacklist_cooldown_range) if args.blacklist_cooldown_range else None
    if cooldown is not None and (problem := check_cooldown_range(*cooldown)):
        raise LaunchError(problem)
    if args.num_proc is not None and not min_np <= args.num_proc <= max_np:
        raise LaunchError(f"-np {args.num_proc} lies outside --min-np {min_np} .. --max-np {max_np}")
    if args.num_servers is not None and args.num_servers >= min_np:
        raise LaunchError(f"--num-servers {args.num_servers} leaves no worker at --min-np {min_np}")
    launch, run = _launcher(args, env)
    if static is not None:  # what no launch could run (an unknown host, a script as the program), refused now
        launch(static, None, ())
    settings = ElasticSettings(min_np, max_np, args.num_proc, restarts, args.elastic_timeout,
                               args.host_discovery_script, args.elastic_dir, cooldown)
    return Supervisor(settings, static, launch, run)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``psrun``; returns the process exit code."""
    try:
        args = make_parser().parse_args(argv)
    except SystemExit as e:  # argparse already printed usage and the error
        return e.code if isinstance(e.code, int) else USAGE_ERROR
    env = dict(os.environ)
    if _is_elastic(args):
        try:
            supervisor = _elastic(args, env)
        except (LaunchError, HostfileError) as e:
            print(f"psrun: error: {e}", file=sys.stderr, flush=True)
            return USAGE_ERROR
        try:
            if args.dry_run:
                return supervisor.dry_run(lambda line: print(line, flush=True))
            return supervisor.run()
        except (LaunchError, HostfileError) as e:  # a launch's command line, refused
            print(f"psrun: error: {e}", file=sys.stderr, flush=True)
            return USAGE_ERROR
    try:
        cmd, run = _prepare(args, env)
    except (LaunchError, HostfileError) as e:
        print(f"psrun: error: {e}", file=sys.stderr, flush=True)
        return USAGE_ERROR
    if args.dry_run:
        print(cmd, flush=True)
        return 0
    if args.verbose:
        print(cmd, file=sys.stderr, flush=True)
    try:
        result = run(cmd)
    except OSError as e:
        print(f"psrun: error: cannot start {cmd.argv[0]}: {e.strerror or e}", file=sys.stderr, flush=True)
        return USAGE_ERROR
    if result.failure is not None:
        print(f"psrun: {result.failure.summary()}", file=sys.stderr, flush=True)
        return result.returncode or 1  # a failed rank never makes a successful job
    if result.stopped_by is not None:
        print(f"psrun: job stopped by {signal.Signals(result.stopped_by).name} "
              f"(mpirun exited with code {result.returncode})", file=sys.stderr, flush=True)
    elif result.returncode != 0:
        print(f"psrun: job failed: mpirun exited with code {result.returncode}", file=sys.stderr, flush=True)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
