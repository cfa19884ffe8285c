"""Pipeline messages over NCCL, as values: every built schedule's messages, issued round by
round, finish even when each rank runs its NCCL groups one at a time; 1F1B's rounds are
Megatron's fused send-and-receive pairs; issuing each message alone deadlocks (the control)."""
from __future__ import annotations

import pytest

from psrt.errors import ScheduleError
from psrt.pp.rounds import _messages, check_rounds, message_rounds
from psrt.pp.schedule import Action, Op, build

SCHEDULES = ([(name, p, m, 1) for name in ("gpipe", "1f1b", "zb-h1") for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 5, 8)]
             + [("interleaved", p, k * p, v) for p in (2, 3, 4) for k in (1, 2, 3) for v in (2, 3, 4)])


@pytest.mark.parametrize("name,p,m,v", SCHEDULES)
def test_every_schedule_issued_round_by_round_runs_over_nccl_without_deadlock(name: str, p: int, m: int,
                                                                              v: int) -> None:
    schedule = build(name, p, m, v)
    rounds = message_rounds(schedule)
    check_rounds(schedule, rounds)
    for r, mine in enumerate(rounds):
        receives = [mine[a] for a in schedule[r] if a in mine and a.op in (Op.RECV_FORWARD, Op.RECV_BACKWARD)]
        assert receives == sorted(set(receives)), f"rank {r}: receives out of round order {receives}"


def test_1f1b_pairs_each_steady_state_send_with_the_opposite_receive() -> None:
    rounds = message_rounds(build("1f1b", 2, 4))

    def at(rank: int, op: Op, k: int) -> int:
        return rounds[rank][Action(op, k, 0)]

    for k in range(1, 4):  # stage 0 sends forward k with receiving backward k-1, stage 1 the other way
        assert at(0, Op.SEND_FORWARD, k) == at(0, Op.RECV_BACKWARD, k - 1) == at(1, Op.RECV_FORWARD, k)
        assert at(1, Op.SEND_BACKWARD, k - 1) == at(1, Op.RECV_FORWARD, k)


def _each_alone(schedule) -> list[dict[Action, int]]:
    """Every message its own group, in the rank's order: what issuing each send at once does."""
    rows, _ = _messages(schedule)
    return [{a: i for i, (_, _, a) in enumerate(row)} for row in rows]


def _with_next_receive(schedule) -> list[dict[Action, int]]:
    """Each rank's sends held until its next receive and issued with it: enough for 1F1B."""
    rows, _ = _messages(schedule)
    out = []
    for row in rows:
        groups, group = {}, 0
        for sends, _, a in row:
            groups[a] = group
            group += not sends
        out.append(groups)
    return out


def test_sends_issued_with_the_next_receive_suffice_for_1f1b_but_deadlock_interleaved() -> None:
    check_rounds(build("1f1b", 4, 8), _with_next_receive(build("1f1b", 4, 8)))
    schedule = build("interleaved", 2, 4, 2)
    with pytest.raises(ScheduleError, match="deadlock over NCCL"):
        check_rounds(schedule, _with_next_receive(schedule))


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 2, 4, 1), ("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2)])
def test_messages_issued_one_at_a_time_deadlock_and_the_check_says_so(name: str, p: int, m: int, v: int) -> None:
    schedule = build(name, p, m, v)
    with pytest.raises(ScheduleError, match="deadlock over NCCL"):
        check_rounds(schedule, _each_alone(schedule))


def test_a_message_never_received_is_refused() -> None:
    schedule = build("1f1b", 2, 2)
    schedule[1] = [a for a in schedule[1] if a != Action(Op.RECV_FORWARD, 1, 0)]
    with pytest.raises(ScheduleError, match="never received"):
        message_rounds(schedule)
