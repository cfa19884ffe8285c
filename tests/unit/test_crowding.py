"""When the host counts as crowded, so that psrt's waits nap instead of spinning."""
from __future__ import annotations

import io

import pytest

from psrt.comm import crowding


def _host(monkeypatch, waited_s: list[float] | None, loadavg: str = "0.1 0.1 0.1 1/300 1", cores: int = 2):
    """A host whose main thread has waited for a core ``waited_s`` seconds in all at each check
    in turn (None: no scheduler statistics), and a clock that moves one recheck interval per check."""
    waits = iter(waited_s or [])

    def fake_open(path, *args, **kwargs):
        if path == crowding._SCHEDSTAT:
            if waited_s is None:
                raise FileNotFoundError(path)
            return io.StringIO(f"123456789 {int(next(waits) * 1e9)} 42\n")
        assert path == crowding._LOADAVG
        return io.StringIO(loadavg)
    clock = iter(i * crowding.RECHECK_S for i in range(100))
    monkeypatch.setattr(crowding, "open", fake_open, raising=False)
    monkeypatch.setattr(crowding.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(crowding, "usable_cores", lambda: cores)


def test_the_share_of_time_the_main_thread_waited_for_a_core_decides(monkeypatch):
    """Between two checks: a host that was crowded a moment ago and is idle now spins again
    at the next check; waits like those of wake-ups in gloo's collectives (about a tenth of
    the time) do not count as crowded."""
    interval = crowding.RECHECK_S
    per_interval = [0.0, 0.45 * interval, 0.1 * interval, 0.02 * interval, 0.5 * interval]
    _host(monkeypatch, [sum(per_interval[:i + 1]) for i in range(len(per_interval))])
    check = crowding._Crowding()
    assert [check.crowded() for _ in per_interval] == [False, True, False, False, True]


@pytest.mark.parametrize("loadavg, crowded", [("3.9 2.0 1.0 5/300 1", True), ("1.0 1.0 1.0 2/300 1", False)])
def test_without_pressure_figures_runnable_tasks_are_counted_against_the_cores(monkeypatch, loadavg, crowded):
    _host(monkeypatch, None, loadavg)
    assert crowding._Crowding().crowded() is crowded


def test_the_verdict_is_kept_for_a_while(monkeypatch):
    reads = []
    monkeypatch.setattr(crowding, "_main_thread_times", lambda: reads.append(1) or (0, 10**9 * len(reads)))
    clock = iter([0.0, 0.1, 0.2, crowding.RECHECK_S + 0.01, crowding.RECHECK_S + 0.02])
    monkeypatch.setattr(crowding.time, "monotonic", lambda: next(clock))
    check = crowding._Crowding()
    assert [check.crowded() for _ in range(5)] == [False, False, False, True, True]
    assert len(reads) == 2


@pytest.mark.parametrize("waits, verdict", [("spin", False), ("nap", True)])
def test_psrt_waits_fixes_the_verdict(monkeypatch, waits, verdict):
    monkeypatch.setattr(crowding, "_main_thread_times", lambda: pytest.fail("measured a fixed verdict"))
    check = crowding._Crowding()
    check.configure(waits)
    assert check.crowded() is verdict


def test_a_wrong_psrt_waits_is_refused_naming_the_choices():
    from psrt.config import config_from_env
    from psrt.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="PSRT_WAITS='sometimes' is not one of auto, spin, nap"):
        config_from_env({"PSRT_WAITS": "sometimes"})
    assert config_from_env({"PSRT_WAITS": "NAP"}).waits == "nap"
