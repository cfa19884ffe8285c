"""Elastic training: how long a job takes to resume after losing a rank, and what a commit costs.

Run as a plain script (it launches its own jobs with psrun): ``python benchmarks/elastic.py``.
Both measurements run for two models (see ``benchmarks/elastic_job.py``, the job itself):
``mlp``, examples/train_digits.py's 64-128-64-10 MLP with SGD + momentum through
``hvd.DistributedOptimizer``, and ``zero``, benchmarks/zero.py's 6.3 M-parameter model
(rebuilt there) with ``ZeroOptimizer`` stage 2 and Adam.

Recovery: 3 ranks on a hostfile of three ``localhost:1`` slot groups, ``psrun --hostfile F
--min-np 2 --restarts 1``, committing every 4 steps; rank 1 SIGKILLs itself after step 6
and psrun relaunches the job on the 2 groups left, which resumes from the commit of step 4.
Times are wall clock (one machine, one clock), split into

  detection  the dying rank's timestamp just before ``os.kill`` -> the arrival of psrun's
             ``psrun: elastic: launch 2`` line on its stderr, split at the arrival of Open
             MPI's ``noticed that process rank 1 ...`` line (mpirun report, teardown);
  relaunch   psrun's launch 2 line -> rank 0 of the new job about to call the
             ``@hvd.elastic.run`` function, split into start (mpirun starting the ranks and
             Python reaching the job's first line), imports (torch, psrt), init
             (``hvd.init()``) and build (model, optimizer, ``TorchState``);
  restore    from there to the first step after resuming done, split into read commit
             (the decorator restoring the last commit, up to the function's first line)
             and first step.

Commit cost: 2 ranks, ``psrun -np 2 --min-np 2`` (commits go to psrun's elastic directory,
a fresh one under the system's temporary directory); after warm-up, rounds of 3 steps and
one ``state.commit()``, each timed by rank 0 with ``perf_counter``.  From the medians, the
commit interval that keeps commits under 5 % of the training time is
``commit / (0.05 * step)`` steps.  "step after commit" is the median of each round's first
step, to show whether the writing slows the step that follows it.  Bytes are those of the
commit's directory (every rank's files).  Prints a table per measurement and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from jobs import Job, psrun_argv, start_job  # noqa: E402

JOB = str(REPO / "benchmarks" / "elastic_job.py")
MODELS = ("mlp", "zero")
JOB_TIMEOUT_S = 300.0
OVERHEAD_SHARE = 0.05
# Phases of the recovery, in the order shown: name -> (from event, to event).  The events are
# the job's, plus the arrival of two lines on psrun's stderr: "reported" (Open MPI's "noticed
# that process rank ..." about the killed rank) and "relaunched" (psrun's launch 2 line).
# The indented ones split the phase above them.
PHASES = {"detection": ("kill", "relaunched"), "mpirun report": ("kill", "reported"),
          "teardown": ("reported", "relaunched"), "relaunch": ("relaunched", "built"),
          "start": ("relaunched", "started"), "imports": ("started", "imported"),
          "init": ("imported", "initialized"), "build": ("initialized", "built"),
          "restore": ("built", "stepped"), "read commit": ("built", "entered"),
          "first step": ("entered", "stepped"), "total": ("kill", "stepped")}
INDENTED = {"mpirun report", "teardown", "start", "imports", "init", "build", "read commit", "first step"}


def run_job(flags: list[str], model: str, measure: list[str]) -> Job:
    job = start_job(psrun_argv(*flags, sys.executable, JOB, "--model", model, *measure), f"elastic {model}")
    if job.finish(JOB_TIMEOUT_S) != 0:
        raise RuntimeError(f"the job failed\n{job.diagnosis()}")
    return job


def events(job: Job) -> dict[str, float]:
    """When each event happened: the killing rank's, launch 2's rank 0's and psrun's lines."""
    found = {}
    for _, line in job.stdout:
        match = re.fullmatch(r"elastic-bench (\d+) (\w+) ([\d.]+)", line)
        if match and (match[1] == "2" or match[2] == "kill"):
            found[match[2]] = float(match[3])
    found["reported"] = next(at for at, line in job.stderr if "noticed that process rank" in line)
    found["relaunched"] = next(at for at, line in job.stderr if line.startswith("psrun: elastic: launch 2:"))
    return found


def recovery(model: str, hostfile: str) -> dict[str, float]:
    """Seconds of each recovery phase in one run."""
    job = run_job(["--hostfile", hostfile, "--min-np", "2", "--restarts", "1"], model, ["recovery"])
    at = events(job)
    return {phase: at[end] - at[begin] for phase, (begin, end) in PHASES.items()}


def commit_cost(model: str) -> dict[str, float]:
    job = run_job(["-np", "2", "--min-np", "2"], model, ["commits"])
    line = next(line for _, line in job.stdout if line.startswith("elastic-bench-commits "))
    measured = json.loads(line.split(" ", 1)[1])
    step = statistics.median(s for round_ in measured["step_s"] for s in round_)
    commit = statistics.median(measured["commit_s"])
    return {"step_s": step, "commit_s": commit, "commit_bytes": measured["commit_bytes"],
            "after_commit_step_s": statistics.median(round_[0] for round_ in measured["step_s"]),
            "interval_steps": math.ceil(commit / (OVERHEAD_SHARE * step))}


def print_recovery(runs: dict[str, list[dict[str, float]]]) -> None:
    repeats = len(next(iter(runs.values())))
    print(f"\nrecovery, 3 -> 2 ranks after a SIGKILL, seconds: median (min-max) of {repeats} runs")
    print(f"{'phase':<15}" + "".join(f"{model:>21}" for model in runs))
    for phase in PHASES:
        cells = []
        for seconds in ([run[phase] for run in model_runs] for model_runs in runs.values()):
            cells.append(f"{statistics.median(seconds):.2f} ({min(seconds):.2f}-{max(seconds):.2f})")
        name = f"  {phase}" if phase in INDENTED else phase
        print(f"{name:<15}" + "".join(f"{cell:>21}" for cell in cells))


def print_commits(costs: dict[str, dict[str, float]]) -> None:
    print(f"\ncommit cost, 2 ranks (medians; interval = steps between commits for < {OVERHEAD_SHARE:.0%} overhead)")
    print(f"{'model':<6} {'step ms':>8} {'step after commit ms':>21} {'commit ms':>10} {'commit/step':>12} "
          f"{'MB per commit':>14} {'interval':>9}")
    for model, c in costs.items():
        print(f"{model:<6} {c['step_s'] * 1e3:>8.1f} {c['after_commit_step_s'] * 1e3:>21.1f} "
              f"{c['commit_s'] * 1e3:>10.1f} {c['commit_s'] / c['step_s']:>12.1f} {c['commit_bytes'] / 1e6:>14.2f} "
              f"{c['interval_steps']:>9}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="recovery runs per model")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    args = parser.parse_args()
    with tempfile.NamedTemporaryFile("w", prefix="psrt-elastic-hosts-", suffix=".txt") as hostfile:
        hostfile.write("localhost:1\n" * 3)
        hostfile.flush()
        runs = {model: [] for model in args.models}
        for _ in range(args.repeats):  # the models take turns
            for model in args.models:
                runs[model].append(recovery(model, hostfile.name))
                print(f"{model} recovery: " + ", ".join(f"{k} {v:.2f}" for k, v in runs[model][-1].items()),
                      flush=True)
    costs = {model: commit_cost(model) for model in args.models}
    print_recovery(runs)
    print_commits(costs)
    print(json.dumps({"benchmark": "elastic", "recovery_s": runs, "commits": costs}))


if __name__ == "__main__":
    main()
