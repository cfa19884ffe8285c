"""When the host counts as crowded, so that psrt's waits nap instead of spinning."""
from __future__ import annotations

import io

import pytest

from psrt.comm import crowding


def _host(monkeypatch, pressure_totals: list[int] | None, loadavg: str = "0.1 0.1 0.1 1/300 1", cores: int = 2):
    """A host whose pressure counter reads ``pressure_totals`` in turn (None: no pressure
    figures), and a clock that moves one recheck interval per check."""
    totals = iter(pressure_totals or [])

    def fake_open(path, *args, **kwargs):
        if path == crowding._PRESSURE:
            if pressure_totals is None:
                raise FileNotFoundError(path)
            total = next(totals)
            return io.StringIO(f"some avg10=99.00 avg60=99.00 avg300=99.00 total={total}\n"
                               "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
        assert path == crowding._LOADAVG
        return io.StringIO(loadavg)
    clock = iter(i * crowding.RECHECK_S for i in range(100))
    monkeypatch.setattr(crowding, "open", fake_open, raising=False)
    monkeypatch.setattr(crowding.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(crowding, "usable_cores", lambda: cores)


def test_the_share_of_time_tasks_waited_for_a_core_between_two_checks_decides(monkeypatch):
    """Not the kernel's 10 s average (99 % in every reading here): a host that was crowded a
    moment ago and is idle now spins again at the next check."""
    interval_us = crowding.RECHECK_S * 1e6
    stalled = [0, int(0.9 * interval_us), int(0.16 * interval_us), int(0.01 * interval_us)]  # per interval
    _host(monkeypatch, [sum(stalled[:i + 1]) for i in range(len(stalled))])
    check = crowding._Crowding()
    assert [check.crowded() for _ in stalled] == [False, True, False, False]


@pytest.mark.parametrize("loadavg, crowded", [("3.9 2.0 1.0 5/300 1", True), ("1.0 1.0 1.0 2/300 1", False)])
def test_without_pressure_figures_runnable_tasks_are_counted_against_the_cores(monkeypatch, loadavg, crowded):
    _host(monkeypatch, None, loadavg)
    assert crowding._Crowding().crowded() is crowded


def test_the_verdict_is_kept_for_a_while(monkeypatch):
    reads = []
    monkeypatch.setattr(crowding, "_stalled_us", lambda: reads.append(1) or 10**6 * len(reads))
    clock = iter([0.0, 0.1, 0.2, crowding.RECHECK_S + 0.01, crowding.RECHECK_S + 0.02])
    monkeypatch.setattr(crowding.time, "monotonic", lambda: next(clock))
    check = crowding._Crowding()
    assert [check.crowded() for _ in range(5)] == [False, False, False, True, True]
    assert len(reads) == 2


@pytest.mark.parametrize("waits, verdict", [("spin", False), ("nap", True)])
def test_psrt_waits_fixes_the_verdict(monkeypatch, waits, verdict):
    monkeypatch.setattr(crowding, "_stalled_us", lambda: pytest.fail("measured a fixed verdict"))
    check = crowding._Crowding()
    check.configure(waits)
    assert check.crowded() is verdict


def test_a_wrong_psrt_waits_is_refused_naming_the_choices():
    from psrt.config import config_from_env
    from psrt.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="PSRT_WAITS='sometimes' is not one of auto, spin, nap"):
        config_from_env({"PSRT_WAITS": "sometimes"})
    assert config_from_env({"PSRT_WAITS": "NAP"}).waits == "nap"
