"""``make gpu-check``: everything a machine with a GPU can tell about psrt, in one command.

Runs ``pytest tests/gpu`` (JUnit report), then ``benchmarks/gpu.py`` on one rank, then a
profiler trace of two ranks sharing the GPU (``benchmarks/gpu_shared_trace.py``), each under
its own time limit (together under 9 minutes), and writes one results file,
``benchmarks/results/gpu-check-<date>-<gpu>.json``: when and where (host, GPU, torch, CUDA,
NCCL, CuPy, mpi4py and MPI versions), each test's outcome, what NCCL did with two ranks on
one GPU, and the benchmark's figures.  It then prints the Markdown that RESULTS.md takes
(``--render FILE`` prints it again from a results file).  Exits 1 if a test failed or the
benchmark did not finish, 0 otherwise; on a machine without a GPU it says so and exits 0.
A Python without what the check needs (torch, mpi4py, ...) is named with what it lacks and
how to choose another (``make gpu-check PYTHON=...``), and the check exits 2.

Run from the repository root with the repository on ``PYTHONPATH`` (psrt need not be
installed): ``PYTHONPATH=. python3 tests/gpu/check.py``.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
NO_GPU = "gpu-check: no GPU on this machine (torch.cuda.is_available() is False); nothing to check"
#: What the check needs, importable by the Python that runs it: psrt's own requirements
#: (setup.cfg) and pytest; module name -> the package that installs it.
NEEDED = {"torch": "torch", "numpy": "numpy", "mpi4py": "mpi4py", "safetensors": "safetensors", "pytest": "pytest"}
MISSING_EXIT = 2
TESTS_LIMIT_S = 330.0
BENCHMARK_LIMIT_S = 140.0


def run_limited(command: list[str], limit_s: float) -> tuple[int | None, str]:
    """Run ``command`` from the repository root with the repository on PYTHONPATH; its exit
    code (None if it ran past ``limit_s`` and was killed, with every process it started) and
    its output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PSRT_", "HOROVOD_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=limit_s)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out


def missing(needed: dict[str, str] = NEEDED) -> list[str]:
    """The modules of ``needed`` this Python cannot import (looked up, not imported)."""
    return [name for name in needed if importlib.util.find_spec(name) is None]


def missing_message(lacking: list[str], python: str = sys.executable) -> str:
    """What to tell a user whose Python lacks ``lacking``: which Python, what, and the fixes."""
    packages = " ".join(NEEDED[name] for name in lacking)
    return (f"gpu-check: {python} (Python {sys.version.split()[0]}) cannot import {', '.join(lacking)}; "
            f"install {'it' if len(lacking) == 1 else 'them'} ({python} -m pip install {packages}; torch "
            "built for this machine's CUDA), or run the check with a Python that has them: "
            "make gpu-check PYTHON=/path/to/python")


