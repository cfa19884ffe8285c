"""The one-line shell script psrun starts every rank through: it gives the rank torchrun's
variables, and on this machine its stderr on a pipe of its own, read by psrun, instead of
mpirun's merged one.

torch's tools find a rank's place in torchrun's variables (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``), which no MPI launcher sets: the script exports each
one the rank lacks from Open MPI's or Hydra's own (:data:`launcher.contract.TORCH_RANK_VARIABLES`),
on every host, before the program starts, so that even code that runs before ``import
psrt.torch`` finds them. A value the rank already has (given with mpirun's ``-x`` or Hydra's
``-genv``) stays. In parameter-server mode (``PSRT_NUM_SERVERS``) the script sets none: there
they describe the workers alone, which only ``init()`` knows (:mod:`psrt.rank_env`).

Through mpirun, the stderr of every rank arrives merged, line by line as the ranks wrote
them: when two ranks raise at once (a collective called with different shapes raises on
every rank), their tracebacks interleave line by line and no reader can take them apart.
Open MPI can tag each line with its rank, but then it holds output back until a newline,
which freezes progress bars. So for a job whose ranks all run on this machine, psrun makes
one named pipe (FIFO) per rank in a private directory, and starts each rank through a
one-line shell script that points the rank's stderr at its pipe and then ``exec``\\ s the
command: the rank keeps the process id mpirun gave it, its exit code and its signals, and
psrun reads every rank's stderr apart, unbuffered.

The script finds the directory in :data:`DIRECTORY_VARIABLE` and the rank in Open MPI's or
Hydra's variable; where either is missing (a remote rank, the command line run by hand)
it leaves stderr alone.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence

from launcher.contract import ENV_NUM_SERVERS, TORCH_RANK_VARIABLES

__all__ = ["DIRECTORY_VARIABLE", "RankStderr", "wrap_command"]

DIRECTORY_VARIABLE = "PSRUN_RANK_STDERR"
# Beside its pipe each rank leaves its process id (``RANK.pid``): MPICH names a failed rank
# by process id only.
_STDERR = (f'f="${DIRECTORY_VARIABLE}/${{OMPI_COMM_WORLD_RANK:-$PMI_RANK}}"; '
           'if [ -p "$f" ]; then echo $$ > "$f.pid"; exec 2>"$f"; fi; ')


def _first_set(names: Sequence[str]) -> str:
    """The shell expansion of the first of ``names`` that is set and not empty."""
    return f"${{{names[0]}:-{_first_set(names[1:])}}}" if len(names) > 1 else f"${names[0]}"


def _torch_variables() -> str:
    """Shell commands that export each of torchrun's variables the rank lacks, where its
    launcher's variable holds it (never an empty value: tools read them as numbers)."""
    exports = "".join(f'v={_first_set(sources)}; [ -z "${name}" ] && [ -n "$v" ] && export {name}=$v; '
                      for name, sources in TORCH_RANK_VARIABLES)
    return f'if [ "${{{ENV_NUM_SERVERS}:-0}}" = 0 ]; then {exports}fi; '


_SCRIPT = _torch_variables() + _STDERR + 'exec "$@"'


def wrap_command(command: Sequence[str]) -> list[str]:
    """``command`` started with torchrun's variables, and its stderr going to psrun's pipe for its
    rank if there is one."""
    return ["/bin/sh", "-c", _SCRIPT, "psrun-rank", *command]


class RankStderr:
    """The pipes of ``num_ranks`` ranks, open for reading before any rank starts (so that a
    rank's opening never waits) and held open for writing by psrun too until
    :meth:`stop_waiting`, so that a rank that has not started yet does not read as ended.
    ``readers`` maps each rank to the file descriptor to read (non-blocking)."""

    def __init__(self, num_ranks: int) -> None:
        self.directory = tempfile.mkdtemp(prefix="psrun-stderr-")
        self.readers: dict[int, int] = {}
        self._writers: list[int] = []
        try:
            for rank in range(num_ranks):
                path = os.path.join(self.directory, str(rank))
                os.mkfifo(path, 0o600)
                self.readers[rank] = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
                self._writers.append(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            self.close()
            raise

    def rank_of_pid(self, pid: int) -> int | None:
        """The rank whose process id is ``pid``, if it started and said so (None otherwise)."""
        for rank in self.readers:
            try:
                with open(os.path.join(self.directory, f"{rank}.pid")) as f:
                    if f.read().strip() == str(pid):
                        return rank
            except OSError:
                continue
        return None

    def stop_waiting(self) -> None:
        """mpirun has ended: a pipe whose rank has closed it may now read as ended."""
        for fd in self._writers:
            os.close(fd)
        self._writers = []

    def remove(self) -> None:
        """Remove the pipes' names (what is open stays open)."""
        shutil.rmtree(self.directory, ignore_errors=True)

    def close(self) -> None:
        self.stop_waiting()
        for fd in self.readers.values():
            os.close(fd)
        self.readers = {}
        self.remove()
