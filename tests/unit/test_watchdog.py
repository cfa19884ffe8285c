"""The stall watchdog's policy, with a fake prober standing in for the other ranks."""
from __future__ import annotations

import logging
import threading
import time

import pytest

from psrt.comm import watchdog as watchdog_module
from psrt.comm.ranks import rank_ranges
from psrt.comm.waits import Wait
from psrt.comm.watchdog import Watchdog, combined


class FakeProber:
    """Ranks that answer a probe with a given status, or never (``None``): at once, or
    ``delays[rank]`` seconds after being asked."""

    def __init__(self, rank: int, statuses: dict[int, dict | None], delays: dict[int, float] | None = None) -> None:
        self.rank, self.size = rank, 1 + len(statuses)
        self.statuses, self.delays = statuses, delays or {}
        self.asked: list[tuple[int, ...]] = []
        self._arriving: list[tuple[float, int, dict]] = []

    def ask(self, ranks) -> None:
        ranks = tuple(ranks)
        self.asked.append(ranks)
        for rank in ranks:
            if self.statuses.get(rank) is not None:
                self._arriving.append((time.monotonic() + self.delays.get(rank, 0.0), rank, self.statuses[rank]))

    def serve(self, status) -> None:
        pass

    def answers(self) -> dict[int, tuple[float, dict]]:
        now = time.monotonic()
        return {rank: (at, status) for at, rank, status in sorted(self._arriving) if at <= now}

    def close(self) -> None:
        pass


IDLE = {"oldest": 0.0, "waits": []}


def stalled(kind: str, what: str, oldest: float = 30.0) -> dict:
    return {"oldest": oldest, "waits": [[kind, what]]}


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(watchdog_module, "LOOK_EVERY_S", 0.05)
    monkeypatch.setattr(watchdog_module, "ANSWER_WITHIN_S", 0.3)


def watch(rank: int, statuses: dict[int, dict | None] | None, check_s: float, shutdown_s: float):
    ended: list[str] = []
    dog = Watchdog(check_s, shutdown_s, ended.append, rank=rank)
    if statuses is not None:
        dog.attach(FakeProber(rank, statuses))
    return dog, ended


def test_a_wait_past_the_shutdown_time_ends_the_job_naming_it_and_the_silent_rank():
    dog, ended = watch(0, {1: None, 2: stalled("an engine negotiation round", "rank 2's round")}, 0.2, 0.8)
    with dog.waiting("an engine negotiation round", lambda: "rank 0's round", (0, 1, 2)):
        time.sleep(1.3)
    dog.stop()
    assert len(ended) == 1 and ended[0].startswith("stall: rank 0's round has waited")
    assert "rank 1 does not respond" in ended[0] and "rank 2 waits: rank 2's round" in ended[0]
    assert "PSRT_STALL_SHUTDOWN_TIME=0.8 s" in ended[0]


def test_a_rank_asked_late_has_its_own_time_to_answer(caplog):
    """Step two asks the peers after step one asked rank 0: a peer asked just then must not
    be taken for silent because rank 0 was asked long enough ago."""
    dog, _ = watch(1, {0: None, 2: IDLE}, 0.2, 0.0)
    dog._prober.delays = {2: 0.1}  # rank 2 answers a moment after it is asked
    with caplog.at_level(logging.WARNING, logger="psrt"):
        with dog.waiting("an engine negotiation round", "rank 1's round", (0, 2)):
            time.sleep(1.2)
    dog.stop()
    (report,) = [r.getMessage() for r in caplog.records]
    assert "rank 0 does not respond" in report and "rank 2 answers" in report, report


def test_ranks_waiting_in_the_same_way_are_grouped_and_idle_ones_named(caplog):
    round_ = "an engine negotiation round"
    dog, ended = watch(0, {1: stalled(round_, "a"), 2: stalled(round_, "b"), 3: IDLE}, 0.2, 0.0)
    with caplog.at_level(logging.WARNING, logger="psrt"):
        with dog.waiting(round_, "rank 0's round", (1, 2, 3)):
            time.sleep(0.8)
    dog.stop()
    (report,) = [r.getMessage() for r in caplog.records]
    assert "ranks 1-2 wait in an engine negotiation round" in report
    assert "rank 3 answers but waits for nothing in psrt" in report
    assert not ended, "shutdown time 0 never ends the job"


def test_a_stalled_rank_asks_rank_0_and_the_powers_of_two_below_it_first():
    dog, _ = watch(12, {}, 60.0, 0.0)
    assert dog._deciders() == (0, 1, 2, 4, 8)
    dog.rank = 0
    assert dog._deciders() == ()
    dog.stop()


def test_a_rank_that_defers_never_probes_the_ranks_it_waits_on():
    """So that a world-wide stall costs log2(size) messages per rank, not size."""
    dog, ended = watch(6, {0: stalled("r", "a"), 1: stalled("r", "b"), 2: stalled("r", "c"),
                           4: stalled("r", "d"), 7: None}, 0.2, 0.0)
    prober = dog._prober
    with dog.waiting("an engine negotiation round", "rank 6's round", (0, 1, 2, 3, 4, 5, 7)):
        time.sleep(0.8)
    dog.stop()
    assert set(prober.asked) == {(0, 1, 2, 4)}, prober.asked


