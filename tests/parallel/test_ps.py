"""Parameter-server mode: training and consistency checks against references with one
server and with two (keys then split in small chunks across both), failures that must
end with a named cause, and a checkpoint resumed by a new job.
"""
from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import SCRIPTS, launch
from faults import run_until_it_ends

from psrt.checkpoint import files as checkpoint_files
from psrt.errors import ParameterServerError

pytestmark = pytest.mark.parallel

CHECKS = [
    "sync/sgd_momentum_matches_allreduce_and_single_process", "sync/adam_matches_allreduce_and_single_process",
    "sync/lr_scheduler_reaches_the_servers", "sync/param_groups_match_allreduce_and_single_process",
    "sync/param_groups_follow_the_lr_scheduler", "async/every_push_applied_exactly_once",
    "async/least_squares_converges", "bounded/holds_the_fast_worker_within_tau_1",
    "bounded/holds_the_fast_worker_within_tau_2", "bounded/tau_0_equals_sync",
    "errors/bad_keys_shapes_and_dtypes", "errors/workers_init_different_shapes",
    "errors/workers_disagree_on_the_mode", "errors/failing_server_update_is_reported",
    "errors/optimizer_settings_conflict_with_its_store", "listeners/only_the_launcher_listens_beyond_loopback",
]
# (ranks, environment): 1 server + 2 workers; 2 servers + 2 workers with 256-byte chunks,
# so every parameter of the test model is split across both servers.
JOBS = [(3, {"PSRT_NUM_SERVERS": "1"}), (4, {"PSRT_NUM_SERVERS": "2", "PSRT_PS_CHUNK_BYTES": "256"})]
JOB_IDS = ["1server", "2servers-small-chunks"]
# Not much shorter: every wait on a server is watched, and a server building its first
# optimizer takes seconds on a loaded 2-core machine.
FAILURE_ENV = {"PSRT_NUM_SERVERS": "1", "PSRT_STALL_CHECK_TIME": "2", "PSRT_STALL_SHUTDOWN_TIME": "10"}


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("np, env", JOBS, ids=JOB_IDS)
def test_ps_check_passes_on_every_worker(parallel_jobs, np, env, check):
    parallel_jobs.get("ps_check.py", np, env).assert_ok(check)


@pytest.mark.parametrize("np, env", JOBS, ids=JOB_IDS)
def test_ps_job_reports_every_check_and_the_servers_exit_cleanly(parallel_jobs, np, env):
    parallel_jobs.get("ps_check.py", np, env).assert_complete(CHECKS)


def _lines(report) -> list[dict]:
    return [json.loads(line) for line in report.stdout.splitlines() if line.startswith('{"worker"')]


def test_a_worker_that_stops_pushing_in_sync_mode_is_named_then_the_job_ends():
    report = launch("ps_failures.py", 3, FAILURE_ENV, args=("stall",), timeout_s=90)
    assert report.returncode not in (0, None), report.diagnosis()
    assert report.seconds < 60, f"the stalled job took {report.seconds:.0f} s to end"
    # Worker 0 reports (it waits on the server, which holds its pull), or, should worker 0's
    # watchdog be late on a loaded machine, the server does: either names the pull and worker 1.
    # Worker 1 headlines the job: it answers, but never pushes.
    summary = report.stderr.strip().splitlines()[-1]
    assert summary.startswith("psrun: rank 1 (worker 1) is to blame: answers but never came"), report.diagnosis()
    everything = report.stderr + report.log
    assert "worker 0's pull of key 'weights'" in everything and "it needs pushes from worker 1" in everything, \
        report.diagnosis()


def test_a_worker_that_shuts_down_early_fails_the_others_sync_step_naming_it():
    report = launch("ps_failures.py", 3, FAILURE_ENV, args=("early_exit",), timeout_s=90)
    assert report.returncode == 0, report.diagnosis()
    (line,) = _lines(report)
    assert line["worker"] == 0 and line["step"] == 2, line
    assert "can never complete: worker 1 shut down without pushing it" in line["error"], line


def test_a_clean_shutdown_loses_no_pushed_update():
    report = launch("ps_failures.py", 3, FAILURE_ENV, args=("flush",), timeout_s=90)
    assert report.returncode == 0, report.diagnosis()
    (line,) = _lines(report)
    assert line["value"] == pytest.approx([-0.3] * 3), "three steps of SGD(lr=0.1) on a mean gradient of 1"


