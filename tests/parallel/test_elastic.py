"""Elastic training end to end under psrun: a rank killed at a random step, inside a commit,
a host added by the discovery script, too few hosts.

Every job is ``scripts/elastic_job.py``.  The references are the same computation without
the fault: an uninterrupted run at the same size (bit-identical losses and parameters), an
uninterrupted run resumed from the very commit the relaunch used (bit-identical), and one
process (equal within float tolerance: a kept global batch makes every size take the same
samples per step, so only the summation order differs).
"""
from __future__ import annotations

import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from jobs import REPO, job_env, psrun_argv, start_job
from listener_checks import assert_only_the_noted_launcher_listens
from psrt.elastic.commits import REPLICATED, CommitStore

pytestmark = pytest.mark.parallel

SCRIPT = str(REPO / "tests" / "parallel" / "scripts" / "elastic_job.py")
JOB_TIMEOUT_S = 240
STEPS = 12
GPT_STEPS = 8  # the TP x PP job's steps are the slow ones
COMMIT_EVERY = 4


def slot_groups(tmp_path: Path, count: int) -> str:
    """A hostfile of ``count`` one-slot groups of this machine: losing one is losing a host."""
    path = tmp_path / f"hosts{count}"
    path.write_text("localhost:1\n" * count)
    return str(path)


def run_psrun(flags: list[str], script_args: list[str], timeout_s: float = JOB_TIMEOUT_S
              ) -> subprocess.CompletedProcess[str]:
    steps = GPT_STEPS if "tppp" in script_args else STEPS
    argv = psrun_argv(*flags, sys.executable, SCRIPT, "--steps", str(steps), "--commit-every", str(COMMIT_EVERY),
                      *script_args)
    return subprocess.run(argv, cwd=REPO, env=job_env(), capture_output=True, text=True, errors="replace",
                          timeout=timeout_s, check=False)


def train(tmp_path: Path, name: str, flags: list[str], script_args: list[str] = ()) -> tuple[dict, str]:
    """Run a job to completion; returns what rank 0 saved and the job's whole output."""
    out = tmp_path / f"{name}.pt"
    done = run_psrun(flags, ["--out", str(out), *script_args])
    output = f"{done.stdout}\n{done.stderr}"
    assert done.returncode == 0 and out.exists(), f"{name}: psrun exited with {done.returncode}\n{output[-4000:]}"
    assert_only_the_noted_launcher_listens(output)
    return torch.load(out), output


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The same training in one process, without psrt's launcher; dp and ps train alike
    (SGD with momentum), zero2 with Adam."""
    made: dict[str, dict] = {}

    def get(mode: str) -> dict:
        optimizer = "adam" if mode == "zero2" else "sgd"
        if optimizer not in made:
            out = tmp_path_factory.mktemp("one-process") / f"{optimizer}.pt"
            subprocess.run([sys.executable, SCRIPT, "--optimizer", optimizer, "--steps", str(STEPS), "--out", str(out)],
                           cwd=REPO, env=job_env(), capture_output=True, timeout=JOB_TIMEOUT_S, check=True)
            made[optimizer] = torch.load(out)
        return made[optimizer]

    return get


def assert_identical(run: dict, reference: dict, what: str) -> None:
    assert run["losses"] == reference["losses"], f"{what}: losses differ\n{run['losses']}\n{reference['losses']}"
    for name, value in reference["model"].items():
        assert torch.equal(run["model"][name], value), f"{what}: parameter {name} differs"


def assert_close(run: dict, reference: dict, what: str) -> None:
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(reference["losses"]), atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"{what}: losses\n{m}")
    for name, value in reference["model"].items():
        torch.testing.assert_close(run["model"][name], value, atol=1e-5, rtol=1e-5, msg=lambda m: f"{what}: {name}\n{m}")


def kill_step(after: int = COMMIT_EVERY, steps: int = STEPS) -> int:
    """A random step past ``after`` that is not a commit boundary, printed so a failure can be replayed."""
    step = random.choice([s for s in range(after + 1, steps) if s % COMMIT_EVERY])
    print(f"killing a rank after step {step}")
    return step


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Uninterrupted 2-rank runs, one per mode, made on first use."""
    made: dict[str, dict] = {}

    def get(mode: str) -> dict:
        if mode not in made:
            np = 2
            servers = ["--num-servers", "1"] if mode == "ps" else []
            temporary = set(Path(tempfile.gettempdir()).glob("psrt-elastic-*"))
            made[mode], _ = train(tmp_path_factory.mktemp(f"uninterrupted-{mode}"), mode,
                                  ["-np", str(np), "--min-np", str(np), *servers], ["--mode", mode])
            # psrun made a temporary commit directory for the job, and removed it once it succeeded
            assert set(Path(tempfile.gettempdir()).glob("psrt-elastic-*")) <= temporary
        return made[mode]

    return get


