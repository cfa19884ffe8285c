"""Pipeline schedules as values: built schedules pass the checker, match the bubble theory,
hold the expected number of activations, and broken schedules are caught."""
from __future__ import annotations

import pytest

from psrt.errors import InvalidArgumentError, ScheduleError
from psrt.pp.schedule import Action, Op, build, gpipe, interleaved_one_f_one_b, one_f_one_b
from psrt.pp.simulate import bubble_fraction, check, in_flight, makespan, simulate
from psrt.pp.timeline import render

FLAT = [(name, p, m) for name in ("gpipe", "1f1b") for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 5, 8)]
INTERLEAVED = [(p, k * p, v) for p in (1, 2, 3, 4) for k in (1, 2) for v in (2, 3)]


def _comm_per_stage(stage: int, last: int) -> int:
    """Sends and receives a virtual stage does per micro-batch."""
    return 2 * (stage > 0) + 2 * (stage < last)


@pytest.mark.parametrize("name,p,m", FLAT)
def test_flat_schedule_passes_checker_with_theoretical_makespan_and_bubble(name: str, p: int, m: int) -> None:
    schedule = build(name, p, m)
    check(schedule, m)
    events = simulate(schedule)
    assert makespan(events) == 2 * (m + p - 1)
    assert bubble_fraction(events) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p,m,v", INTERLEAVED)
def test_interleaved_passes_checker_and_divides_bubble_by_chunks(p: int, m: int, v: int) -> None:
    schedule = build("interleaved", p, m, v)
    check(schedule, m, v)
    events = simulate(schedule, chunks=v)
    assert makespan(events) == pytest.approx(2 * (m + (p - 1) / v))
    assert bubble_fraction(events) == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize("name,p,m", FLAT)
def test_flat_schedule_has_expected_length_per_rank(name: str, p: int, m: int) -> None:
    schedule = build(name, p, m)
    assert [len(actions) for actions in schedule] == [m * (2 + _comm_per_stage(r, p - 1)) for r in range(p)]


@pytest.mark.parametrize("p,m,v", INTERLEAVED)
def test_interleaved_has_expected_length_per_rank(p: int, m: int, v: int) -> None:
    schedule = interleaved_one_f_one_b(p, m, v)
    expected = [sum(m * (2 + _comm_per_stage(c * p + r, p * v - 1)) for c in range(v)) for r in range(p)]
    assert [len(actions) for actions in schedule] == expected


@pytest.mark.parametrize("p", (1, 2, 3, 4))
@pytest.mark.parametrize("m", (1, 2, 3, 4, 5, 8))
def test_gpipe_holds_all_m_microbatches_on_every_rank(p: int, m: int) -> None:
    assert [in_flight(actions) for actions in gpipe(p, m)] == [m] * p


@pytest.mark.parametrize("p", (1, 2, 3, 4))
@pytest.mark.parametrize("m", (1, 2, 3, 4, 5, 8))
def test_1f1b_holds_at_most_p_minus_r_microbatches(p: int, m: int) -> None:
    assert [in_flight(actions) for actions in one_f_one_b(p, m)] == [min(p - r, m) for r in range(p)]


def test_1f1b_rank_0_alternates_after_warmup() -> None:
    assert [str(a) for a in one_f_one_b(2, 3)[0]] == [
        "F0", "SF0", "F1", "SF1", "RB0", "B0", "F2", "SF2", "RB1", "B1", "RB2", "B2"]


def test_interleaved_runs_groups_of_p_microbatches_per_chunk() -> None:
    forwards = [str(a) for a in interleaved_one_f_one_b(2, 4, 2)[1] if a.op is Op.FORWARD]
    assert forwards == ["F0", "F1", "F0.1", "F1.1", "F2", "F3", "F2.1", "F3.1"]


def test_action_str_is_short_with_chunk_suffix() -> None:
    assert str(Action(Op.FORWARD, 3)) == "F3"
    assert str(Action(Op.RECV_BACKWARD, 3, 1)) == "RB3.1"
    assert str(Action(Op.SEND_FORWARD, 0, 2)) == "SF0.2"


