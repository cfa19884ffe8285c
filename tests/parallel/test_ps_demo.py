"""The parameter-server demo works end to end: ``examples/train_digits_ps.py`` on one
server and two workers trains the digits MLP in sync, async and bounded mode, one
after another in the same job, each to at least 90% test accuracy, and the job
(server included) exits cleanly once the workers shut down."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240
MODES = ("sync", "async", "bounded")


@pytest.fixture(scope="module")
def demo() -> subprocess.CompletedProcess:
    """One launch of the demo for the whole module (starting the ranks costs seconds);
    on timeout the whole process group (psrun, mpirun, the ranks) ends."""
    command = [sys.executable, "-m", "launcher.cli", "-np", "3", "--num-servers", "1", sys.executable,
               "examples/train_digits_ps.py"]
    # A PSRT_* or HOROVOD_* variable in the caller's environment would change what the job tests.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PSRT_", "HOROVOD_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    start = time.monotonic()
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, errors="replace", start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        pytest.fail(f"the parameter-server demo did not finish in {TIMEOUT_S} s\n"
                    f"{stdout[-3000:]}\n{stderr[-3000:]}")
    print(f"parameter-server demo took {time.monotonic() - start:.1f} s")
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


@pytest.mark.parallel
def test_ps_demo_exits_cleanly(demo):
    assert demo.returncode == 0, demo.stdout + demo.stderr[-3000:]


@pytest.mark.parallel
@pytest.mark.parametrize("mode", MODES)
def test_ps_demo_trains_digits_to_90_percent(demo, mode):
    found = re.findall(rf"^mode {mode}: test accuracy (\d+\.\d+)$", demo.stdout, flags=re.MULTILINE)
    assert len(found) == 1, (f"expected one accuracy line for mode {mode} (worker 0 only):\n"
                             f"{demo.stdout}\n{demo.stderr[-3000:]}")
    assert float(found[0]) >= 0.9, demo.stdout


@pytest.mark.parallel
def test_ps_demo_trains_the_modes_in_order(demo):
    modes = re.findall(r"^mode (\w+): test accuracy", demo.stdout, flags=re.MULTILINE)
    assert modes == list(MODES), demo.stdout + demo.stderr[-3000:]
