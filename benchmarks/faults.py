"""How fast a job ends after a fault, and what the stall watchdog costs when nothing is wrong.

Run as a plain script (it launches its own jobs with psrun): ``python benchmarks/faults.py``.
Each fault is injected from outside a running training job, once the job has printed a few
steps, and timed from the signal (or the link going down) to psrun's exit:

* killed rank: SIGKILL to rank 1 of 2 (data-parallel);
* frozen rank: SIGSTOP to rank 1 of 2 (data-parallel);
* frozen server: SIGSTOP to the parameter server of a 1-server, 2-worker job;
* partitioned link: two "hosts" (network namespaces, see ``tests/multihost/netns.py``), one
  cut off from the other (skipped where namespaces cannot be made);
* deadlocks, with the default stall settings, timed from the last rank blocking to psrun's
  exit (``tests/parallel/scripts/deadlock_job.py``): ``opt.save()`` of ZeRO on rank 0 only
  (engine collectives), a TP all-reduce against ``hvd.allreduce`` (direct against engine), and
  rank 0 at exit while the others wait in a TP all-reduce, each at 2 and 4 ranks.

The stall settings are PSRT_STALL_CHECK_TIME / PSRT_STALL_SHUTDOWN_TIME (3 s / 8 s unless
given): a frozen rank cannot end the job before the shutdown time, so the figure that
matters is the excess over it (probing, the abort, psrun's clean-up).  The watchdog's
cost when nothing is wrong is what marking one wait costs (every engine round and every
TP collective marks one; nothing polls).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import timeit
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "parallel"), str(REPO / "tests" / "multihost")]

from faults import run_until_it_ends, run_with_fault  # noqa: E402
import netns  # noqa: E402
from psrt.comm.watchdog import Watchdog  # noqa: E402


FAULTS = ("killed rank", "frozen rank", "frozen server", "partitioned link", "deadlock")
#: (label, deadlock_job.py mode, ranks)
DEADLOCKS = [(f"deadlock {what} ({np} ranks)", mode, np) for what, mode in
             (("engine: save on rank 0", "zero_save"), ("direct vs engine", "tp_vs_engine"),
              ("exit vs direct", "exit_vs_tp")) for np in (2, 4)]


def time_local(kind: str, env: dict[str, str]) -> float:
    """Seconds from the fault to the job's end for one run of ``kind``."""
    if kind == "killed rank":
        job = run_with_fault("frozen_training.py", 2, ("dp",), env, after="step 3", rank=1, signum=signal.SIGKILL)
    elif kind == "frozen rank":
        job = run_with_fault("frozen_training.py", 2, ("dp",), env, after="step 3", rank=1, signum=signal.SIGSTOP)
    else:
        job = run_with_fault("frozen_training.py", 3, ("ps",), {**env, "PSRT_NUM_SERVERS": "1"}, after="step 3",
                             rank=2, signum=signal.SIGSTOP)
    if job.returncode in (0, None) or job.left_behind:
        raise RuntimeError(f"{kind}: the job did not end as it should\n{job.diagnosis()}")
    return job.seconds_after_fault


def time_deadlock(mode: str, np: int) -> float:
    """Seconds from the last rank blocking to the job's end, with the default stall settings."""
    job = run_until_it_ends("deadlock_job.py", np, (mode,), {})
    if job.returncode in (0, None) or "psrt: deadlock:" not in job.stderr or job.left_behind:
        raise RuntimeError(f"deadlock {mode}: the job did not end as it should\n{job.diagnosis()}")
    return job.seconds_after_fault


def time_partition(bed: netns.Testbed, env: dict[str, str]) -> float:
    script = str(REPO / "tests" / "multihost" / "cross_host_job.py")
    job = bed.psrun("-np", "2", sys.executable, script, "dp", "--steps", "100000", "--step-sleep", "0.05",
                    slots=1, env=env)
    try:
        job.wait_for_line(r"^step 5$", 120)
        bed.partition(bed.hosts[1])
        cut_at = time.time()
        code = job.finish(float(env["PSRT_STALL_SHUTDOWN_TIME"]) + 60)
    finally:
        job.stop()
        bed.heal(bed.hosts[1])
    if code in (0, None):
        raise RuntimeError(f"partition: the job did not end\n{job.diagnosis()}")
    return job.ended_at - cut_at


