"""When MPI's waits are told to give the core away, and when the host counts as crowded."""
from __future__ import annotations

import pytest

from psrt.comm import crowding


@pytest.mark.parametrize("ranks, cores, yields", [(2, 2, True), (4, 2, True), (2, 8, False), (7, 8, False),
                                                  (8, 8, True), (None, 64, True)])
def test_mpi_yields_where_the_ranks_leave_no_core_to_spare(ranks, cores, yields):
    assert crowding.mpi_should_yield(ranks, cores) is yields


def test_every_mpi_is_told_to_yield_on_a_full_host(monkeypatch):
    monkeypatch.setattr(crowding, "usable_cores", lambda: 2)
    env = {"OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert sorted(crowding.set_mpi_yield(env)) == sorted(crowding.YIELD_SETTINGS)
    assert {name: env[name] for name in crowding.YIELD_SETTINGS} == crowding.YIELD_SETTINGS


@pytest.mark.parametrize("variable", ["OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"])
def test_a_host_with_cores_to_spare_keeps_mpi_polling(monkeypatch, variable):
    monkeypatch.setattr(crowding, "usable_cores", lambda: 16)
    env = {variable: "4"}
    assert crowding.set_mpi_yield(env) == [] and env == {variable: "4"}


def test_a_user_who_chose_any_of_the_settings_keeps_all_of_them(monkeypatch):
    monkeypatch.setattr(crowding, "usable_cores", lambda: 1)
    env = {"OMPI_MCA_mpi_yield_when_idle": "0", "MPI_LOCALNRANKS": "4"}
    assert crowding.set_mpi_yield(env) == []
    assert env == {"OMPI_MCA_mpi_yield_when_idle": "0", "MPI_LOCALNRANKS": "4"}


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


@pytest.mark.parametrize("waits, cores, expected", [("spin", 1, []), ("nap", 64, sorted(crowding.YIELD_SETTINGS)),
                                                    ("auto", 64, []), ("auto", 2, sorted(crowding.YIELD_SETTINGS))])
def test_psrt_waits_overrides_the_host_rule_for_mpi(monkeypatch, waits, cores, expected):
    monkeypatch.setattr(crowding, "usable_cores", lambda: cores)
    assert sorted(crowding.set_mpi_yield({"MPI_LOCALNRANKS": "2"}, waits)) == expected


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