def test_a_save_or_load_by_one_worker_while_another_trains_on_is_a_deadlock_naming_each_worker_and_line():
    """With the default stall times (a stall ends a job only after 600 s), so that only
    deadlock detection can end it before the hang guard."""
    job = run_until_it_ends("ps_failures.py", 4, ("one_sided",), {"PSRT_NUM_SERVERS": "1"}, timeout_s=120)
    assert job.returncode not in (0, None), job.diagnosis()
    lines = {int(m.group(1)): m.group(0) for m in re.finditer(r"psrt: deadlock: rank (\d+) .*", job.stderr)}
    assert sorted(lines) == [0, 1, 2], job.diagnosis()
    site = _marked_lines(SCRIPTS / "ps_failures.py")
    assert lines[0].startswith("psrt: deadlock: rank 0 (worker 0) waits in broadcast_object of tensor 'psrt.ps.save")
    assert f"ps_failures.py:{site['save']} (in one_sided)" in lines[0] and ".save() is collective" in lines[0]
    assert lines[0].endswith("it needs rank 1 (worker 1) and rank 2 (worker 2), blocked elsewhere"), lines[0]
    assert lines[1].startswith("psrt: deadlock: rank 1 (worker 1) waits in worker 1's push and pull of key "), lines[1]
    assert f"ps_failures.py:{site['step']} (in one_sided.<locals>.step)" in lines[1], lines[1]
    assert lines[1].endswith("it waits on rank 3 (parameter server 0), which holds it for rank 0 (worker 0) and "
                             "rank 2 (worker 2), blocked elsewhere"), lines[1]
    assert "broadcast_object of tensor 'psrt.ps.load" in lines[2], lines[2]
    assert f"ps_failures.py:{site['load']} (in one_sided)" in lines[2] and ".load() is collective" in lines[2]
    assert re.search(r"psrun: rank \d failed first: deadlock: ranks 0-2 each wait", job.stderr), job.diagnosis()
    assert not job.left_behind, job.diagnosis()


def _marked_lines(script) -> dict[str, int]:
    """The line of each call marked ``# one-sided: <call>`` in ``script``."""
    return {line.split("# one-sided: ")[1].strip(): number
            for number, line in enumerate(script.read_text().splitlines(), start=1) if "# one-sided: " in line}


def test_a_worker_that_dies_ends_the_job_naming_its_rank():
    report = launch("ps_failures.py", 3, FAILURE_ENV, args=("worker_dies",), timeout_s=90)
    assert report.returncode == 7, report.diagnosis()
    assert report.seconds < 60, f"the job took {report.seconds:.0f} s to end after a worker died"
    assert "psrun: rank 1 failed first: exited with code 7" in report.stderr, report.diagnosis()


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ps-checkpoint")
    for phase in ("first", "second", "refused"):
        report = launch("ps_resume.py", 3, {"PSRT_NUM_SERVERS": "1"}, args=(phase, str(directory)))
        assert report.returncode == 0, report.diagnosis()
    load = lambda name: torch.load(directory / name, weights_only=False)  # noqa: E731
    return directory, load("first.pt"), load("second.pt")


def test_a_restarted_job_resumes_the_parameters_and_step_count_it_saved(resumed):
    _, first, second = resumed
    assert second["steps"] == first["steps"] == 3
    for name, value in first["saved"].items():
        assert torch.equal(second["saved"][name], value), f"{name} differs after load"


def test_resumed_training_continues_exactly_as_the_uninterrupted_run(resumed):
    _, first, second = resumed
    for name, value in first["final"].items():
        assert torch.equal(second["final"][name], value), f"{name} diverged after resuming"


def test_a_checkpoint_of_another_model_or_an_unfinished_save_is_refused(resumed):
    directory, _, _ = resumed
    errors = json.loads((directory / "refused.json").read_text())
    assert errors["no_manifest"] and "manifest.json is missing" in errors["no_manifest"], errors
    other = errors["other_model"] or ""
    assert "different model" in other or "holds chunks" in other, errors


def test_a_checkpoint_saved_right_after_loading_holds_the_same_optimizer_state(resumed):
    directory, _, _ = resumed
    load = lambda sub: checkpoint_files.load_tensors(  # noqa: E731
        str(directory / sub / "server-0-of-1.pt"), None, ParameterServerError)
    saved, again = load("ckpt")["stores"], load("again")["stores"]
    assert saved.keys() == again.keys()
    for store_id, store in saved.items():
        for chunk_id, shard in store["shards"].items():
            other = again[store_id]["shards"][chunk_id]
            assert torch.equal(shard["value"], other["value"]) and shard["applied"] == other["applied"]
            for slot, state in shard["optimizer"]["state"].items():
                for name, tensor in state.items():
                    assert torch.equal(tensor, other["optimizer"]["state"][slot][name]), (chunk_id, name)