def test_build_names_map_to_builders() -> None:
    assert build("AFAB", 3, 4) == build("gpipe", 3, 4) == gpipe(3, 4)
    assert build("1f1b", 3, 4) == one_f_one_b(3, 4)
    assert build("interleaved", 3, 4) == one_f_one_b(3, 4)  # one chunk: plain 1F1B


@pytest.mark.parametrize("args", [
    ("zero-bubble", 2, 4), ("1f1b", 0, 4), ("1f1b", 2, 0), ("gpipe", 2.0, 4), ("gpipe", True, 4),
    ("1f1b", 2, 4, 2), ("interleaved", 2, 3, 2), ("interleaved", 2, 4, 0), (None, 2, 4),
])
def test_bad_arguments_raise_invalid_argument(args: tuple) -> None:
    with pytest.raises(InvalidArgumentError):
        build(*args)


def test_interleaved_error_says_microbatches_must_be_multiple_of_stages() -> None:
    with pytest.raises(InvalidArgumentError, match="multiple of pipeline stages"):
        interleaved_one_f_one_b(4, 6, 2)


@pytest.mark.parametrize("microbatches,chunks", [(0, 1), (2.0, 1), (2, 0)])
def test_checker_rejects_bad_counts(microbatches: object, chunks: object) -> None:
    with pytest.raises(InvalidArgumentError):
        check(gpipe(2, 2), microbatches, chunks)


def _swap(actions: list[Action], a: str, b: str) -> None:
    i, j = [[str(x) for x in actions].index(s) for s in (a, b)]
    actions[i], actions[j] = actions[j], actions[i]


def test_checker_catches_backward_before_its_forward() -> None:
    schedule = one_f_one_b(2, 2)
    _swap(schedule[1], "F0", "B0")
    with pytest.raises(ScheduleError, match="rank 1: B0 .* runs before F0"):
        check(schedule, 2)


def test_checker_catches_dropped_send() -> None:
    schedule = one_f_one_b(3, 4)
    schedule[1] = [a for a in schedule[1] if str(a) != "SF2"]
    with pytest.raises(ScheduleError, match="rank 1: never runs SF2"):
        check(schedule, 4)


def test_checker_catches_sends_reordered_on_a_link() -> None:
    schedule = gpipe(2, 3)
    schedule[0][:4] = schedule[0][2:4] + schedule[0][:2]  # F1 SF1 F0 SF0
    with pytest.raises(ScheduleError, match="rank 1: message 0 on the forward link from rank 0"):
        check(schedule, 3)


def test_checker_catches_missing_and_repeated_microbatches() -> None:
    with pytest.raises(ScheduleError, match="rank 0: never runs F2"):
        check(gpipe(1, 2), 3)
    schedule = gpipe(1, 2)
    schedule[0].append(Action(Op.FORWARD, 0))
    with pytest.raises(ScheduleError, match="rank 0: action F0 runs twice"):
        check(schedule, 2)


def test_checker_catches_receive_on_the_first_stage() -> None:
    schedule = gpipe(2, 1)
    schedule[0].insert(0, Action(Op.RECV_FORWARD, 0))
    with pytest.raises(ScheduleError, match="rank 0: unexpected action RF0"):
        check(schedule, 1)


def test_checker_catches_deadlock_and_names_stuck_ranks() -> None:
    schedule = one_f_one_b(2, 2)
    recv = next(a for a in schedule[0] if a.op is Op.RECV_BACKWARD)
    schedule[0].remove(recv)
    schedule[0].insert(0, recv)
    with pytest.raises(ScheduleError, match=r"deadlock.*rank 0 at step 0 \(RB0\).*rank 1 at step 0 \(RF0\)"):
        check(schedule, 2)


