"""What psrun shows of a job's stderr: everything while it runs, the failing rank's traceback
once when it fails, the rest in a log it names."""
from __future__ import annotations

from pathlib import Path

import pytest

from launcher.failures import FailureScanner
from launcher.stderr_filter import HOLD_S, StderrFilter


def traceback_of(rank: int, message: str) -> list[str]:
    return ["Traceback (most recent call last):\n",
            '  File "/job/train.py", line 12, in <module>\n',
            '    hvd.allreduce(t, name="x")\n',
            '  File "/psrt/engine/work.py", line 178, in result\n',
            "    raise self.error\n",
            f"psrt.errors.CollectiveMismatchError: {message}\n"]


MISMATCH = "allreduce of tensor 'x' was called with mismatched arguments: shape differs"
ABORT_BANNER = ["-" * 74 + "\n", "MPI_ABORT was invoked on rank 0 in communicator MPI_COMM_WORLD\n",
                "  Proc: [[38622,1],0]\n", "  Errorcode: 1\n", "\n",
                "NOTE: invoking MPI_ABORT causes Open MPI to kill all MPI processes.\n", "-" * 74 + "\n",
                "\x00\n"]


class Terminal:
    """A filter, the bytes it showed, and a clock."""

    def __init__(self, tmp_path: Path, labelled: bool = True, verbose: bool = False) -> None:
        self.shown = b""
        self.now = 0.0
        self.view = StderrFilter(FailureScanner(), self._show, verbose=verbose, labelled=labelled,
                                 log_dir=str(tmp_path))

    def _show(self, data: bytes) -> None:
        self.shown += data

    def feed(self, source, text: str) -> None:
        self.view.feed(source, text.encode(), self.now)

    @property
    def text(self) -> str:
        return self.shown.decode()


def test_two_ranks_tracebacks_interleaved_show_once_and_the_rest_goes_to_the_log(tmp_path):
    """The ~60 lines of a shape mismatch on 2 ranks: both ranks' tracebacks, line by line
    interleaved, their markers and Open MPI's banner, with a NUL byte."""
    term = Terminal(tmp_path)
    term.feed(0, "epoch 1 loss 0.5\n")
    for line0, line1 in zip(traceback_of(0, MISMATCH), traceback_of(1, MISMATCH)):
        term.feed(0, line0)
        term.feed(1, line1)
    term.feed(0, f"psrt: rank 0 failed: raised CollectiveMismatchError: {MISMATCH}\n")
    term.feed(1, f"psrt: rank 1 failed: raised CollectiveMismatchError: {MISMATCH}\n")
    for line in ABORT_BANNER:
        term.feed(None, line)
    report = term.view.finish()
    assert term.text == "epoch 1 loss 0.5\n" + "".join(traceback_of(0, MISMATCH))
    assert term.view.scanner.failure.summary().startswith("rank 0 failed first: raised CollectiveMismatchError")
    log = Path(report.log_path).read_text()
    assert report.log_path.startswith(str(tmp_path)) and report.hidden_lines == 10
    assert all(f"[rank 1] {line}" in log for line in traceback_of(1, MISMATCH))  # in arrival order
    assert "[mpirun] MPI_ABORT was invoked on rank 0" in log and "\x00" not in log


def test_tracebacks_after_unfinished_progress_bars_still_show_once(tmp_path):
    """tqdm leaves its bar unfinished, so each traceback's first line lands on the bar's line."""
    term = Terminal(tmp_path)
    for rank in (0, 1):
        term.feed(rank, "\r 20%|##        | 2/10")
    for line0, line1 in zip(traceback_of(0, MISMATCH), traceback_of(1, MISMATCH)):
        term.feed(0, line0)
        term.feed(1, line1)
    term.feed(1, f"psrt: rank 1 failed: raised CollectiveMismatchError: {MISMATCH}\n")
    term.feed(0, f"psrt: rank 0 failed: raised CollectiveMismatchError: {MISMATCH}\n")
    term.view.finish()
    assert term.text.count("Traceback (most recent call last):") == 1, term.text
    assert term.text.endswith("".join(traceback_of(1, MISMATCH)))
    assert term.text.startswith("\r 20%|##        | 2/10\r 20%|##        | 2/10\n")


