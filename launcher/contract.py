"""What psrun and the ranks it launches tell each other, written once for both sides.

psrun passes settings to the ranks in environment variables, exchanges files with an
elastic job in the job's directory, and reads the lines a failing rank prints on its stderr
to say which rank failed.  Each side used to spell these names and lines on its own; here
they are the same objects for psrun (``launcher``) and for the ranks (``psrt``), and
``tests/unit/test_launch_contract.py`` checks that a line a rank prints is one psrun parses.

This module imports nothing (no module of psrt or the launcher, nor of the standard library):
psrun starts before any rank and must not pay for torch or MPI, and the ranks' start-up
watcher (:mod:`psrt.comm.startup`, which runs with the standard library alone) loads this
file by its path.  It lives in the launcher rather than in psrt because importing any module
of psrt imports the package, and with it torch and MPI's start-up; the ranks import it from
here.
"""
from __future__ import annotations

# -- environment variables ---------------------------------------------------------------------

#: Variables psrun passes on to every rank as they are: psrt's settings and their Horovod
#: names (every variable psrt's configuration reads starts with one of these).
FORWARDED_PREFIXES = ("PSRT_", "HOROVOD_")

#: The settings psrun's own flags make on every rank (``--num-servers``, ``--timeline-filename``,
#: ``--timeline-mark-cycles``); psrt's configuration reads them like any other.
ENV_NUM_SERVERS = "PSRT_NUM_SERVERS"
ENV_TIMELINE = "PSRT_TIMELINE"
ENV_TIMELINE_MARK_CYCLES = "PSRT_TIMELINE_MARK_CYCLES"

#: torchrun's names for a rank's place in the job, which torch's tools read (accelerate, the
#: Hugging Face Trainer, scripts that pick their device with ``LOCAL_RANK``), each with the
#: variables an MPI launcher holds it in: Open MPI's mpirun first, then Hydra's mpiexec (MPICH,
#: Intel MPI). psrun's rank wrapper (:mod:`launcher.rank_stderr`) and ``import psrt.torch``
#: (:mod:`psrt.rank_env`) set each name a rank lacks from the first of its variables present.
TORCH_RANK_VARIABLES = (
    ("RANK", ("OMPI_COMM_WORLD_RANK", "PMI_RANK")),
    ("LOCAL_RANK", ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")),
    ("WORLD_SIZE", ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")),
    ("LOCAL_WORLD_SIZE", ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")),
)
#: torchrun's names for the node: its index among the job's hosts and their number. No MPI
#: launcher says them; ``init()`` sets them from the hosts the ranks found.
TORCH_NODE_VARIABLES = ("GROUP_RANK", "GROUP_WORLD_SIZE")
#: Every torchrun variable psrt sets (none of its others: ``MASTER_ADDR``, ``MASTER_PORT`` and
#: ``TORCHELASTIC_*`` would change how torch and Lightning start up).
TORCH_VARIABLE_NAMES = (*(name for name, _ in TORCH_RANK_VARIABLES), *TORCH_NODE_VARIABLES)

#: Elastic mode: the directory where the job's commits live (and the files below), the
#: version of the host list this launch runs on, and which launch of the job it is (1, 2, ...).
ENV_ELASTIC_DIR = "PSRT_ELASTIC_DIR"
ENV_ELASTIC_HOSTS_VERSION = "PSRT_ELASTIC_HOSTS_VERSION"
ENV_ELASTIC_LAUNCH = "PSRT_ELASTIC_LAUNCH"

# -- files in the elastic directory ------------------------------------------------------------

#: psrun -> job: the usable hosts changed, ``{"version": N, "hosts": ["host:slots", ...]}``;
#: the job's next commit stops it, to be relaunched on them.
HOSTS_FILE = "hosts.json"
#: job -> psrun: the job ended to be relaunched, ``{"reason": "..."}``.
RESET_FILE = "reset.json"
#: job -> psrun: this launch could not restore its commit, ``{"reason": "..."}``.
RESTORE_FAILED_FILE = "restore-failed.json"

# -- lines a rank prints on stderr, which psrun parses ------------------------------------------
#
# Each line comes as a function that writes it and a pattern that reads it back (a regular
# expression's source: psrun adds what its launcher's output puts around a line).

#: ``psrt: rank R failed: HOW``: rank R raised, or ended the job after a stall, just before
#: the job is aborted.  Groups: the rank, how it failed.
FAILURE_PATTERN = r"psrt: rank (\d+) failed: (.+?)"
#: ``psrt: rank R blames rank Q (ROLE): WHY``: R's stall report found Q to be the rank the
#: others wait for (the role, such as ``worker 1``, is optional).  Groups: the reporter, the
#: culprit, its role or None, why.
BLAME_PATTERN = r"psrt: rank (\d+) blames rank (\d+)(?: \(([^()]+)\))?: (.+?)"


def failure_line(rank: int, how: str) -> str:
    """The line rank ``rank`` (its rank in the job) prints before it ends the job."""
    return f"psrt: rank {rank} failed: {how}"


def rank_name(rank: int, role: str | None = None) -> str:
    """How a report names a rank of the job: ``rank 3``, or ``rank 3 (worker 1)``."""
    return f"rank {rank}" if role is None else f"rank {rank} ({role})"


def blame_line(rank: int, culprit: str, why: str) -> str:
    """The line by which rank ``rank`` blames ``culprit`` (as :func:`rank_name` names it)."""
    return f"psrt: rank {rank} blames {culprit}: {why}"
