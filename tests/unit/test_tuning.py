"""The tuning table (psrt.comm.tuning.table), its measurement and files (psrt.comm.tuning.measure) and the
engine's autotuner (psrt.engine.autotune), with a fake transport and fake clocks: which
algorithm is faster where is made up, so the choices can be checked exactly."""
from __future__ import annotations

import csv
import logging
from dataclasses import replace

import pytest
import torch

from psrt.comm.tuning import measure
from psrt.comm.tuning import table as table_module
from psrt.comm.tuning.table import (Band, Choice, TuningFileError, TuningKey, TuningTable, choose_bands, default_path,
                                    fixed_table, read, ratios, write)
from psrt.config import Config, config_from_env
from psrt.engine.autotune import Autotuner, CoordinateSearch, Setting
from psrt.errors import InvalidArgumentError

MiB = 1 << 20
KEY = TuningKey(hosts=("node1",), cpu="Some CPU", mpi="Open MPI v5.0.0", ranks=2, ranks_per_host=(2,))


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeWorld:
    """One rank of a world whose barriers are instantaneous and whose allgather sees only it."""

    rank, size = 0, 1

    def barrier(self):
        return type("Done", (), {"wait": lambda self: None})()

    def allgather_object(self, obj):
        return [obj]

    def allreduce(self, tensor, op):
        pass


def fake_runs(clock: FakeClock, crossover: int) -> dict:
    """'mpi' costs 10 us + 1 ns/byte; 'ring' 0.3 ns/byte and a fixed cost that makes it faster above
    ``crossover``."""
    ring_fixed = 10e-6 + crossover * 0.7e-9

    def cost(seconds):
        def run(buffer):
            clock.now += seconds(buffer.numel() * 4)
        return run
    return {"mpi": cost(lambda n: 10e-6 + n * 1e-9), "ring": cost(lambda n: ring_fixed + n * 0.3e-9)}


def even_runs(clock: FakeClock) -> dict:
    """'mpi' and 'ring' alike, 1 ns a byte: MPI's own is kept at every size."""
    def run(buffer):
        clock.now += buffer.numel() * 4e-9
    return {"mpi": run, "ring": run}


def test_measured_bands_put_the_ring_from_the_first_size_it_won_and_mpi_below():
    clock = FakeClock()
    samples, unmeasured = measure.time_runs(FakeWorld(), fake_runs(clock, crossover=3 * MiB), sizes=measure.SIZES,
                                            repeats=3, clock=clock)
    assert unmeasured is None
    bands = choose_bands(ratios(samples))
    assert bands == (Band(0, "mpi"), Band(4 * MiB, "ring"))  # not half-way from 1 MiB, where it lost
    table = TuningTable(KEY, bands)
    assert [table.algorithm("allreduce", n) for n in (8, 1 * MiB, 4 * MiB - 1, 4 * MiB, 64 * MiB)] == \
        ["mpi", "mpi", "mpi", "ring", "ring"]


def _same(ring: float, repeats: int = 5) -> dict[str, list[float]]:
    """Per-repeat times over MPI's: the ring's ``ring`` in every repeat."""
    return {"mpi": [1.0] * repeats, "ring": [ring] * repeats}


def test_an_algorithm_faster_by_less_than_the_margin_does_not_replace_mpi():
    bands = choose_bands({1 * MiB: _same(0.95), 4 * MiB: _same(0.85)})
    assert bands == (Band(0, "mpi"), Band(4 * MiB, "ring"))


def test_a_ring_faster_in_too_few_repeats_or_not_in_three_of_four_does_not_replace_mpi():
    assert choose_bands({1 * MiB: _same(0.8, repeats=3), 4 * MiB: _same(0.8, repeats=3)}) == (Band(0, "mpi"),)
    mixed = {"mpi": [1.0] * 5, "ring": [0.5, 0.5, 0.5, 1.2, 1.3]}
    assert choose_bands({1 * MiB: mixed, 4 * MiB: mixed}) == (Band(0, "mpi"),)
    assert choose_bands({1 * MiB: _same(0.8), 4 * MiB: _same(0.8)}) == (Band(0, "mpi"), Band(1 * MiB, "ring"))