@pytest.mark.parametrize("mode", ["zero2", "ps"])
def test_same_size_resume_after_a_killed_rank_is_bit_identical(tmp_path, uninterrupted, mode):
    """A spare slot group keeps the size: the relaunch must reproduce the uninterrupted run exactly
    (the parameter-server job is one server and one worker, which is killed).  TP x PP jobs are
    covered by a killed TP rank's exact resume (test_tp_dropout_resumes_exactly_after_a_killed_rank)
    and a TP2 x PP2 commit restored on other grids (test_tp_pp_commit_restores_on_another_grid_...),
    which the 15-minute suite keeps instead of a third 4-rank relaunch."""
    np = 2
    servers = ["--num-servers", "1"] if mode == "ps" else []
    step = kill_step(steps=STEPS)
    run, output = train(tmp_path, "killed", ["--hostfile", slot_groups(tmp_path, np + 1), "--min-np", str(np),
                                             "--max-np", str(np), "--restarts", "1", *servers],
                        ["--mode", mode, "--kill-step", str(step), "--kill-rank", "0" if mode == "ps" else "1"])
    assert "killed by signal 9" in output and f"launch 2: {np} ranks" in output, output[-3000:]
    assert f"resumed from commit {step // COMMIT_EVERY}" in output, output[-3000:]
    assert_identical(run, uninterrupted(mode), f"{mode}, killed after step {step}, resumed at the same size")


@pytest.mark.parametrize("mode", ["dp", "zero2", "ps"])
def test_lost_rank_shrinks_the_job_and_it_matches_a_run_resumed_from_the_same_commit(tmp_path, one_process, mode):
    """3 ranks (PS: a server and 2 workers) lose one; the job finishes on 2, exactly as a fresh
    2-rank job started from the commit the relaunch used, and as one process within tolerance."""
    servers = ["--num-servers", "1"] if mode == "ps" else []
    kept = tmp_path / "resumed-from"
    kept.mkdir()
    step = kill_step()
    run, output = train(tmp_path, "shrunk", ["--hostfile", slot_groups(tmp_path, 3), "--min-np", "2",
                                             "--restarts", "1", *servers],
                        ["--mode", mode, "--kill-step", str(step), "--kill-rank", "1", "--keep-resumed", str(kept)])
    assert "failed first: killed by signal 9 (SIGKILL); dropped slot group localhost:1" in output, output[-3000:]
    assert "launch 2: 2 ranks" in output and run["size"] == (1 if mode == "ps" else 2), output[-3000:]
    reference, _ = train(tmp_path, "reference", ["-np", "2", "--elastic-dir", str(kept), *servers], ["--mode", mode])
    assert (kept / "latest.json").exists()  # a directory the user named is theirs to keep
    assert_identical(run, reference, f"{mode}: shrunk after step {step} vs resumed from the same commit")
    assert_close(run, one_process(mode), f"{mode}: shrunk job vs one process")


def test_dp_resume_is_bit_identical_after_a_kill_inside_a_commit_and_one_between(tmp_path, uninterrupted):
    """Launch 1 loses a rank inside commit 2 (its file written, the commit not published): the
    relaunch resumes from commit 1.  Launch 2 loses one at a random step: launch 3 resumes from
    the last commit.  Each relaunch keeps 2 ranks, so the run must equal the uninterrupted one."""
    step = kill_step(after=2 * COMMIT_EVERY)
    run, output = train(tmp_path, "killed-twice", ["--hostfile", slot_groups(tmp_path, 4), "--min-np", "2",
                                                   "--max-np", "2", "--restarts", "2"],
                        ["--kill-in-commit", "2", "--kill-step", str(step), "--kill-step-launch", "2"])
    assert output.count("killed by signal 9 (SIGKILL); dropped slot group") == 2, output[-3000:]
    assert "launch 2: 2 ranks from step 4 (resumed from commit 1)" in output, output[-3000:]
    assert f"launch 3: 2 ranks from step {step // COMMIT_EVERY * COMMIT_EVERY} (resumed from commit " \
           f"{step // COMMIT_EVERY})" in output, output[-3000:]
    assert_identical(run, uninterrupted("dp"), f"killed inside commit 2, then after step {step}")