def test_simulate_with_unequal_times_starts_each_compute_after_its_input() -> None:
    events = simulate(one_f_one_b(2, 2), forward_time=1.0, backward_time=2.0)
    first_backward_on_rank_0 = next(e for e in events[0] if e.op is Op.BACKWARD)
    assert first_backward_on_rank_0.start == 1.0 + 1.0 + 2.0  # F0 on ranks 0 and 1, then B0 on rank 1
    assert makespan(events) == (2 + 1) * 1.0 + (2 + 1) * 2.0


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 3, 5, 1), ("1f1b", 4, 8, 1), ("interleaved", 2, 4, 3)])
def test_render_has_one_row_per_rank_and_every_compute_once(name: str, p: int, m: int, v: int) -> None:
    text = render(simulate(build(name, p, m, v), chunks=v))
    rows = [line for line in text.splitlines() if line.startswith("stage ")]
    assert len(rows) == p
    cells = "".join(row.split("|")[1] for row in rows)
    assert sum(ch.isupper() for ch in cells) == p * m * v
    assert sum(ch.islower() for ch in cells) == p * m * v


def test_render_scales_measured_times_to_width() -> None:
    events = simulate(one_f_one_b(2, 3), forward_time=0.0123, backward_time=0.0246)
    rows = render(events, width=40).splitlines()[1:]
    assert [len(row.split("|")[1]) for row in rows] == [40, 40]


ZB = [(p, m) for p in (1, 2, 3, 4) for m in (1, 2, 3, 4, 5, 8)]


@pytest.mark.parametrize("p,m", ZB)
def test_zb_h1_passes_checker_and_cuts_the_bubble_to_a_third(p: int, m: int) -> None:
    """With forward = input-backward = weight-backward time, ZB-H1's bubble is (p − 1)/(3m + p − 1)
    once m >= p (1F1B's, with a whole backward of 2, is (p − 1)/(m + p − 1)); fewer micro-batches
    than stages leave more idle time than that, never more than 1F1B's."""
    schedule = build("zb-h1", p, m)
    check(schedule, m)
    zero_bubble = bubble_fraction(simulate(schedule, forward_time=1.0, backward_time=2.0, weight_time=1.0))
    one_f = bubble_fraction(simulate(one_f_one_b(p, m), forward_time=1.0, backward_time=2.0))
    if m >= p:
        assert zero_bubble == pytest.approx((p - 1) / (3 * m + p - 1))
    else:
        assert (p - 1) / (3 * m + p - 1) - 1e-12 <= zero_bubble <= one_f + 1e-12


@pytest.mark.parametrize("p,m", ZB)
def test_zb_h1_holds_at_most_p_microbatches_and_keeps_1f1b_messages(p: int, m: int) -> None:
    """Peak memory of 1F1B's busiest rank (p micro-batches, from forward to weight pass) on
    every rank, and exactly 1F1B's communication, in 1F1B's order."""
    schedule, reference = build("zb-h1", p, m), one_f_one_b(p, m)
    assert [in_flight(actions) for actions in schedule] == [min(p, m)] * p
    for r in range(p):
        messages = [a for a in schedule[r] if a.op not in (Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)]
        assert messages == [a for a in reference[r] if a.op not in (Op.FORWARD, Op.BACKWARD)]
        defers = [a.microbatch for a in schedule[r] if a.op is Op.BACKWARD_WEIGHT]
        assert sorted(defers) == list(range(m))


def test_checker_catches_a_weight_pass_before_its_input_pass_and_a_mixed_backward() -> None:
    schedule = build("zb-h1", 2, 2)
    swapped = [list(actions) for actions in schedule]
    i = swapped[1].index(Action(Op.BACKWARD_INPUT, 0))
    w = swapped[1].index(Action(Op.BACKWARD_WEIGHT, 0))
    swapped[1][i], swapped[1][w] = swapped[1][w], swapped[1][i]
    with pytest.raises(ScheduleError, match="BI0 at step"):
        check(swapped, 2)
    mixed = [list(actions) for actions in schedule]
    mixed[0].append(Action(Op.BACKWARD, 1))
    with pytest.raises(ScheduleError, match="runs both a whole and a split backward"):
        check(mixed, 2)


def test_render_marks_weight_passes() -> None:
    text = render(simulate(build("zb-h1", 2, 3), forward_time=1.0, backward_time=2.0, weight_time=1.0))
    cells = "".join(line.split("|")[1] for line in text.splitlines() if line.startswith("stage "))
    assert cells.count("#") == sum(ch.isupper() for ch in cells) == sum(ch.islower() for ch in cells) == 2 * 3