def versions() -> dict[str, str | None]:
    """torch, CUDA, NCCL, CuPy, mpi4py and the MPI library (asked in a child process: MPI
    started here would leave this process's environment unfit for mpirun)."""
    import torch
    found: dict[str, str | None] = {"python": sys.version.split()[0], "torch": torch.__version__,
                                    "cuda": torch.version.cuda, "nccl": None, "cupy": None}
    try:
        found["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # torch without NCCL
        pass
    try:
        import cupy
        found["cupy"] = cupy.__version__
    except ImportError:
        pass
    code, out = run_limited([sys.executable, "-c", "import mpi4py; from mpi4py import MPI; "
                             "print(mpi4py.__version__); print(MPI.Get_library_version().split(',')[0])"], 60)
    lines = out.strip().splitlines() if code == 0 else []
    found["mpi4py"], found["mpi"] = (lines[0], lines[1].strip()) if len(lines) >= 2 else (None, None)
    return found


def read_junit(path: Path) -> tuple[list[dict], dict[str, str]]:
    """Each test's outcome, and the properties the tests recorded."""
    tests, properties = [], {}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, detail = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome = {"failure": "failed", "error": "error"}.get(kind, kind)
                detail = (found.get("message") or found.text or "")[:500]
        for prop in case.iter("property"):
            properties[prop.get("name")] = prop.get("value")
        name = "::".join(filter(None, (case.get("classname"), case.get("name"))))  # a skipped module: its name
        tests.append({"test": name, "outcome": outcome,
                      "seconds": round(float(case.get("time") or 0), 2), "detail": detail})
    return tests, properties


def run_tests(workdir: Path) -> dict:
    junit = workdir / "junit.xml"
    start = time.monotonic()
    code, out = run_limited([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu",
                             f"--junitxml={junit}"], TESTS_LIMIT_S)
    tests, properties = read_junit(junit) if junit.exists() else ([], {})
    return {"exit_code": code, "timed_out": code is None, "seconds": round(time.monotonic() - start, 1),
            "tests": tests, "properties": properties, "output_tail": out[-4000:]}


def run_benchmark(workdir: Path, limit_s: float) -> dict:
    figures = workdir / "gpu-benchmark.json"
    start = time.monotonic()
    code, out = run_limited([sys.executable, "-m", "launcher.cli", "-np", "1", sys.executable, "benchmarks/gpu.py",
                             "--json-out", str(figures)], limit_s)
    record = json.loads(figures.read_text()) if figures.exists() else None
    return {"exit_code": code, "timed_out": code is None, "seconds": round(time.monotonic() - start, 1),
            "figures": record, "output_tail": "" if record and code == 0 else out[-4000:]}


def run_shared_trace(workdir: Path, limit_s: float) -> dict:
    """benchmarks/gpu_shared_trace.py: two ranks on the GPU, a profiler trace's overlap summary."""
    summary = workdir / "gpu-shared-trace.json"
    code, out = run_limited([sys.executable, "-m", "launcher.cli", "-np", "2", sys.executable,
                             "benchmarks/gpu_shared_trace.py", "--json-out", str(summary),
                             "--trace-out", str(workdir / "trace.json")], limit_s)
    record = json.loads(summary.read_text()) if summary.exists() else None
    return {"exit_code": code, "timed_out": code is None, "summary": record,
            "output_tail": "" if record and code == 0 else out[-4000:]}


def _render_shared_trace(trace: dict | None) -> list[str]:
    if not trace or not trace.get("summary"):
        return ["Two ranks sharing the GPU: no trace (" + ("not run" if not trace else
                f"exit code {trace['exit_code']}") + ")."]
    s = trace["summary"]
    return [f"Two ranks sharing the GPU (host staging), {s['steps']} DP steps of a {s['layers']} x {s['width']} "
            f"MLP: copies on psrt's stream {s['copies_ms']} ms, {s['copies_under_compute_ms']} ms of it under "
            f"compute kernels; engine collectives {s['exchanges_ms']} ms, {s['exchanges_under_compute_ms']} ms "
            f"under compute kernels; compute kernels {s['compute_kernels_ms']} ms."]


def render(results: dict) -> str:
    """The Markdown section RESULTS.md takes, from a results file's contents."""
    v, gpu = results["versions"], results["gpu"]
    lines = [f"### GPU check ({results['date']}, {gpu})", "",
             f"Machine: `{results['hostname']}`, {gpu}; torch {v.get('torch')} (CUDA {v.get('cuda')}, "
             f"NCCL {v.get('nccl')}), CuPy {v.get('cupy')}, mpi4py {v.get('mpi4py')} on {v.get('mpi')}. "
             f"Command: `make gpu-check` at {results.get('commit') or 'an unknown commit'}.", ""]
    tests = results["tests"]
    by_file: dict[str, dict[str, int]] = {}
    for test in tests["tests"]:
        counts = by_file.setdefault(test["test"].split("::")[0], {})
        counts[test["outcome"]] = counts.get(test["outcome"], 0) + 1
    lines += ["| tests/gpu | passed | failed | skipped |", "| --- | ---: | ---: | ---: |"]
    for name, counts in sorted(by_file.items()):
        lines.append(f"| {name} | {counts.get('passed', 0)} | {counts.get('failed', 0) + counts.get('error', 0)} "
                     f"| {counts.get('skipped', 0)} |")
    if tests["timed_out"]:
        lines.append(f"| (stopped after {tests['seconds']:g} s) | | | |")
    lines += [""] + [f"- failed: `{t['test']}`: {t['detail'].splitlines()[0] if t['detail'] else ''}"
                     for t in tests["tests"] if t["outcome"] in ("failed", "error")]
    nccl = results.get("nccl_two_ranks_one_gpu")
    lines += [f"NCCL with two ranks on one GPU: **{nccl['outcome'] if nccl else 'not attempted'}**"
              + (f" ({nccl['detail']})" if nccl and nccl.get("detail") else ""), ""]
    figures = results["benchmark"].get("figures")
    if figures is None:
        lines.append("Benchmark: no figures (" + ("stopped at its time limit" if results["benchmark"]["timed_out"]
                                                  else f"exit code {results['benchmark']['exit_code']}") + ").")
        return "\n".join(lines) + "\n"
    model = figures["model"]
    lines += [f"Step time on one GPU, GPT {model['layers']} x {model['dim']} ({model['parameters'] / 1e6:.0f} M "
              f"parameters), {figures['rows']} x {model['sequence']} tokens, bf16 autocast, AdamW; median of "
              f"{figures['steps']} steps:", "",
              "| implementation | step (ms) | / plain torch |", "| --- | ---: | ---: |"]
    base = figures["median_step_s"].get("torch")
    for impl, seconds in figures["median_step_s"].items():
        lines.append(f"| {impl} | {seconds * 1e3:.1f} | {seconds / base:.3f} |" if base else f"| {impl} | "
                     f"{seconds * 1e3:.1f} | |")
    lines += [f"| {impl} | failed: {error} | |" for impl, error in figures.get("errors", {}).items()]
    ratios = ", ".join(f"{k} **{r}**" for k, r in figures["ratios"].items() if r is not None)
    trace = _render_shared_trace(results.get("shared_trace"))
    return "\n".join(lines + ["", f"Ratios: {ratios}.", ""] + trace) + "\n"


def results_path(date: str, gpu: str) -> Path:
    return RESULTS / f"gpu-check-{date}-{re.sub(r'[^A-Za-z0-9]+', '-', gpu).strip('-')}.json"


def commit() -> str | None:
    code, out = run_limited(["git", "rev-parse", "--short", "HEAD"], 10)
    return out.strip() if code == 0 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--render", type=Path, help="print RESULTS.md's Markdown from this results file, run nothing")
    args = parser.parse_args(argv)
    if args.render is not None:
        print(render(json.loads(args.render.read_text())), end="")
        return 0
    lacking = missing()
    if lacking:
        print(missing_message(lacking), file=sys.stderr)
        return MISSING_EXIT
    import torch
    if not torch.cuda.is_available():
        print(NO_GPU)
        return 0
    started = time.monotonic()
    now = datetime.datetime.now(datetime.timezone.utc)
    gpu = torch.cuda.get_device_name(0)
    with tempfile.TemporaryDirectory(prefix="psrt-gpu-check-") as workdir:
        print(f"gpu-check: {gpu}; pytest tests/gpu (at most {TESTS_LIMIT_S:g} s)", flush=True)
        tests = run_tests(Path(workdir))
        limit = max(60.0, min(BENCHMARK_LIMIT_S, 470.0 - (time.monotonic() - started)))
        print(f"gpu-check: benchmarks/gpu.py (at most {limit:g} s)", flush=True)
        benchmark = run_benchmark(Path(workdir), limit)
        left = 540.0 - (time.monotonic() - started)
        shared_trace = run_shared_trace(Path(workdir), left) if left > 30 else None
    properties = tests.pop("properties")
    nccl = {"outcome": properties["nccl_two_ranks_one_gpu"],
            "detail": properties.get("nccl_two_ranks_one_gpu_detail", "")} \
        if "nccl_two_ranks_one_gpu" in properties else None
    results = {"date": now.strftime("%Y-%m-%d"), "time": now.isoformat(timespec="seconds"),
               "hostname": socket.gethostname(), "gpu": gpu, "gpus": torch.cuda.device_count(),
               "commit": commit(), "versions": versions(), "tests": tests, "nccl_two_ranks_one_gpu": nccl,
               "benchmark": benchmark, "shared_trace": shared_trace, "seconds": round(time.monotonic() - started, 1)}
    path = results_path(results["date"], gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(render(results))
    bad = [t["test"] for t in tests["tests"] if t["outcome"] in ("failed", "error")]
    print(f"gpu-check: wrote {path.relative_to(REPO)} after {results['seconds']:g} s; "
          f"{len(bad)} failed test(s), benchmark {'ok' if benchmark['figures'] else 'missing'}")
    if bad or tests["timed_out"] or tests["exit_code"] not in (0, 5):
        print(tests["output_tail"][-3000:])
    if benchmark["figures"] is None:
        print(benchmark["output_tail"][-3000:])
    return 0 if not bad and not tests["timed_out"] and tests["exit_code"] in (0, 5) and benchmark["figures"] else 1


if __name__ == "__main__":
    sys.exit(main())
