"""When the host counts as crowded, so that psrt's waits nap instead of spinning."""
from __future__ import annotations

import pytest

from psrt.comm import crowding


def _verdicts(monkeypatch, pressure: str | None, loadavg: str, cores: int = 2) -> bool:
    def fake_open(path, *args, **kwargs):
        import io
        if path == crowding._PRESSURE:
            if pressure is None:
                raise FileNotFoundError(path)
            return io.StringIO(pressure)
        assert path == crowding._LOADAVG
        return io.StringIO(loadavg)
    monkeypatch.setattr(crowding, "open", fake_open, raising=False)
    monkeypatch.setattr(crowding, "usable_cores", lambda: cores)
    return crowding._Crowding().crowded()


@pytest.mark.parametrize("pressure, crowded", [
    ("some avg10=63.20 avg60=40.00 avg300=10.00 total=1\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n", True),
    ("some avg10=0.40 avg60=12.00 avg300=30.00 total=1\n", False),
])
def test_cpu_pressure_of_the_last_ten_seconds_decides(monkeypatch, pressure, crowded):
    assert _verdicts(monkeypatch, pressure, "0.1 0.1 0.1 9/300 1") is crowded


@pytest.mark.parametrize("loadavg, crowded", [("3.9 2.0 1.0 5/300 1", True), ("1.0 1.0 1.0 2/300 1", False)])
def test_without_pressure_figures_runnable_tasks_are_counted_against_the_cores(monkeypatch, loadavg, crowded):
    assert _verdicts(monkeypatch, None, loadavg) is crowded


def test_the_verdict_is_kept_for_a_while(monkeypatch):
    reads = []
    monkeypatch.setattr(crowding, "_pressure", lambda: reads.append(1) or 90.0)
    clock = iter([0.0, 0.1, 0.2, crowding.RECHECK_S + 0.01])
    monkeypatch.setattr(crowding.time, "monotonic", lambda: next(clock))
    check = crowding._Crowding()
    assert [check.crowded() for _ in range(4)] == [True] * 4
    assert len(reads) == 2


@pytest.mark.parametrize("waits, verdict", [("spin", False), ("nap", True)])
def test_psrt_waits_fixes_the_verdict_of_psrt_own_waits(monkeypatch, waits, verdict):
    monkeypatch.setattr(crowding, "_pressure", lambda: pytest.fail("measured a fixed verdict"))
    check = crowding._Crowding()
    check.configure(waits)
    assert check.crowded() is verdict


def test_a_wrong_psrt_waits_is_refused_naming_the_choices():
    from psrt.config import config_from_env
    from psrt.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="PSRT_WAITS='sometimes' is not one of auto, spin, nap"):
        config_from_env({"PSRT_WAITS": "sometimes"})
    assert config_from_env({"PSRT_WAITS": "NAP"}).waits == "nap"