def test_discovery_adding_a_host_grows_the_job_at_the_next_commit(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\nlocalhost:1\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    out = tmp_path / "grown.pt"
    job = start_job(psrun_argv("--host-discovery-script", str(script), "--min-np", "2", "--max-np", "3",
                               sys.executable, SCRIPT, "--steps", "40", "--commit-every", str(COMMIT_EVERY),
                               "--step-sleep", "0.1", "--out", str(out)), "growing job")
    try:
        job.wait_for_line(r"launch 1: 2 ranks", timeout_s=60)
        hosts.write_text("localhost:1\nlocalhost:1\nlocalhost:1\n")
        assert job.finish(JOB_TIMEOUT_S) == 0, job.diagnosis()
    finally:
        job.stop()
    relaunch = next(line for line in job.out.splitlines() if line.startswith("launch 2:"))
    assert relaunch.startswith("launch 2: 3 ranks from step "), job.diagnosis()
    step, commit = int(relaunch.split()[6]), int(relaunch.split()[-1].rstrip(")"))
    assert step == commit * COMMIT_EVERY and 0 < step < 40, relaunch  # grew at a commit boundary
    assert "hosts changed to localhost:1, localhost:1, localhost:1" in job.err, job.diagnosis()
    assert "(relaunch: the hosts changed)" in job.err, job.diagnosis()
    grown = torch.load(out)
    reference = tmp_path / "single.pt"
    subprocess.run([sys.executable, SCRIPT, "--steps", "40", "--out", str(reference)], cwd=REPO, env=job_env(),
                   capture_output=True, timeout=JOB_TIMEOUT_S, check=True)
    assert_close(grown, torch.load(reference), "grown from 2 to 3 ranks vs one process")


def test_too_few_hosts_fails_clearly_after_the_wait(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:1\n")
    script.chmod(0o755)
    start = time.monotonic()
    done = run_psrun(["--host-discovery-script", str(script), "--min-np", "2", "--elastic-timeout", "2"],
                     ["--out", str(tmp_path / "never.pt")], timeout_s=60)
    waited = time.monotonic() - start
    assert done.returncode != 0 and waited >= 2, (done.returncode, waited)
    assert "1 usable slot(s) (localhost:1), fewer than --min-np 2 after waiting 2 s (--elastic-timeout)" in done.stderr
    assert "launch 1" not in done.stderr and not (tmp_path / "never.pt").exists()


@pytest.mark.parametrize("flags, message", [
    (["--min-np", "3", "--max-np", "2"], "need 1 <= min-np <= max-np"),
    (["-np", "5", "--min-np", "2", "--max-np", "4"], "-np 5 lies outside --min-np 2 .. --max-np 4"),
    (["--min-np", "2", "--num-servers", "2"], "--num-servers 2 leaves no worker at --min-np 2"),
    (["--host-discovery-script", "x", "-H", "a:1"], "replaces -H and --hostfile"),
])
def test_impossible_elastic_flags_are_refused_before_launching(flags, message):
    done = subprocess.run(psrun_argv(*flags, sys.executable, "-c", "pass"), cwd=REPO, env=job_env(),
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_a_directory_that_lost_latest_json_is_refused_and_its_commit_kept(tmp_path):
    """A finished job's directory whose latest.json was deleted: the relaunch must neither train
    from scratch nor remove the commit, and psrun stops once the same restore failure repeats
    instead of using every --restarts."""
    directory = tmp_path / "job"
    train(tmp_path, "first", ["-np", "2", "--elastic-dir", str(directory)])
    kept = sorted(path.name for path in directory.glob("commit-*"))
    assert kept == [f"commit-{STEPS // COMMIT_EVERY:06d}"], kept
    (directory / "latest.json").unlink()
    done = run_psrun(["-np", "2", "--elastic-dir", str(directory), "--restarts", "3"],
                     ["--out", str(tmp_path / "second.pt")])
    assert done.returncode != 0 and not (tmp_path / "second.pt").exists(), done.stdout[-2000:]
    assert f"{directory} holds commit directories {kept[0]} but no latest.json" in done.stderr, done.stderr[-3000:]
    assert "giving up: launches 1 and 2 could not restore the last commit" in done.stderr, done.stderr[-3000:]
    assert "launch 3:" not in done.stderr
    assert sorted(path.name for path in directory.glob("commit-*")) == kept


def test_tp_pp_commit_restores_on_another_grid_and_matches_one_process(tmp_path):
    """A TP 2 x PP 2 job on 4 ranks commits the tiny GPT as each (TP, PP) coordinate's own
    blocks (never gathered); relaunches on 2 ranks as TP 2 x PP 1 and as a plain data-parallel
    model without a grid (TP 1, PP 1) each read the slices they need, continue from
    that commit, and match one process training all the steps (in double precision, as
    tests/parallel/scripts/gpt_check.py compares layouts: in single precision AdamW turns the
    rounding of nearly-zero gradients, such as the key bias's, into whole steps).  A TP size
    changed with the PP size kept is restored inside tests/parallel/scripts/gpt_check.py."""
    first = tmp_path / "tppp"
    train(tmp_path, "tp2pp2", ["-np", "4", "--elastic-dir", str(first)], ["--mode", "tppp", "--float64"])
    (commit,) = first.glob("commit-*")
    assert sorted(path.name for path in commit.glob("model-*.pt")) == [
        f"model-pp{pp:03d}-tp{tp:03d}-ep000.pt" for pp in range(2) for tp in range(2)]
    store = CommitStore(str(first))
    replicated = store.load(store.latest(), REPLICATED)
    assert "shards" in replicated and "full" not in replicated  # nothing gathered whole
    steps = ["--steps", str(GPT_STEPS + COMMIT_EVERY), "--float64"]
    reference = tmp_path / "one-process.pt"
    subprocess.run([sys.executable, SCRIPT, "--mode", "tppp", "--tp", "1", "--pp", "1", *steps, "--out",
                    str(reference)], cwd=REPO, env=job_env(), capture_output=True, timeout=JOB_TIMEOUT_S, check=True)
    want = torch.load(reference)
    for name, layout in (("tp2pp1", ["--tp", "2", "--pp", "1"]), ("no-grid", ["--no-grid"])):
        directory = shutil.copytree(first, tmp_path / name)
        run, output = train(tmp_path, name, ["-np", "2", "--elastic-dir", str(directory)],
                            ["--mode", "tppp", *layout, *steps])
        assert f"2 ranks from step {GPT_STEPS} (resumed from commit {GPT_STEPS // COMMIT_EVERY})" in output, \
            output[-3000:]
        what = f"committed on TP 2 x PP 2, resumed as {name}, vs one process"
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(want["losses"]), rtol=1e-9, atol=1e-12,
                                   msg=lambda m, w=what: f"{w}: losses\n{m}")
        assert sorted(run["model"]) == sorted(want["model"])
        for key, value in want["model"].items():
            torch.testing.assert_close(run["model"][key], value, rtol=1e-9, atol=1e-10,
                                       msg=lambda m, k=key, w=what: f"{w}: {k}\n{m}")


def test_tp_dropout_resumes_exactly_after_a_killed_rank(tmp_path):
    """Dropout in TP regions draws from the TP RNG tracker's per-rank streams: a relaunch must
    restore them from the commit to reproduce the uninterrupted run bit for bit."""
    dropout = ["--mode", "tppp", "--tp", "2", "--pp", "1", "--dropout", "0.2"]
    reference, _ = train(tmp_path, "uninterrupted", ["-np", "2", "--min-np", "2"], dropout)
    step = kill_step(steps=GPT_STEPS)
    run, output = train(tmp_path, "killed", ["--hostfile", slot_groups(tmp_path, 3), "--min-np", "2", "--max-np",
                                             "2", "--restarts", "1"],
                        [*dropout, "--kill-step", str(step), "--kill-rank", "1"])
    assert f"resumed from commit {step // COMMIT_EVERY}" in output, output[-3000:]
    assert_identical(run, reference, f"TP dropout, killed after step {step}, resumed at the same size")