def test_bands_follow_every_change_of_the_winner_and_merge_runs_of_one():
    costs = {1 * MiB: _same(2.0), 4 * MiB: _same(0.5), 16 * MiB: _same(0.5), 64 * MiB: _same(1.5)}
    assert choose_bands(costs) == (Band(0, "mpi"), Band(4 * MiB, "ring"), Band(32 * MiB, "mpi"))


def test_a_lone_win_between_sizes_mpi_won_is_taken_for_noise():
    costs = {256 << 10: _same(1.1), 1 * MiB: _same(0.8), 4 * MiB: _same(1.05), 16 * MiB: _same(0.6),
             64 * MiB: _same(0.4)}
    assert choose_bands(costs) == (Band(0, "mpi"), Band(16 * MiB, "ring"))
    assert choose_bands({1 * MiB: _same(1.1), 4 * MiB: _same(0.4)}) == (Band(0, "mpi"), Band(4 * MiB, "ring"))


def test_a_decisive_win_stops_the_measurement_of_larger_sizes():
    clock = FakeClock()
    samples, unmeasured = measure.time_runs(FakeWorld(), fake_runs(clock, crossover=256 << 10),
                                            sizes=measure.SIZES, repeats=3, clock=clock)
    assert unmeasured is None  # not for want of time
    assert max(samples) == 1 * MiB  # the ring took less than half MPI's time there
    assert choose_bands(ratios(samples))[-1] == Band(1 * MiB, "ring")


def test_small_sizes_get_many_repeats_and_large_ones_few_within_the_budget():
    clock = FakeClock()

    def run(buffer):
        clock.now += buffer.numel() * 4e-9  # 1 ns a byte
    samples, _ = measure.time_runs(FakeWorld(), {"mpi": run, "ring": run}, sizes=(256 << 10, 64 * MiB),
                                   repeats=3, max_repeats=35, budget_s=0.05, clock=clock)
    assert len(samples[256 << 10]["mpi"]) == 35  # about 0.5 ms a repeat: the budget allows more than the most
    assert len(samples[64 * MiB]["mpi"]) == 3  # over 0.1 s a repeat: the fewest


def test_a_ring_that_looks_faster_gets_the_repeats_that_confirm_it_past_the_budget():
    clock = FakeClock()
    runs = fake_runs(clock, crossover=1 * MiB)  # the ring is faster at 16 MiB
    samples, _ = measure.time_runs(FakeWorld(), runs, sizes=(16 * MiB,), repeats=3, budget_s=0.0, clock=clock)
    assert len(samples[16 * MiB]["ring"]) == measure.CONFIRM_REPEATS
    slower, _ = measure.time_runs(FakeWorld(), fake_runs(clock, crossover=64 * MiB), sizes=(16 * MiB,), repeats=3,
                                  budget_s=0.0, clock=clock)
    assert len(slower[16 * MiB]["ring"]) == 3


class Other(FakeWorld):
    """One rank of two, whose other rank's flags are ``theirs``."""

    def __init__(self, *theirs: bool) -> None:
        self.theirs = torch.tensor([float(flag) for flag in theirs])

    def allreduce(self, tensor, op):
        torch.maximum(tensor, self.theirs[:len(tensor)], out=tensor)


def test_every_rank_stops_repeating_as_the_others_see_it():
    assert measure._agreed(Other(True, False, False), False, False, False) == (True, False, False)  # done there
    spent, promising, _ = measure._agreed(Other(False, True, False), True, False, False)  # a faster ring there
    assert not measure._enough(3, 3, 35, spent, promising) and measure._enough(5, 3, 35, spent, promising)
    assert measure._enough(35, 3, 35, spent=False, promising=True)