def time_partitions(env: dict[str, str], repeats: int) -> dict[str, list[float]]:
    """The partition runs on a two-host test bed built for them (none where it cannot be)."""
    reason = netns.skip_reason()
    if reason is not None:
        print(f"partitioned link: skipped ({reason})")
        return {}
    bed = netns.Testbed(f"psrt-b-{os.getpid()}-", 2, Path(tempfile.mkdtemp(prefix="psrt-faults-")))
    try:
        bed.build()
        seconds = [time_partition(bed, env) for _ in range(repeats)]
        print(f"partitioned link: {seconds}", flush=True)
        return {"partitioned link": seconds}
    except netns.SetupRefused as e:
        print(f"partitioned link: skipped ({e})")
        return {}
    finally:
        bed.destroy()


def marking_cost_us(runs: int = 200_000) -> dict[str, float]:
    """Microseconds to enter and leave one marked wait: made for the call (a TP or engine
    collective), or made once and entered again (the engine thread's negotiation rounds)."""
    dog = Watchdog(60.0, 0.0, lambda how: None)
    peers = (0, 1)
    kept = dog.waiting("an engine negotiation round", "x", peers)

    def per_call() -> None:
        with dog.waiting("a tensor-parallel collective", "x", peers):
            pass

    def reused() -> None:
        with kept:
            pass
    try:
        return {name: min(timeit.repeat(f, number=runs, repeat=5)) / runs * 1e6
                for name, f in (("per_call", per_call), ("reused", reused))}
    finally:
        dog.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--check", type=float, default=3.0, help="PSRT_STALL_CHECK_TIME")
    parser.add_argument("--shutdown", type=float, default=8.0, help="PSRT_STALL_SHUTDOWN_TIME")
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of: {', '.join(FAULTS)}")
    args = parser.parse_args()
    chosen = args.faults.split(",")
    unknown = sorted(set(chosen) - set(FAULTS))
    if unknown:
        parser.error(f"unknown faults {unknown}; choose from {FAULTS}")
    env = {"PSRT_STALL_CHECK_TIME": f"{args.check:g}", "PSRT_STALL_SHUTDOWN_TIME": f"{args.shutdown:g}"}
    results: dict[str, list[float]] = {}
    for kind in FAULTS[:3]:
        if kind in chosen:
            results[kind] = [time_local(kind, env) for _ in range(args.repeats)]
            print(f"{kind}: {results[kind]}", flush=True)
    if "partitioned link" in chosen:
        results.update(time_partitions(env, args.repeats))
    if "deadlock" in chosen:
        for label, mode, np in DEADLOCKS:
            results[label] = [time_deadlock(mode, np) for _ in range(args.repeats)]
            print(f"{label}: {results[label]}", flush=True)
    stalls = {"frozen rank", "frozen server", "partitioned link"}
    print(f"fault -> job end, {args.repeats} runs each (PSRT_STALL_CHECK_TIME={args.check:g} s, "
          f"PSRT_STALL_SHUTDOWN_TIME={args.shutdown:g} s)")
    print(f"{'fault':<42} {'median s':>9} {'min s':>7} {'max s':>7} {'over shutdown time':>19}")
    for kind, seconds in results.items():
        median = statistics.median(seconds)
        over = f"{median - args.shutdown:+.1f} s" if kind in stalls else "-"
        print(f"{kind:<42} {median:>9.1f} {min(seconds):>7.1f} {max(seconds):>7.1f} {over:>19}")
    cost = marking_cost_us()
    print(f"marking one wait: {cost['per_call']:.2f} us made per call (each TP or engine collective), "
          f"{cost['reused']:.2f} us reused (each engine negotiation round)")
    print(json.dumps({"benchmark": "faults", "check_s": args.check, "shutdown_s": args.shutdown,
                      "seconds": results, "mark_wait_us": {k: round(v, 3) for k, v in cost.items()}}))


if __name__ == "__main__":
    main()
