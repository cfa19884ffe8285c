"""Running a measuring job of psrt on this machine from a one-process command (``psrt plan
--measure``, ``psrt tune``): a psrun job of a psrt module, its failure turned into an error
that shows the job's output."""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping, Sequence

from psrt.errors import PsrtError


def run(module: str, args: Sequence[str], ranks: int, what: str, env: Mapping[str, str] | None = None
        ) -> subprocess.CompletedProcess[str]:
    """Run ``python -m module args`` on ``ranks`` ranks under psrun (this Python, this
    machine), telling stderr what runs as ``what``; returns the finished job, whose stdout
    is rank 0's report.  Raises :class:`PsrtError` with the job's stderr if it fails."""
    command = [sys.executable, "-m", "launcher.cli", "-np", str(ranks), sys.executable, "-m", module, *args]
    print(f"{what} with {ranks} ranks: {' '.join(command[1:])}", file=sys.stderr)
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=None if env is None else dict(env))
    if done.returncode != 0:
        raise PsrtError(f"the {module} job failed (exit code {done.returncode}):\n{done.stderr[-2000:]}")
    return done