class LateElsewhere(FakeWorld):
    """One rank of two, whose other rank has passed the deadline (the last flag of each agreement)."""

    def allreduce(self, tensor, op):
        tensor[-1] = 1.0


def test_a_rank_stops_measuring_where_another_has_run_out_of_time():
    clock = FakeClock()
    samples, unmeasured = measure.time_runs(LateElsewhere(), fake_runs(clock, 3 * MiB), sizes=measure.SIZES,
                                            clock=clock, deadline=1e9)
    assert samples == {} and unmeasured == measure.SIZES[0]


def test_the_measurement_ends_within_its_deadline_leaving_out_the_sizes_that_do_not_fit():
    """1 ns a byte: 256 KiB and 1 MiB take 24 ms with their repeats (10 ms each), 4 MiB's least
    work (a warm-up and 3 repeats, 2 x 4 MiB each: 34 ms) would end past 50 ms."""
    clock = FakeClock()
    samples, unmeasured = measure.time_runs(FakeWorld(), even_runs(clock), sizes=measure.SIZES,
                                            repeats=3, budget_s=0.01, clock=clock, deadline=0.05)
    assert sorted(samples) == [256 << 10, 1 * MiB] and unmeasured == 4 * MiB and clock.now <= 0.05
    assert all(len(times) >= 3 for by_name in samples.values() for times in by_name.values())


def test_a_size_the_deadline_cuts_short_is_left_unmeasured():
    clock = FakeClock()
    samples, unmeasured = measure.time_runs(FakeWorld(), even_runs(clock), sizes=(64 * MiB,),
                                            repeats=3, clock=clock, deadline=0.2)  # a repeat takes 0.13 s
    assert samples == {} and unmeasured == 64 * MiB and clock.now <= 0.2


def test_a_size_with_its_repeats_stops_repeating_before_the_deadline_and_counts():
    clock = FakeClock()
    samples, unmeasured = measure.time_runs(FakeWorld(), even_runs(clock), sizes=(16 * MiB, 64 * MiB), repeats=3,
                                            budget_s=1.0, clock=clock, deadline=0.3)  # 34 ms a repeat
    assert list(samples) == [16 * MiB] and 3 <= len(samples[16 * MiB]["mpi"]) < 35 and unmeasured == 64 * MiB
    assert clock.now <= 0.3


class FakeMpiWorld(FakeWorld):
    """What measure_table needs of a world: allreduces and reduce-scatters by algorithm, taking
    the times of :func:`even_runs` on ``clock``."""

    def __init__(self, clock: FakeClock) -> None:
        self.runs = even_runs(clock)

    def allreduce_by(self, algorithm, tensor, op):
        self.runs[algorithm](tensor)

    def reduce_scatter_by(self, algorithm, send, recv, counts, op):
        self.runs[algorithm](send)
        return type("Done", (), {"wait": lambda self: None})()


def test_a_first_job_short_of_time_follows_the_fixed_threshold_above_the_sizes_it_measured():
    clock = FakeClock()
    table = measure.measure_table(FakeMpiWorld(clock), None, KEY, budget_s=0.1, ring_threshold=16 * MiB, clock=clock)
    assert clock.now <= 0.1
    assert [row["bytes"] for row in table.measurements["allreduce"]] == [256 << 10, 1 * MiB]
    assert table.allreduce == table.reduce_scatter == (Band(0, "mpi"), Band(16 * MiB, "ring"))
    assert "not measured within 0.1 s: allreduce from 4194304 bytes" in table.measured
    full = measure.measure_table(FakeMpiWorld(clock), None, KEY, clock=clock)  # no budget: every size
    assert [row["bytes"] for row in full.measurements["allreduce"]] == list(measure.SIZES)
    assert full.allreduce == (Band(0, "mpi"),) and "not measured" not in full.measured