def test_progress_bars_and_ordinary_lines_flow_live_until_a_failure(tmp_path):
    term = Terminal(tmp_path)
    term.feed(1, "epoch 1:  10%")
    assert term.text == "epoch 1:  10%"  # an unfinished line is shown at once
    term.feed(1, "\repoch 1: 100%\nloss 0.3\n")
    term.feed(None, "\x00\n")  # a line Open MPI left with only a NUL byte
    assert term.text == "epoch 1:  10%\repoch 1: 100%\nloss 0.3\n"
    term.feed(1, "psrt: rank 1 failed: raised ValueError: boom\n")
    term.feed(0, "still printing after the failure\n")
    report = term.view.finish()
    assert "still printing" not in term.text and report.hidden_lines == 1


def test_a_traceback_no_failure_follows_is_shown_after_the_hold(tmp_path):
    """A rank that prints a traceback and goes on (logging.exception) loses nothing."""
    term = Terminal(tmp_path)
    for line in traceback_of(0, "handled"):
        term.feed(0, line)
    term.feed(1, "rank 1 is not held\n")
    assert term.text == "rank 1 is not held\n"
    term.now = HOLD_S
    term.view.tick(term.now)
    assert term.text == "rank 1 is not held\n" + "".join(traceback_of(0, "handled"))
    term.feed(0, "rank 0 goes on\n")
    assert term.text.endswith("rank 0 goes on\n") and term.view.finish().log_path is None


def test_what_is_still_held_when_a_job_succeeds_is_shown(tmp_path):
    term = Terminal(tmp_path)
    for line in ["-" * 74 + "\n", "WARNING: no OpenFabrics device\n"]:
        term.feed(None, line)
    assert term.text == ""  # an open banner waits for its closing rule
    term.feed(0, "Traceback (most recent call last):\nValueError: caught and printed\n")
    term.feed(0, "half a line")
    term.view.finish()
    assert term.text == ("-" * 74 + "\nWARNING: no OpenFabrics device\n"
                         "Traceback (most recent call last):\nValueError: caught and printed\nhalf a line\n")


def test_a_rank_that_exits_shows_its_traceback_once_its_exit_is_known(tmp_path):
    """No psrt hook (plain mpi4py): the launcher's notice names the rank after its traceback."""
    term = Terminal(tmp_path)
    for line in traceback_of(1, "peer lost"):
        term.feed(1, line)
    for line in ["-" * 74 + "\n", "prterun detected that one or more processes exited with non-zero status,\n",
                 "thus causing the job to be terminated. The first process to do so was:\n", "\n",
                 "   Process name: [prterun-vm-2681@1,1]\n", "   Exit code:    1\n", "-" * 74 + "\n"]:
        term.feed(None, line)
    report = term.view.finish()
    assert term.text == "".join(traceback_of(1, "peer lost"))
    assert term.view.scanner.failure.summary() == "rank 1 failed first: exited with code 1"
    assert "[mpirun]    Exit code:    1" in Path(report.log_path).read_text()


def test_merged_output_of_one_failing_rank(tmp_path):
    """Ranks on other hosts: one stream from mpirun; the traceback before the marker shows once."""
    term = Terminal(tmp_path, labelled=False)
    text = "".join(traceback_of(1, "boom")) + "psrt: rank 1 failed: raised ValueError: boom\n" + "".join(ABORT_BANNER)
    term.feed(None, text)
    report = term.view.finish()
    assert term.text == "".join(traceback_of(1, "boom"))
    assert Path(report.log_path).read_text().startswith("Traceback (most recent call last):\n")


def test_verbose_shows_everything_as_it_comes(tmp_path):
    term = Terminal(tmp_path, verbose=True)
    text = "".join(traceback_of(1, "boom")) + "psrt: rank 1 failed: raised ValueError: boom\n" + "".join(ABORT_BANNER)
    term.feed(1, text)
    assert term.view.finish().log_path is None
    assert term.text == text.replace("\x00", "")


@pytest.mark.parametrize("cut", [1, 7, 40])
def test_chunks_cut_anywhere_show_the_same(tmp_path, cut):
    whole = "a\nprogress 1%\rprogress 99%\nb\n"
    term = Terminal(tmp_path)
    data = whole.encode()
    for start in range(0, len(data), cut):
        term.view.feed(0, data[start:start + cut], 0.0)
    term.view.finish()
    assert term.text == whole
