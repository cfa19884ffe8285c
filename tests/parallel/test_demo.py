"""The README's demo commands work end to end: ``make demo`` trains the digits
example on 2 ranks to at least 95% test accuracy, ``make demo-collectives``
runs every collective, each rank reporting what it got, and ``make demo-ps``
trains the digits model against a parameter server (1 server, 2 workers) in
sync, async and bounded mode, each to at least 90%, and the whole job (server
included) exits cleanly; ``make demo-zero`` trains it with ZeRO stages 1-3 to at least
95%, and the model consolidated from each stage's checkpoint scores the same; ``make demo-gpt``
trains the tiny GPT on 4 ranks as TP 2 × PP 2 and its loss falls by more than 1.5; ``make demo-hf``
trains a Hugging Face Llama-layout model on 4 ranks as TP 2 × PP 2 to continue repeating token
patterns, and the checkpoint ``save_pretrained`` writes from the shards, loaded in one process by
``transformers``, generates continuations that follow the pattern."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 180


def make(target: str) -> subprocess.CompletedProcess:
    """Run a Makefile target on 2 ranks in the environment running the tests, without
    re-installing; on timeout the whole process group (make, psrun, mpirun, the ranks) ends."""
    venv = Path(sys.prefix)
    command = ["make", "-s", "-o", str(venv / ".psrt-installed"), target, f"VENV={venv}", "NP=2"]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        pytest.fail(f"`make {target}` did not finish in {TIMEOUT_S} s\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


@pytest.mark.parallel
def test_make_demo_trains_digits_to_95_percent_on_two_ranks():
    done = make("demo")
    assert done.returncode == 0, done.stdout + done.stderr
    found = re.findall(r"^test accuracy (\d+\.\d+)$", done.stdout, flags=re.MULTILINE)
    assert len(found) == 1, f"expected one accuracy line (rank 0 only):\n{done.stdout}\n{done.stderr[-3000:]}"
    assert float(found[0]) >= 0.95, done.stdout


@pytest.mark.parallel
def test_make_demo_collectives_runs_every_collective_on_two_ranks():
    done = make("demo-collectives")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "psrt demo: 2 ranks" in out and "psrt demo: all collectives completed" in out
    for rank in (0, 1):
        assert re.search(rf"\[rank {rank}\] allreduce \(Sum\) +\[10\.0, 12\.0, 14\.0, 16\.0\]", out)
        assert re.search(rf"\[rank {rank}\] allgather \(rank\+1 rows\) +\[0, 1, 1\]", out)
    assert re.search(r"\[rank 0\] alltoall received +\[0, 100, 101\] splits \[1, 2\]", out)
    assert re.search(r"\[rank 1\] reducescatter \(Sum\) +\[2\.0, 2\.0\]", out)


@pytest.fixture(scope="module")
def ps_demo() -> subprocess.CompletedProcess:
    return make("demo-ps")


@pytest.mark.parallel
def test_make_demo_ps_exits_cleanly(ps_demo):
    assert ps_demo.returncode == 0, ps_demo.stdout + ps_demo.stderr[-3000:]


@pytest.mark.parallel
@pytest.mark.parametrize("mode", ["sync", "async", "bounded"])
def test_make_demo_ps_trains_digits_to_90_percent(ps_demo, mode):
    found = re.findall(rf"^mode {mode}: test accuracy (\d+\.\d+)$", ps_demo.stdout, flags=re.MULTILINE)
    assert len(found) == 1, f"expected one accuracy line for {mode} (worker 0 only):\n{ps_demo.stdout}"
    assert float(found[0]) >= 0.9, ps_demo.stdout


@pytest.fixture(scope="module")
def zero_demo() -> subprocess.CompletedProcess:
    return make("demo-zero")


@pytest.mark.parallel
def test_make_demo_zero_exits_cleanly(zero_demo):
    assert zero_demo.returncode == 0, zero_demo.stdout + zero_demo.stderr[-3000:]


@pytest.mark.parallel
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_make_demo_zero_trains_digits_to_95_percent_and_its_checkpoint_agrees(zero_demo, stage):
    found = re.findall(rf"^stage {stage}: test accuracy (\d+\.\d+) \(consolidated copy (\d+\.\d+)\)",
                       zero_demo.stdout, flags=re.MULTILINE)
    assert len(found) == 1, f"expected one accuracy line for stage {stage} (rank 0 only):\n{zero_demo.stdout}"
    sharded, consolidated = map(float, found[0])
    assert sharded >= 0.95 and consolidated == sharded, zero_demo.stdout


@pytest.mark.parallel
def test_make_demo_gpt_trains_the_tiny_gpt_on_tp2_pp2():
    done = make("demo-gpt")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    found = re.findall(r"^dp=1 tp=2 pp=2 \(1f1b, 4 micro-batches\): loss (\d+\.\d+) -> (\d+\.\d+) in \d+ steps$",
                       done.stdout, flags=re.MULTILINE)
    assert len(found) == 1, f"expected one summary line (rank 0 only):\n{done.stdout}\n{done.stderr[-3000:]}"
    first, last = map(float, found[0])
    assert last < first - 1.5, done.stdout


@pytest.mark.parallel
def test_make_demo_hf_trains_llama_on_tp2_pp2_and_transformers_generates_from_its_checkpoint():
    done = make("demo-hf")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    losses = [float(loss) for loss in re.findall(r"^step +\d+ +loss (\d+\.\d+)$", done.stdout, flags=re.MULTILINE)]
    assert len(losses) >= 2, f"expected the loss lines of rank 0:\n{done.stdout}\n{done.stderr[-3000:]}"
    assert losses[0] > 5 and losses[-1] < 1.0, done.stdout  # from chance (ln 299 = 5.7) to copying the pattern
    found = re.findall(r"^from_pretrained \+ generate: (\d+)/(\d+) generated tokens follow the pattern$",
                       done.stdout, flags=re.MULTILINE)
    assert len(found) == 1, f"expected one generation summary (rank 0 only):\n{done.stdout}"
    right, total = map(int, found[0])
    assert total > 0 and right >= 0.9 * total, done.stdout
