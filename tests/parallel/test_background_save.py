"""Background saves across processes: on 2 ranks an elastic commit and a ZeRO save written in
the background are the synchronous ones (and the ZeRO save one process's state), and a
failure on one rank fails the save on both (scripts/background_save_check.py, in the 2-rank
job server); a background commit SIGKILLed at every stage of its write leaves what a
relaunch resumes from exactly: the previous commit, or the new one once its record is
renamed into place (scripts/background_save_kill.py: one process per stage, all at once,
then one relaunch that resumes each)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, SCRIPTS
from jobs import job_env

pytestmark = pytest.mark.parallel

CHECKS = ["elastic/background_commit_is_the_synchronous_one",
          "zero/background_save_is_the_synchronous_one_and_one_process",
          "errors/a_commit_that_fails_on_rank_1_fails_on_every_rank",
          "errors/a_zero_save_that_failed_unseen_is_raised_at_the_next_save"]
KILL_SCRIPT = str(SCRIPTS / "background_save_kill.py")
#: The stages (scripts/background_save_kill.py's), the commit a relaunch resumes from after a
#: kill there, and what the kill left in the directory that proves where it struck.
STAGES = {
    "staging": (1, {"commit-000002"}, {"commit-000002/replicated.pt.tmp"}),
    "writing_a_file": (1, {"commit-000002/replicated.pt.tmp"}, {"commit-000002/replicated.pt"}),
    "files_written": (1, {"commit-000002/replicated.pt", "commit-000002/rank-00000.pt"}, {"latest.json.tmp"}),
    "writing_the_record": (1, {"latest.json.tmp", "commit-000002/rank-00000.pt"}, set()),
    "record_written": (2, {"commit-000001", "commit-000002/rank-00000.pt"}, {"latest.json.tmp"}),
}


@pytest.fixture(scope="module")
def job(tmp_path_factory, parallel_jobs):
    return parallel_jobs.get("background_save_check.py", 2, args=(str(tmp_path_factory.mktemp("background")),))


@pytest.mark.parametrize("check", CHECKS)
def test_background_saves_on_two_ranks(job, check):
    job.assert_ok(check)


def test_the_background_save_job_ran_every_check(job):
    job.assert_complete(CHECKS)


def test_a_background_commit_killed_at_every_stage_of_its_write_resumes_exactly(tmp_path):
    directories = {stage: tmp_path / stage for stage in STAGES}
    writers = {stage: subprocess.Popen([sys.executable, KILL_SCRIPT, "write", stage], cwd=REPO,
                                       env=job_env({"PSRT_ELASTIC_DIR": str(directory)}), stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)
               for stage, directory in directories.items()}
    for stage, writer in writers.items():
        output = writer.communicate(timeout=120)[0]
        assert writer.returncode == -9, f"{stage}: exited with {writer.returncode}, not SIGKILL\n{output[-3000:]}"
    relaunch = subprocess.run([sys.executable, KILL_SCRIPT, "verify", *map(str, directories.values())], cwd=REPO,
                              env=job_env(), capture_output=True, text=True, timeout=120, check=False)
    assert relaunch.returncode == 0, relaunch.stdout[-2000:] + relaunch.stderr[-3000:]
    resumed = [json.loads(line) for line in relaunch.stdout.splitlines() if line.startswith("{")]
    assert [r["directory"] for r in resumed] == [str(d) for d in directories.values()], relaunch.stdout
    for (stage, (commit, left, absent)), got in zip(STAGES.items(), resumed):
        assert left <= set(got["left"]) and not absent & set(got["left"]), f"{stage}: the kill left {got['left']}"
        assert got["restored_from"] == commit and got["step"] == {1: 2, 2: 3}[commit], f"{stage}: {got}"
        assert not got["differ"], f"{stage}: resumed commit {commit} with {got['differ']} differing"
        assert got["next_commit"] == commit + 1, f"{stage}: the relaunch's own commit: {got}"