def test_a_rank_defers_to_a_lower_stalled_rank_and_ends_the_job_only_late(caplog):
    dog, ended = watch(2, {0: None, 1: stalled("an engine negotiation round", "rank 1's round")}, 0.2, 0.6)
    with caplog.at_level(logging.WARNING, logger="psrt"):
        with dog.waiting("an engine negotiation round", "rank 2's round", (0, 1)):
            time.sleep(0.7)
            assert not ended and not caplog.records, "rank 1 speaks for the job"
            time.sleep(0.6)  # past shutdown + check: rank 1 has not ended the job, so rank 2 does
    dog.stop()
    assert len(ended) == 1 and "rank 0 does not respond" in ended[0]


def test_a_rank_speaks_when_rank_0_is_the_one_that_does_not_respond(caplog):
    dog, ended = watch(1, {0: None, 2: stalled("x", "y")}, 0.2, 0.0)
    with caplog.at_level(logging.WARNING, logger="psrt"):
        with dog.waiting("an engine negotiation round", "rank 1's round", (0, 2)):
            time.sleep(0.8)
    dog.stop()
    assert [r.getMessage() for r in caplog.records if "rank 0 does not respond" in r.getMessage()]


def test_a_wait_by_design_is_reported_but_never_ends_the_job(caplog):
    dog, ended = watch(0, {1: IDLE}, 0.2, 0.4)
    with caplog.at_level(logging.WARNING, logger="psrt"):
        dog.publish("engine", [Wait("a join", "join, missing ranks [1]", (1,), time.monotonic(), key="join",
                                    ends_job=False)])
        time.sleep(1.0)
    dog.stop()
    assert not ended and "join, missing ranks [1] has waited" in caplog.records[0].getMessage()


def test_what_one_loop_holds_is_one_wait_naming_every_peer():
    now = time.monotonic()
    held = [Wait("k", f"pull {i}", (i % 3 + 1,), now - i) for i in range(5)]
    (one,) = combined("held", held, key="server 0")
    assert one.describe() == "pull 4; pull 3; pull 2; and 2 more" and one.since == now - 4
    assert one.peer_ranks() == (1, 2, 3) and one.key == "server 0"
    assert combined("held", [], key="x") == []


def test_before_probing_is_possible_only_rank_0_reports(caplog):
    for rank, expect in ((0, 1), (3, 0), (1, 1)):
        dog, _ = watch(rank, None, 0.1, 0.0)
        if rank == 1:  # rank 0 is the one that never came: bootstrap.Arrivals makes rank 1 speak
            dog.speaks_unprobed = lambda: True
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="psrt"):
            with dog.waiting("start-up", "psrt.init() waiting"):
                time.sleep(0.4)
        dog.stop()
        assert len(caplog.records) == expect, (rank, caplog.records)


def test_published_waits_are_reported_with_what_their_peers_say_and_withdrawn(caplog):
    dog, _ = watch(0, {1: IDLE}, 0.2, 0.0)
    since = time.monotonic() - 5
    with caplog.at_level(logging.WARNING, logger="psrt"):
        dog.publish("engine", [Wait("a collective some ranks have not submitted", "allreduce of 'x'", (1,), since,
                                    key="x")])
        time.sleep(0.6)
        dog.publish("engine", [])
        time.sleep(0.2)
        status = dog.status()
    dog.stop()
    assert (status["oldest"], status["waits"]) == (0.0, [])
    (report,) = [r.getMessage() for r in caplog.records]
    assert report.startswith("psrt: stall: allreduce of 'x' has waited 5 s: rank 1 answers")


def test_status_tells_a_prober_only_waits_that_last():
    dog, _ = watch(0, {}, 0.4, 0.0)  # lasting: half the check time
    with dog.waiting("an engine negotiation round", "rank 0's round"):
        fresh = dog.status()
        time.sleep(0.25)
        status = dog.status()
    dog.stop()
    assert (fresh["oldest"], fresh["waits"]) == (0.0, []), "a round of milliseconds is not news"
    assert status["waits"] == [["an engine negotiation round", "rank 0's round", []]] and status["oldest"] >= 0.2


def test_short_waits_are_not_reported_and_stop_ends_the_thread():
    dog, ended = watch(0, {1: None}, 60.0, 0.0)
    with dog.waiting("a pipeline message", lambda: "never described", (1,)):
        pass
    dog.stop()
    assert not ended and not dog._prober
    assert not any(t.name == "psrt-watchdog" and t.is_alive() for t in threading.enumerate())


def test_rank_lists_are_written_as_ranges():
    assert rank_ranges([5, 0, 2, 1]) == "0-2, 5"
    assert rank_ranges([3]) == "3"