def test_beyond_the_sizes_measured_the_ring_goes_on_or_the_fixed_threshold_takes_over():
    mpi_only, ring_from_4 = (Band(0, "mpi"),), (Band(0, "mpi"), Band(4 * MiB, "ring"))
    assert table_module.beyond_measured(mpi_only, None, 16 * MiB) == mpi_only  # every size measured
    assert table_module.beyond_measured(ring_from_4, 16 * MiB, 16 * MiB) == ring_from_4
    assert table_module.beyond_measured(mpi_only, 4 * MiB, 16 * MiB) == (Band(0, "mpi"), Band(16 * MiB, "ring"))
    assert table_module.beyond_measured(mpi_only, 64 * MiB, 16 * MiB) == (Band(0, "mpi"), Band(64 * MiB, "ring"))


def test_the_slowest_rank_times_each_call():
    class TwoRanks(FakeWorld):
        def allgather_object(self, obj):
            return [obj, {name: [2 * t for t in times] for name, times in obj.items()}]
    clock = FakeClock()
    one, _ = measure.time_runs(FakeWorld(), fake_runs(clock, 3 * MiB), sizes=(1 * MiB,), repeats=2, clock=clock)
    two, _ = measure.time_runs(TwoRanks(), fake_runs(clock, 3 * MiB), sizes=(1 * MiB,), repeats=2, clock=clock)
    assert two[1 * MiB]["mpi"] == pytest.approx([2 * t for t in one[1 * MiB]["mpi"]])


def test_choice_takes_mpi_below_the_first_other_band_without_looking_further():
    choice = Choice(TuningTable(KEY, (Band(0, "mpi"), Band(4 * MiB, "ring"), Band(32 * MiB, "mpi"))))
    assert [choice.allreduce(n) for n in (8, 4 * MiB, 40 * MiB)] == ["mpi", "ring", "mpi"]
    assert choice.reduce_scatter(1 << 30) == "mpi"  # the table's default reduce-scatter bands
    choice.use(fixed_table(16 * MiB))
    assert (choice.allreduce(16 * MiB - 1), choice.allreduce(16 * MiB)) == ("mpi", "ring")


def test_the_tuning_file_round_trips(tmp_path):
    table = TuningTable(KEY, (Band(0, "mpi"), Band(2 * MiB, "ring")), (Band(0, "mpi"), Band(MiB, "ring")),
                        measured="today", measurements={"allreduce": [{"bytes": MiB, "mpi_us": 100.0}]})
    path = tmp_path / "sub" / KEY.file_name()
    write(path, table)
    assert read(path, KEY) == table
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temporary left behind


@pytest.mark.parametrize("text, says", [
    ("{not json", "is not JSON"),
    ('{"format": 1}', "is not a psrt tuning table of format 2"),
    ('{"format": 2, "key": {"hosts": []}}', "is malformed"),
])
def test_a_corrupt_tuning_file_is_rejected_naming_the_file_and_the_problem(tmp_path, text, says):
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(TuningFileError, match=f"the tuning file {path} {says}"):
        read(path, KEY)


def test_bands_must_start_at_zero_increase_and_name_known_algorithms(tmp_path):
    path = tmp_path / "t.json"
    for bands, says in (((Band(1, "mpi"),), "must start at 0 bytes"),
                        ((Band(0, "mpi"), Band(0, "ring")), "increasing sizes"),
                        ((Band(0, "nccl"),), "unknown allreduce algorithm 'nccl'")):
        path.write_text(TuningTable(KEY, bands).to_json())
        with pytest.raises(TuningFileError, match=says):
            read(path, KEY)


def test_a_table_of_another_job_is_rejected_naming_what_differs(tmp_path):
    path = tmp_path / "t.json"
    write(path, TuningTable(replace(KEY, ranks=4, ranks_per_host=(4,)), (Band(0, "mpi"),)))
    with pytest.raises(TuningFileError, match=r"measured for another job: ranks 4 \(this job: 2\); "
                                              r"ranks_per_host \(4,\) \(this job: \(2,\)\)"):
        read(path, KEY)


