"""Deadlock detection's rule (:func:`psrt.comm.deadlock.find`), its probing with a fake
prober standing in for the other ranks, and where a thread is in its user's terms."""
from __future__ import annotations

import threading
import time

from psrt.comm import callsite
from psrt.comm.deadlock import AFTER_S, HELD, Call, Detector, find, report, resolve_held


def call(rank: int, ident: tuple, peers: tuple[int, ...], needs: tuple[int, ...] | None = None, *,
         known: bool = True, since: float = 100.0, what: str = "", site: str = "", api: str = "") -> Call:
    return Call(rank, ident, since, 1.2, peers, needs, known, what or f"call {ident}", site, api,
                ident[0] not in ("recv", HELD))


def engine(rank: int, name: str, missing: tuple[int, ...], peers=(0, 1)) -> Call:
    return call(rank, ("engine", 0, name), peers, missing)


def direct(rank: int, group: str, seq: int, peers=(0, 1)) -> Call:
    return call(rank, ("direct", group, seq), peers)


def test_two_ranks_in_engine_collectives_the_other_never_submitted_are_a_deadlock():
    calls = {0: engine(0, "save", (1,)), 1: engine(1, "grad", (0,))}
    assert find(0, calls) == [0, 1] and find(1, calls) == [0, 1]


def test_a_collective_every_rank_has_submitted_is_in_progress_not_stuck():
    calls = {0: engine(0, "grad", ()), 1: engine(1, "grad", ())}
    assert find(0, calls) is None


def test_a_rank_waiting_for_one_that_is_not_blocked_is_a_stall_not_a_deadlock():
    assert find(0, {0: engine(0, "save", (1,))}) is None  # rank 1 answered with no call: it may still come


def test_an_engine_call_that_cannot_tell_whom_it_needs_yet_decides_nothing():
    calls = {0: call(0, ("engine", 0, "a"), (0, 1), None, known=False), 1: engine(1, "b", (0,))}
    assert find(0, calls) is None and find(1, calls) is None


def test_members_in_the_same_direct_collective_or_past_it_are_not_waited_for():
    assert find(0, {0: direct(0, "tp", 5), 1: direct(1, "tp", 5)}) is None
    assert find(0, {0: direct(0, "tp", 5), 1: direct(1, "tp", 6)}) is None  # rank 1 did its part of 5


def test_a_direct_collective_against_an_engine_one_is_a_deadlock():
    calls = {0: direct(0, "tp", 5), 1: engine(1, "loss", (0,))}
    assert find(0, calls) == [0, 1]


def test_a_rank_that_needs_a_deadlocked_rank_is_deadlocked_too():
    calls = {0: engine(0, "a", (1,), (0, 1, 2)), 1: engine(1, "b", (0,), (0, 1, 2)),
             2: engine(2, "c", (0,), (0, 1, 2))}
    assert find(2, calls) == [0, 1, 2]


def test_a_chain_that_ends_at_a_free_rank_is_no_deadlock():
    calls = {0: engine(0, "a", (1,), (0, 1, 2)), 1: engine(1, "b", (2,), (0, 1, 2))}
    assert find(0, calls) is None


def test_receives_wait_for_their_sender_and_are_no_collective():
    calls = {0: call(0, ("recv", "pp", 1, 11), (1,), (1,), api="Pipeline.step"),
             1: call(1, ("recv", "pp", 0, 12), (0,), (0,))}
    assert find(0, calls) == [0, 1]
    assert "is collective" not in calls[0].describe()


def test_the_report_names_each_call_its_site_and_that_it_is_collective():
    calls = {0: call(0, ("engine", 0, "s"), (0, 1), (1,), what="broadcast of tensor 's'", site="train.py:9 (in main)",
                     api="ZeroOptimizer.save"),
             1: call(1, ("engine", 0, "g"), (0, 1), (0,), what="reducescatter of tensor 'g'", api="Zero._hook")}
    first, second = report([0, 1], calls)
    assert first == ("rank 0 waits in broadcast of tensor 's', called at train.py:9 (in main) "
                     "(ZeroOptimizer.save() is collective: call it on every rank of ranks 0-1, in the same order); "
                     "it needs rank 1, blocked elsewhere")
    assert "(this psrt call is collective" in second  # a private function is no name to give the user


