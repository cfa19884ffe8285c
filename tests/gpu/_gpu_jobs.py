"""Launching the GPU tests' jobs from the test process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def psrun(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """``psrun ARGS`` with this Python, from the repository root.  The environment is the one
    Python sees (an MPI singleton started in this process by in-process tests adds variables
    at the C level that make mpirun fail), without PSRT_*/HOROVOD_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PSRT_", "HOROVOD_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s, cwd=REPO, env=env)