def test_tables_live_in_the_cache_unless_psrt_tune_file_names_one(tmp_path):
    assert default_path(KEY, "", {"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "psrt" / "tuning" / KEY.file_name()
    assert default_path(KEY, "~/t.json", {}).name == "t.json"
    assert config_from_env({"PSRT_TUNE_FILE": "t.json"}).tune_file == "t.json"
    assert KEY.file_name().startswith("node1-2ranks-") and replace(KEY, cpu="x").file_name() != KEY.file_name()


def test_a_table_of_another_format_lives_in_another_file(monkeypatch):
    """A psrt of another table format (an older one in another checkout, say) neither reads
    this one's cached table nor overwrites it."""
    name = KEY.file_name()
    monkeypatch.setattr(table_module, "FORMAT", 1)
    assert KEY.file_name() != name and KEY.file_name().startswith("node1-2ranks-")


class _World:
    """What establish needs of a world: two ranks seen from rank 0, and the choice it sets."""

    rank, size = 0, 2

    def __init__(self) -> None:
        self.choice = Choice(fixed_table(Config.ring_threshold))

    def allgather_object(self, obj):
        return [obj, obj]


class _Local:
    rank, size = 0, 2


@pytest.fixture
def measured(monkeypatch):
    """establish's measurements, faked: the table each returned, counted."""
    made = []

    def measure_table(world, hierarchical, key, **settings):
        made.append(TuningTable(key, (Band(0, "mpi"), Band(len(made) + 1, "ring")), measured=f"#{len(made) + 1}"))
        return made[-1]
    monkeypatch.setattr(measure, "measure_table", measure_table)
    monkeypatch.setattr(measure, "library_version", lambda: "Fake MPI 1.0")
    return made


def test_the_first_job_measures_and_writes_later_ones_read(tmp_path, measured):
    config = Config(tune_file=str(tmp_path / "t.json"))
    world = _World()
    first = measure.establish(world, _Local(), None, config)
    assert world.choice.table == first and len(measured) == 1 and read(tmp_path / "t.json", first.key) == first
    assert measure.establish(_World(), _Local(), None, config) == first and len(measured) == 1
    again = measure.establish(_World(), _Local(), None, replace(config, tune="measure"))
    assert len(measured) == 2 and read(tmp_path / "t.json", first.key) == again != first


def test_the_first_job_measures_within_its_budget_and_psrt_tune_measures_every_size(tmp_path, measured, monkeypatch):
    budgets = []
    monkeypatch.setattr(measure, "measure_table", lambda *args, budget_s, ring_threshold: budgets.append(budget_s)
                        or TuningTable(args[2], (Band(0, "mpi"),)))
    measure.establish(_World(), _Local(), None, Config(tune_file=str(tmp_path / "t.json")))
    measure.establish(_World(), _Local(), None, Config(tune="measure", tune_file=str(tmp_path / "t.json")))
    assert budgets == [measure.FIRST_JOB_BUDGET_S, float("inf")]


def test_a_corrupt_cache_is_measured_again_with_a_warning(tmp_path, measured, caplog):
    path = tmp_path / "t.json"
    path.write_text("{torn")
    with caplog.at_level(logging.WARNING, logger="psrt"):
        table = measure.establish(_World(), _Local(), None, Config(tune_file=str(path)))
    assert f"the tuning file {path} is not JSON" in caplog.text and "measuring this job's table" in caplog.text
    assert len(measured) == 1 and read(path, table.key) == table


def test_tuning_off_keeps_the_fixed_threshold(tmp_path, measured):
    world = _World()
    table = measure.establish(world, _Local(), None, Config(tune="off", tune_file=str(tmp_path / "t.json")))
    assert table.key is None and table.allreduce == (Band(0, "mpi"), Band(Config.ring_threshold, "ring"))
    assert not measured and not (tmp_path / "t.json").exists()


def test_tune_settings_are_read_and_checked():
    assert config_from_env({}).tune == "auto"
    assert config_from_env({"PSRT_TUNE": "Measure"}).tune == "measure"
    assert config_from_env({"PSRT_RING_THRESHOLD": "1048576"}).tune == "off"  # a threshold set is kept
    assert config_from_env({"PSRT_RING_THRESHOLD": "1048576", "PSRT_TUNE": "auto"}).tune == "auto"
    with pytest.raises(InvalidArgumentError, match="PSRT_TUNE='fast' is not one of auto, measure, off"):
        config_from_env({"PSRT_TUNE": "fast"})
    horovod = config_from_env({"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "a.csv",
                               "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "4"})
    assert (horovod.autotune, horovod.autotune_log, horovod.autotune_warmup_samples,
            horovod.autotune_steps_per_sample) == (True, "a.csv", 1, 4)
    with pytest.raises(InvalidArgumentError, match="PSRT_AUTOTUNE_STEPS_PER_SAMPLE='0' is out of range"):
        config_from_env({"PSRT_AUTOTUNE_STEPS_PER_SAMPLE": "0"})


# -- the autotuner ----------------------------------------------------------------------------------
def _score(setting: Setting) -> float:
    """Made-up bytes per second: best at 16 MiB and 2.5 ms."""
    return 100.0 - abs(setting.fusion_threshold - 16 * MiB) / MiB - abs(setting.cycle_time_ms - 2.5)


def test_the_coordinate_search_settles_on_the_best_candidate():
    search = CoordinateSearch(Setting(128 * MiB, 1.0))
    tried = []
    while search.current is not None:
        tried.append(search.current)
        search.record(_score(search.current))
    assert search.best == Setting(16 * MiB, 2.5)
    assert len(tried) == len(set(tried)) == 6 + 3  # every threshold, then the cycle times not yet tried


def test_the_autotuner_switches_after_each_sample_of_steps_and_keeps_the_best(tmp_path):
    clock, steps_per_sample, warmup = FakeClock(), 3, 2
    tuned = Autotuner(Setting(64 * MiB, 1.0), warmup_samples=warmup, steps_per_sample=steps_per_sample,
                      share=lambda score: score, rank=0, log=str(tmp_path / "log.csv"), clock=clock)
    applied, steps = [tuned.setting], 0
    while not tuned.done:
        clock.now += 1000 / _score(tuned.setting) / 1e6  # a step moving 1000 bytes at the setting's score
        switch = tuned.observe([("a", 600), ("b", 400)])
        steps += 1
        if switch is not None:
            applied.append(switch)
    assert tuned.setting == applied[-1] == Setting(16 * MiB, 2.5)
    assert steps == steps_per_sample * (warmup + 9) + 1  # a step ends when its first tensor comes again
    rows = list(csv.DictReader(open(tmp_path / "log.csv")))
    assert [r["phase"] for r in rows] == ["warm-up"] * warmup + ["trial"] * 9 + ["settled"]
    assert rows[-1]["fusion_threshold_bytes"] == str(16 * MiB) and rows[-1]["cycle_time_ms"] == "2.5"
    assert all(r["bytes"] == "3000" for r in rows[:-1])


def test_every_rank_follows_rank_0s_scores():
    """A rank whose own timings favour another setting still switches as rank 0 does."""
    clock = FakeClock()
    rank0 = iter(_score(Setting(t * MiB, 1.0)) for t in (0, 1, 4, 16, 64, 128))
    tuned = Autotuner(Setting(64 * MiB, 1.0), warmup_samples=0, steps_per_sample=1, rank=1,
                      share=lambda mine: next(rank0, 0.0), clock=clock)
    for _ in range(8):
        clock.now += 1.0
        tuned.observe([("a", 1)])
    assert tuned.setting.fusion_threshold == 16 * MiB