class AnsweringProber:
    """Ranks that answer a probe at once with the status given (None: never)."""

    def __init__(self, statuses: dict[int, dict | None]) -> None:
        self.statuses, self.asked, self._answers = statuses, [], {}

    def ask(self, ranks) -> None:
        self.asked.append(tuple(ranks))
        for rank in ranks:
            if self.statuses.get(rank) is not None:
                self._answers[rank] = (time.monotonic(), self.statuses[rank])

    def answers(self):
        return dict(self._answers)


def blocked(c: Call) -> dict:
    return {"oldest": c.age, "waits": [], "call": c.to_status()}


def run(detector: Detector, mine: Call, prober, seconds: float):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = detector.look(mine, time.monotonic(), prober)
        if found is not None:
            return found
        time.sleep(0.01)
    return None


def test_a_deadlock_is_confirmed_by_a_second_probe_and_then_reported(monkeypatch):
    monkeypatch.setattr("psrt.comm.deadlock.PERIOD_S", 0.05)
    prober = AnsweringProber({1: blocked(engine(1, "grad", (0,)))})
    detector = Detector(0, answer_within_s=0.2)
    ranks, calls = run(detector, engine(0, "save", (1,)), prober, 2.0)
    assert ranks == [0, 1] and calls[1].what == "call ('engine', 0, 'grad')"
    assert len(prober.asked) == 2, "confirmed by the second probe"


def test_a_rank_that_moved_on_between_probes_is_no_deadlock(monkeypatch):
    monkeypatch.setattr("psrt.comm.deadlock.PERIOD_S", 0.05)
    prober = AnsweringProber({1: blocked(engine(1, "grad", (0,)))})
    detector = Detector(0, answer_within_s=0.2)
    mine = engine(0, "save", (1,))
    assert run(detector, mine, prober, 0.03) is None
    later = Call(**{**engine(1, "grad", (0,)).__dict__, "since": 101.0})  # another wait: rank 1 got on
    prober.statuses[1] = blocked(later)
    prober.statuses[1]["call"]["ident"] = ["engine", 0, "grad2"]
    seen = [detector.look(mine, time.monotonic(), prober) for _ in range(3)]
    assert seen == [None, None, None]


def test_a_young_call_or_a_silent_peer_is_never_a_deadlock():
    detector = Detector(0, answer_within_s=0.05)
    young = Call(**{**engine(0, "save", (1,)).__dict__, "age": AFTER_S / 2})
    assert detector.look(young, time.monotonic(), AnsweringProber({})) is None
    assert run(Detector(0, 0.05), engine(0, "save", (1,)), AnsweringProber({1: None}), 0.5) is None


def test_the_lowest_deadlocked_rank_speaks_first(monkeypatch):
    monkeypatch.setattr("psrt.comm.deadlock.PERIOD_S", 0.05)
    prober = AnsweringProber({0: blocked(engine(0, "save", (1,)))})
    detector = Detector(1, answer_within_s=0.2)
    assert run(detector, engine(1, "grad", (0,)), prober, 2.0) is not None
    assert len(prober.asked) == 3, "rank 1 gives rank 0 one more probe's time"


def test_locate_names_the_users_line_and_the_psrt_function_it_called():
    from psrt.comm.poll import wait_politely

    done = threading.Event()

    class Request:
        def test(self) -> bool:
            return done.is_set()

    def train() -> None:
        wait_politely(Request())  # the user's line: psrt then naps inside wait_politely

    thread = threading.Thread(target=train)
    thread.start()
    time.sleep(0.2)
    site, api = callsite.locate(thread.ident)
    done.set()
    thread.join()
    assert site.endswith("test_deadlock.py:%d (in test_locate_names_the_users_line_and_the_psrt_function_it_called."
                         "<locals>.train)" % (train.__code__.co_firstlineno + 1)), site
    assert api == "wait_politely"


def test_locate_of_a_thread_that_has_no_frame_outside_psrt_gives_the_api_alone():
    assert callsite.locate(None) == ("", "")


