"""``psrt timeline-summary`` on hand-made timelines: known phases give exact totals, shares and
per-tensor figures; a file cut short is read up to its last whole event; a file that is
not a psrt timeline is refused by name; the command's output and exit codes."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from psrt import cli
from psrt.timeline_summary import TimelineError, summarize

HEADER = '{"displayTimeUnit": "ms", "traceEvents": [\n'
PHASE_NAMES = {"negotiate": "NEGOTIATE", "wait": "WAIT_FOR_OTHER_RANKS", "queue": "QUEUE",
               "copy_in": "MEMCPY_IN_FUSION_BUFFER", "copy_out": "MEMCPY_OUT_FUSION_BUFFER"}


def _operation(tid: int, tensor: str, phases: list[tuple[str, float, float]]) -> list[dict]:
    """One operation's events as the engine writes them (µs); a phase not in PHASE_NAMES is the collective."""
    return [{"name": PHASE_NAMES.get(phase, phase), "ph": "X", "pid": 0, "tid": tid, "ts": start,
             "dur": end - start, "args": {"tensor": tensor}} for phase, start, end in phases]


def _events() -> list[dict]:
    """Two steps.  Step 0 (0-1000 µs): tensor a, then b, which waits in the queue behind a's
    allreduce and is copied through the fusion buffer.  Step 1 (1000-1400 µs): a again.

    Counting each instant once, in the most advanced phase: negotiation 0-100 and 1000-1200,
    waiting 100-150 and 1200-1300, queue 150-200, a's allreduce 200-500, b's copy in 500-520,
    allreduce 520-700, copy out 700-730, no engine work 730-1000, allreduce 1300-1400."""
    meta = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "psrt rank 0"}},
            {"name": "CYCLE_START", "ph": "i", "s": "g", "pid": 0, "tid": 0, "ts": 10},
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": "a"}},
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": 2, "args": {"name": "b"}},
            {"name": "CYCLE_START", "ph": "i", "s": "g", "pid": 0, "tid": 0, "ts": 160}]
    a0 = _operation(1, "a", [("negotiate", 0, 100), ("wait", 100, 150), ("queue", 150, 200),
                             ("ALLREDUCE", 200, 500)])
    b0 = _operation(2, "b", [("negotiate", 50, 150), ("wait", 150, 150), ("queue", 150, 500),
                             ("copy_in", 500, 520), ("ALLREDUCE", 520, 700), ("copy_out", 700, 730)])
    cycle = [{"name": "CYCLE_START", "ph": "i", "s": "g", "pid": 0, "tid": 0, "ts": 1010}]
    a1 = _operation(1, "a", [("negotiate", 1000, 1200), ("wait", 1200, 1300), ("queue", 1300, 1300),
                             ("ALLREDUCE", 1300, 1400)])
    return meta + a0 + b0 + cycle + a1


def _write(path, events: list[dict], closed: bool = True) -> str:
    """Events in the timeline's own layout: one per line, the array closed by stop_timeline."""
    path.write_text(HEADER + ",\n".join(json.dumps(e) for e in events) + ("\n]}\n" if closed else ""))
    return str(path)


def test_known_phases_give_exact_totals_and_shares(tmp_path):
    s = summarize(_write(tmp_path / "t.json", _events()))
    assert not s.truncated and s.rank == 0
    assert s.step_starts == [0, 1000] and s.step_walls == [1000, 400] and s.wall == 1400
    assert s.step_ops == [2, 1] and s.step_cycles == [2, 1]
    assert s.steps[0] == {"negotiate": 100, "wait": 50, "queue": 50, "copy_in": 20, "collective": 480,
                          "copy_out": 30, "outside": 270}
    assert s.steps[1] == {"negotiate": 200, "wait": 100, "queue": 0, "copy_in": 0, "collective": 100,
                          "copy_out": 0, "outside": 0}
    assert s.total == {"negotiate": 300, "wait": 150, "queue": 50, "copy_in": 20, "collective": 580,
                       "copy_out": 30, "outside": 270}
    assert sum(s.total.values()) == s.wall


def test_per_tensor_figures_are_each_tensors_own_phases(tmp_path):
    s = summarize(_write(tmp_path / "t.json", _events()))
    assert s.calls == {"a": 2, "b": 1}
    assert s.collectives == {"a": "ALLREDUCE", "b": "ALLREDUCE"}
    assert s.tensors["a"] == {"negotiate": 300, "wait": 150, "queue": 50, "copy_in": 0, "collective": 400,
                              "copy_out": 0}
    assert s.tensors["b"] == {"negotiate": 100, "wait": 0, "queue": 350, "copy_in": 20, "collective": 180,
                              "copy_out": 30}


def test_fused_tensors_share_one_collective_in_the_total(tmp_path):
    """Two tensors reduced in one message: each shows the message's time, the total counts it once."""
    meta = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "psrt rank 0"}}]
    fused = [("negotiate", 0, 10), ("wait", 10, 10), ("queue", 10, 10), ("copy_in", 10, 20),
             ("ALLREDUCE", 20, 70), ("copy_out", 70, 80)]
    s = summarize(_write(tmp_path / "t.json", meta + _operation(1, "x", fused) + _operation(2, "y", fused)))
    assert len(s.step_walls) == 1 and s.wall == 80
    assert s.total["collective"] == 50 and s.tensors["x"]["collective"] == s.tensors["y"]["collective"] == 50
    assert s.total == {"negotiate": 10, "wait": 0, "queue": 0, "copy_in": 10, "collective": 50, "copy_out": 10,
                       "outside": 0}


