"""The parts of ``make gpu-check`` (tests/gpu/check.py) that run without a GPU: the exit on a
machine without one, reading the JUnit report, the RESULTS.md table from a results file; and
how psrt.comm.staged tells ranks that share a GPU."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from psrt.comm.staged import shares_a_device

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tests" / "gpu" / "check.py")
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.gpu.test_nccl_shared_gpu" name="test_attempted" time="4.2">
 <properties><property name="nccl_two_ranks_one_gpu" value="refused"/></properties></testcase>
<testcase classname="tests.gpu.test_shared_gpu" name="test_match[2-dp]" time="9.0">
 <failure message="dp/distributed_optimizer_matches_one_process: parameter out.bias">trace</failure></testcase>
<testcase classname="" name="tests.gpu.test_hf_cuda" time="0"><skipped message="no CUDA device"/></testcase>
</testsuite></testsuites>"""


def sample_results(figures: dict | None) -> dict:
    return {"date": "2026-01-02", "hostname": "gpu-box", "gpu": "NVIDIA H100 80GB HBM3", "commit": "abc1234",
            "versions": {"torch": "2.11.0", "cuda": "13.0", "nccl": "2.28.9", "cupy": "14.2.0",
                         "mpi4py": "4.1.2", "mpi": "Open MPI v4.1.6"},
            "tests": {"timed_out": False, "seconds": 200.0, "exit_code": 1, "tests": [
                {"test": "tests.gpu.test_shared_gpu::test_match[2-dp]", "outcome": "failed", "seconds": 9.0,
                 "detail": "dp: parameter out.bias\nmore"},
                {"test": "tests.gpu.test_shared_gpu::test_match[2-zero]", "outcome": "passed", "seconds": 1.0,
                 "detail": ""},
                {"test": "tests.gpu.test_hf_cuda", "outcome": "skipped", "seconds": 0.0, "detail": "no CUDA"}]},
            "nccl_two_ranks_one_gpu": {"outcome": "refused", "detail": "NCCL_ERROR_INVALID_USAGE"},
            "benchmark": {"exit_code": 0 if figures else 1, "timed_out": False, "figures": figures}}


FIGURES = {"model": {"layers": 12, "dim": 768, "parameters": 163_000_000, "sequence": 1024}, "rows": 8,
           "steps": 15, "median_step_s": {"torch": 0.1, "hvd": 0.102, "zero3": 0.12, "fsdp2": 0.11},
           "errors": {}, "ratios": {"hvd/torch": 1.02, "zero3/torch": 1.2, "zero3/fsdp2": 1.091,
                                    "fsdp2/torch": 1.1}}


def test_without_a_gpu_it_says_so_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert check.main([]) == 0
    assert capsys.readouterr().out.strip() == check.NO_GPU


def test_a_python_without_torch_is_named_with_what_it_lacks_and_the_fix():
    """``python -S``: no site-packages, so no torch, numpy or mpi4py, as on a GPU machine whose
    ``python3`` is the system's bare one."""
    done = subprocess.run([sys.executable, "-S", str(ROOT / "tests" / "gpu" / "check.py")], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == check.MISSING_EXIT and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"gpu-check: {sys.executable} (Python ") and done.stdout == ""
    assert "cannot import torch, numpy, mpi4py" in done.stderr and "make gpu-check PYTHON=" in done.stderr


def test_only_what_is_missing_is_named(monkeypatch):
    monkeypatch.setattr(check.importlib.util, "find_spec", lambda name: None if name == "mpi4py" else object())
    assert check.missing() == ["mpi4py"]
    assert "cannot import mpi4py; install it (/usr/bin/python3 -m pip install mpi4py;" in check.missing_message(["mpi4py"], "/usr/bin/python3")


def test_junit_report_gives_each_outcome_and_the_recorded_nccl_attempt(tmp_path):
    (tmp_path / "junit.xml").write_text(JUNIT)
    tests, properties = check.read_junit(tmp_path / "junit.xml")
    assert [t["outcome"] for t in tests] == ["passed", "failed", "skipped"]
    assert tests[1]["test"] == "tests.gpu.test_shared_gpu::test_match[2-dp]"
    assert tests[2]["test"] == "tests.gpu.test_hf_cuda"
    assert "out.bias" in tests[1]["detail"]
    assert properties == {"nccl_two_ranks_one_gpu": "refused"}


def test_results_table_has_counts_failures_nccl_outcome_and_ratios():
    text = check.render(sample_results(FIGURES))
    assert text.startswith("### GPU check (2026-01-02, NVIDIA H100 80GB HBM3)")
    assert "NCCL 2.28.9" in text and "`make gpu-check` at abc1234" in text
    assert "| tests.gpu.test_shared_gpu | 1 | 1 | 0 |" in text
    assert "| tests.gpu.test_hf_cuda | 0 | 0 | 1 |" in text
    assert "- failed: `tests.gpu.test_shared_gpu::test_match[2-dp]`: dp: parameter out.bias" in text
    assert "NCCL with two ranks on one GPU: **refused** (NCCL_ERROR_INVALID_USAGE)" in text
    assert "| zero3 | 120.0 | 1.200 |" in text and "zero3/fsdp2 **1.091**" in text


def test_results_table_says_why_the_benchmark_has_no_figures():
    assert "Benchmark: no figures (exit code 1)." in check.render(sample_results(None))


def test_render_option_prints_the_table_of_a_results_file(tmp_path, capsys):
    path = tmp_path / "gpu-check.json"
    path.write_text(json.dumps(sample_results(FIGURES)))
    assert check.main(["--render", str(path)]) == 0
    assert capsys.readouterr().out == check.render(sample_results(FIGURES))


def test_results_file_is_named_by_date_and_gpu():
    path = check.results_path("2026-01-02", "NVIDIA H100 80GB HBM3")
    assert path == ROOT / "benchmarks" / "results" / "gpu-check-2026-01-02-NVIDIA-H100-80GB-HBM3.json"


@pytest.mark.parametrize("identities,shared", [
    ([("a", "GPU-1"), ("a", "GPU-2")], False),
    ([("a", "GPU-1"), ("a", "GPU-1")], True),
    ([("a", "GPU-1"), ("b", "GPU-1")], False),  # two hosts' device 0: distinct devices
    ([("a", "GPU-1")], False),
])
def test_ranks_share_a_device_only_when_two_name_the_same_one(identities, shared):
    assert shares_a_device(identities) is shared


def test_the_shared_gpu_trace_summary_measures_overlap_with_compute_kernels():
    """benchmarks/gpu_shared_trace.py's arithmetic on a hand-made trace: a copy on psrt's stream
    half under a kernel of the compute stream, an engine range wholly under one."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from gpu_shared_trace import summarise

    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 100, "args": {"stream": 7}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 50, "dur": 100, "args": {"stream": 20}},
        {"ph": "X", "cat": "kernel", "name": "mul", "ts": 160, "dur": 10, "args": {"stream": 20}},
        {"ph": "X", "cat": "user_annotation", "name": "psrt.allreduce", "ts": 10, "dur": 20},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep", "ts": 0, "dur": 500},
    ]}
    summary = summarise(trace)
    assert summary["copies_ms"] == 0.1 and summary["copies_under_compute_ms"] == 0.05
    assert summary["exchanges_ms"] == 0.02 and summary["exchanges_under_compute_ms"] == 0.02
    assert summary["compute_kernels_ms"] == 0.1 and summary["copy_streams"] == [20]