def test_ranks_in_the_same_call_are_never_stuck_on_each_other_whatever_stale_lists_say():
    """Rank 3 froze: the rounds that would tell ranks 0-2 that the others shut down too never
    complete, so each one's list still names the others.  A stall of rank 3, not a deadlock."""
    at_exit = {r: call(r, ("shutdown",), (0, 1, 2, 3), tuple(q for q in range(4) if q != r)) for r in range(3)}
    assert find(0, at_exit) is None
    announced = {r: engine(r, "x", (1, 2, 3), (0, 1, 2, 3)) for r in range(3)}
    assert find(1, announced) is None


# -- requests held by a parameter server (rank 2) for workers 0 and 1 -----------------------------
def pull(rank: int, tag: int, server: int = 2) -> Call:
    """A worker blocked in a request that ``server`` knows by ``tag``."""
    return call(rank, (HELD, server, tag), (server,), what=f"worker {rank}'s pull of key 'w'")


def server(*holds: list) -> dict:
    return {"oldest": 0.0, "waits": [], "call": None, "holds": list(holds)}


def test_a_pull_held_for_a_worker_blocked_in_a_save_it_never_joins_is_a_deadlock():
    calls = resolve_held({0: engine(0, "psrt.ps.save.0", (1,)), 1: pull(1, 13)}, {2: server([1, 13, [0]])})
    assert calls[1].needs == (0,)
    assert find(0, calls) == [0, 1] and find(1, calls) == [0, 1]


def test_a_pull_its_server_is_still_answering_or_holds_for_nobody_is_no_deadlock():
    """A big pull being sent (not held), an async pull waiting for its own pushes, a server
    too busy to say, or silent: the worker may still get its answer."""
    blocked_save = engine(0, "psrt.ps.save.0", (1,))
    for heard in ({2: server()}, {2: server([1, 13, []])}, {2: server([1, 12, [0]])},
                  {2: {**server(), "holds": None}}, {}):
        calls = resolve_held({0: blocked_save, 1: pull(1, 13)}, heard)
        assert calls[1].needs == () and find(0, calls) is None, heard


def test_workers_at_different_steps_of_a_bounded_store_are_no_deadlock():
    """The fast worker waits for the slow one, which waits only for its own pushes."""
    calls = resolve_held({0: pull(0, 20), 1: pull(1, 31)}, {2: server([0, 20, [1]], [1, 31, []])})
    assert find(0, calls) is None and find(1, calls) is None


def test_a_request_split_over_two_servers_needs_what_either_holds_it_for():
    split = call(1, (HELD, 2, 13, 3, 40), (2, 3))
    calls = resolve_held({0: engine(0, "barrier", (1,)), 1: split}, {2: server([1, 13, []]), 3: server([1, 40, [0]])})
    assert find(0, calls) == [0, 1]


def test_the_report_names_the_workers_the_server_holds_a_request_for():
    def name(rank: int) -> str:
        return f"rank {rank} (parameter server 0)" if rank == 2 else f"rank {rank} (worker {rank})"
    calls = resolve_held({0: call(0, ("engine", 0, "s"), (0, 1), (1,), what="broadcast_object", api="KVStore.save",
                                  site="train.py:9 (in main)"),
                          1: call(1, (HELD, 2, 13), (2,), what="worker 1's pull of key 'w'", site="train.py:7 (in step)",
                                  api="KVStore.pull")},
                         {2: server([1, 13, [0]])})
    first, second = report([0, 1], calls, name)
    assert first.startswith("rank 0 (worker 0) waits in broadcast_object, called at train.py:9 (in main) "
                            "(KVStore.save() is collective"), first
    assert first.endswith("; it needs rank 1 (worker 1), blocked elsewhere"), first
    assert second == ("rank 1 (worker 1) waits in worker 1's pull of key 'w', called at train.py:7 (in step); it waits "
                      "on rank 2 (parameter server 0), which holds it for rank 0 (worker 0), blocked elsewhere")


def test_a_detector_asks_the_server_then_the_workers_it_holds_the_request_for(monkeypatch):
    monkeypatch.setattr("psrt.comm.deadlock.PERIOD_S", 0.05)
    prober = AnsweringProber({0: blocked(engine(0, "psrt.ps.save.0", (1,))), 2: server([1, 13, [0]])})
    ranks, calls = run(Detector(1, answer_within_s=0.2), pull(1, 13), prober, 2.0)
    assert ranks == [0, 1] and calls[1].needs == (0,)
    assert prober.asked[:2] == [(2,), (0,)], "the server first, then the worker it holds the pull for"