def test_a_file_cut_short_is_read_up_to_its_last_whole_event(tmp_path):
    """A crash leaves the array open, possibly in the middle of an event: here a's second
    allreduce is cut, so that operation keeps only its negotiation, wait and queue."""
    path = tmp_path / "cut.json"
    whole = _write(path, _events(), closed=False)
    text = path.read_text()
    path.write_text(text[:text.rindex('"ALLREDUCE"') + 5])
    s = summarize(whole)
    assert s.truncated
    assert s.calls == {"a": 2, "b": 1} and s.step_walls == [1000, 300]
    assert s.steps[1] == {"negotiate": 200, "wait": 100, "queue": 0, "copy_in": 0, "collective": 0,
                          "copy_out": 0, "outside": 0}


def test_an_unterminated_array_of_events_is_read(tmp_path):
    """Chrome's other layout, a bare array, may also be left open."""
    path = tmp_path / "array.json"
    path.write_text("[\n" + ",\n".join(json.dumps(e) for e in _events()) + ",\n")
    s = summarize(str(path))
    assert s.truncated and s.wall == 1400 and s.total["collective"] == 580


def test_a_timeline_without_collectives_says_so(tmp_path, capsys):
    meta = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "psrt rank 0"}}]
    path = _write(tmp_path / "empty.json", meta, closed=False)
    assert cli.main(["timeline-summary", path]) == 0
    out = capsys.readouterr().out
    assert "cut short" in out and "no collectives recorded" in out


@pytest.mark.parametrize("text, reason", [
    ("", "is empty"),
    ("hello, world\n", "is not a Chrome trace"),
    ('{"model": "resnet"}', "no 'traceEvents' list"),
    ('{"traceEvents": [{"name": "step", "ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 5}]}',
     "not a psrt timeline"),
    (HEADER + '{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "psrt rank 0"}},\n'
     '{"name": "QUEUE", "ph": "X", "pid": 0, "tid": 1, "ts": 0, "dur": 5 oops},\n'
     '{"name": "QUEUE", "ph": "X", "pid": 0, "tid": 1, "ts": 5, "dur": 5}\n', "is not valid JSON"),
    (HEADER + '{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "psrt rank 0"}},\n'
     '{"name": "QUEUE", "ph": "X", "pid": 0, "tid": 1, "ts": "soon", "dur": 5}\n]}', "no numeric 'ts'"),
], ids=["empty", "text", "other-json", "other-trace", "damaged-middle", "bad-timestamp"])
def test_a_file_that_is_not_a_psrt_timeline_is_refused_by_name(tmp_path, text, reason):
    path = tmp_path / "not-a-timeline.json"
    path.write_text(text)
    with pytest.raises(TimelineError, match=reason) as raised:
        summarize(str(path))
    assert str(path) in str(raised.value)


def test_the_command_prints_totals_steps_and_tensors(tmp_path, capsys):
    path = _write(tmp_path / "t.json", _events())
    assert cli.main(["timeline-summary", path]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "2 steps, 2 tensors, 3 operations, 3 engine cycles; wall 1.400 ms" in lines[1]
    assert next(line for line in lines if "negotiation" in line).split()[-2:] == ["0.300", "21.4%"]
    assert next(line for line in lines if "no engine work" in line).split()[-2:] == ["0.270", "19.3%"]
    step0 = next(line for line in lines if line.split()[:2] == ["0", "1.000"]).split()
    assert step0[2:] == ["2", "2", "10.0%", "5.0%", "5.0%", "2.0%", "48.0%", "3.0%", "27.0%"]
    assert next(line for line in lines if line.startswith("  a ")).split() == [
        "a", "2", "ALLREDUCE", "0.300", "0.150", "0.050", "0.000", "0.400", "0.000", "0.900", "64.3%"]


def test_the_command_keeps_to_max_rows(tmp_path, capsys):
    assert cli.main(["timeline-summary", "--max-rows", "1", _write(tmp_path / "t.json", _events())]) == 0
    out = capsys.readouterr().out
    assert "... and 1 more steps" in out and "... and 1 more tensors (0.680 ms)" in out


def test_the_command_fails_with_exit_code_2_naming_the_file(tmp_path, capsys):
    path = tmp_path / "notes.txt"
    path.write_text("not a trace\n")
    assert cli.main(["timeline-summary", str(path)]) == 2
    assert capsys.readouterr().err.strip() == f"psrt: error: {path} is not a Chrome trace: it is neither JSON " \
                                              "nor a trace cut short"
    assert cli.main(["timeline-summary", str(tmp_path / "missing.json")]) == 2
    assert "No such file or directory" in capsys.readouterr().err


def test_the_installed_command_exits_2_on_a_bad_file():
    """The real entry point, as a user runs it (one subprocess: it imports torch)."""
    bad = subprocess.run([sys.executable, "-m", "psrt.cli", "timeline-summary", __file__], check=False,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "is not a Chrome trace" in bad.stderr, bad.stderr
