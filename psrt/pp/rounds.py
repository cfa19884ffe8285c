"""Which of a step's messages go to NCCL together, so that a schedule that runs over MPI also
runs over NCCL.

Over MPI a send never blocks (the execution model :mod:`psrt.pp.simulate` checks).  Over NCCL
it does: a send completes only once its receiver's receive runs, a pair's messages are matched
by their order alone, and one communicator's calls run one after another on a device.  Two
stages that each send to the other and then receive (1F1B's steady state) would each wait for a
receive queued behind their own send.  Calls issued as one NCCL group progress together, so
:func:`message_rounds` numbers every message of a schedule, the same at both its ends, and each
rank issues its messages round by round, one group per round:

* a message's send and receive are in one round;
* a rank's receives are in increasing rounds (the compute after a receive uses it at once);
* a send is in a later round than every receive before it on its rank (its tensor may be
  computed from them), and in no earlier round than the rank's previous send to that peer.

Then every round's group can start once the earlier rounds are done everywhere (its sends'
tensors depend on earlier rounds only), and all its calls are in matching groups, so no rank
waits for another in a cycle, even with every rank's groups run one at a time:
:func:`check_rounds` runs that model.  A send may go out in a later round than its position
(its tensor is held meanwhile); a receive never waits for a later one.  The rounds are the
smallest that satisfy the rules, found from every rank's actions, so every rank finds the same.
"""
from __future__ import annotations

from psrt.errors import ScheduleError
from psrt.pp.schedule import Action, Schedule
from psrt.pp.simulate import _RECVS, _SENDS, _message

_Op = tuple[int, int]  # (rank, index among the rank's messages)


def _messages(schedule: Schedule) -> tuple[list[list[tuple[bool, int, Action]]], dict[_Op, _Op]]:
    """Each rank's messages in order, as (is a send, peer rank, action), and each one's other
    end: the k-th message a rank sends to a peer is the k-th that peer receives from it (NCCL
    has no tags: the forward and backward messages of a pair share one order)."""
    ranks = len(schedule)
    rows: list[list[tuple[bool, int, Action]]] = []
    ends: dict[tuple[bool, int, int, int], _Op] = {}
    counts: dict[tuple[bool, int, int], int] = {}
    for r, actions in enumerate(schedule):
        row = []
        for a in actions:
            if a.op in _SENDS or a.op in _RECVS:
                (sender, receiver, _), _ = _message(r, a, ranks)
                sends = a.op in _SENDS
                row.append((sends, receiver if sends else sender, a))
                pair = (sends, sender, receiver)
                n = counts[pair] = counts.get(pair, 0) + 1
                ends[(sends, sender, receiver, n)] = (r, len(row) - 1)
        rows.append(row)
    partner = {}
    for (sends, sender, receiver, n), op in ends.items():
        other = ends.get((not sends, sender, receiver, n))
        if other is None:
            raise ScheduleError(f"rank {sender} sends rank {receiver} a message that is never received "
                                "(or receives one never sent)")
        partner[op] = other
    return rows, partner


def message_rounds(schedule: Schedule) -> list[dict[Action, int]]:
    """For every rank, the round of each of its send and receive actions (see the module's
    docstring).  Raises :class:`ScheduleError` if no rounds satisfy the rules."""
    rows, partner = _messages(schedule)
    rounds = {op: 0 for op in partner}
    bound = len(rounds)  # the smallest rounds never exceed the number of messages
    changed = True
    while changed:
        changed = False
        for r, row in enumerate(rows):
            last_recv, last_send_to = -1, {}
            for i, (sends, peer, _) in enumerate(row):
                low = rounds[partner[(r, i)]]
                if last_recv >= 0:
                    low = max(low, rounds[(r, last_recv)] + 1)
                if sends and peer in last_send_to:
                    low = max(low, rounds[(r, last_send_to[peer])])
                if low > rounds[(r, i)]:
                    if low > bound:
                        raise ScheduleError(f"rank {r}: no grouping of the messages runs over NCCL without "
                                            f"deadlock ({row[i][2]} waits on itself)")
                    rounds[(r, i)], changed = low, True
                if sends:
                    last_send_to[peer] = i
                else:
                    last_recv = i
    return [{a: rounds[(r, i)] for i, (_, _, a) in enumerate(row)} for r, row in enumerate(rows)]


def check_rounds(schedule: Schedule, rounds: list[dict[Action, int]]) -> None:
    """Raise :class:`ScheduleError` unless issuing each rank's messages round by round, one
    group per round, finishes when every rank runs its groups one at a time and a group
    finishes only once the groups holding the other ends of all its messages have started."""
    rows, partner = _messages(schedule)
    groups = []  # per rank: its rounds in order, each the rounds holding its messages' other ends
    for r, row in enumerate(rows):
        mine: dict[int, list[tuple[int, int]]] = {}
        for i, (_, _, a) in enumerate(row):
            peer, j = partner[(r, i)]
            mine.setdefault(rounds[r][a], []).append((peer, rounds[peer][rows[peer][j][2]]))
        groups.append(sorted(mine.items()))
    at = [0] * len(rows)  # each rank's current group

    def started(peer: int, round_: int) -> bool:
        return at[peer] < len(groups[peer]) and groups[peer][at[peer]][0] >= round_ or at[peer] == len(groups[peer])

    progress = True
    while progress:
        progress = False
        for r, mine in enumerate(groups):
            while at[r] < len(mine) and all(started(peer, round_) for peer, round_ in mine[at[r]][1]):
                at[r] += 1
                progress = True
    stuck = [f"rank {r} in round {mine[at[r]][0]}" for r, mine in enumerate(groups) if at[r] < len(mine)]
    if stuck:
        raise ScheduleError("the messages' rounds deadlock over NCCL: " + "; ".join(stuck))
