"""Pure pieces of the transport and runtime, testable without communication."""
from __future__ import annotations

import pytest

from psrt.comm.bootstrap import describe_exception, launched_by_mpi
from psrt.comm.ring import chunk_bounds
from psrt.config import Config, config_from_env
from psrt.errors import InvalidArgumentError
from psrt.engine.mismatch import describe_mismatch
from psrt.torch.collectives.reducescatter import reducescatter_rows


@pytest.mark.parametrize("count, parts", [(0, 2), (1, 4), (53, 2), (53, 4), (1 << 20, 3)])
def test_chunk_bounds_cover_every_element_once_with_sizes_within_one(count, parts):
    bounds = chunk_bounds(count, parts)
    assert len(bounds) == parts and bounds[0][0] == 0 and bounds[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_reducescatter_gives_the_first_ranks_one_extra_row_like_horovod():
    assert reducescatter_rows(7, 3) == [3, 2, 2]
    assert reducescatter_rows(2, 4) == [1, 1, 0, 0]


def test_config_reads_psrt_variables_and_rejects_bad_values():
    assert config_from_env({}) == Config()
    config = config_from_env({"PSRT_RING_THRESHOLD": "1024", "PSRT_ABORT_ON_EXCEPTION": "off",
                              "PSRT_CYCLE_TIME": "0.5", "PSRT_FUSION_THRESHOLD": "0",
                              "PSRT_TIMELINE": "/tmp/t.json"})
    assert (config.ring_threshold, config.abort_on_exception) == (1024, False)
    assert (config.cycle_time_ms, config.fusion_threshold, config.timeline) == (0.5, 0, "/tmp/t.json")
    with pytest.raises(InvalidArgumentError, match="PSRT_RING_SEGMENT='big'"):
        config_from_env({"PSRT_RING_SEGMENT": "big"})
    with pytest.raises(InvalidArgumentError, match="boolean"):
        config_from_env({"PSRT_ABORT_ON_EXCEPTION": "maybe"})
    with pytest.raises(InvalidArgumentError, match="PSRT_RING_THRESHOLD='0' is out of range: it must be between 1"):
        config_from_env({"PSRT_RING_THRESHOLD": "0"})
    with pytest.raises(InvalidArgumentError, match="PSRT_STALL_SHUTDOWN_TIME='-1' is out of range"):
        config_from_env({"PSRT_STALL_SHUTDOWN_TIME": "-1"})


@pytest.mark.parametrize("name", ["PSRT_CYCLE_TIME", "PSRT_STALL_CHECK_TIME", "PSRT_STALL_SHUTDOWN_TIME",
                                  "HOROVOD_CYCLE_TIME"])
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "NaN", "1e308"])
def test_every_number_must_be_finite_and_in_range(name, value):
    with pytest.raises(InvalidArgumentError, match=f"{name}='{value}' (must be a finite number|is out of range)"):
        config_from_env({name: value})


def test_integer_settings_have_a_range_too():
    with pytest.raises(InvalidArgumentError, match="PSRT_CACHE_CAPACITY='10000000000' is out of range: it must be "
                                                    "between 0 and 10,000,000 .entries."):
        config_from_env({"PSRT_CACHE_CAPACITY": "10000000000"})
    with pytest.raises(InvalidArgumentError, match="PSRT_FUSION_THRESHOLD='1e9' is not an integer"):
        config_from_env({"PSRT_FUSION_THRESHOLD": "1e9"})


def test_a_stall_shutdown_time_shorter_than_the_check_time_is_refused():
    with pytest.raises(InvalidArgumentError, match="PSRT_STALL_SHUTDOWN_TIME=10 s is shorter than "
                                                    "PSRT_STALL_CHECK_TIME=60 s"):
        config_from_env({"PSRT_STALL_SHUTDOWN_TIME": "10"})
    assert config_from_env({"PSRT_STALL_SHUTDOWN_TIME": "0"}).stall_shutdown_time_s == 0


def test_a_stall_ends_the_job_after_ten_minutes_by_default():
    assert (Config().stall_check_time_s, Config().stall_shutdown_time_s) == (60.0, 600.0)


def test_a_longer_check_time_alone_lengthens_the_default_shutdown_time():
    """Raising only the check time (say, for long evaluations) must not fail init()."""
    for name in ("PSRT_STALL_CHECK_TIME", "HOROVOD_STALL_CHECK_TIME_SECONDS"):
        config = config_from_env({name: "1200"})
        assert (config.stall_check_time_s, config.stall_shutdown_time_s) == (1200.0, 1200.0)


def test_the_check_time_must_span_twenty_engine_cycles():
    with pytest.raises(InvalidArgumentError, match="PSRT_STALL_CHECK_TIME=5 s is shorter than 20 engine cycles of "
                                                    "PSRT_CYCLE_TIME=1000 ms"):
        config_from_env({"PSRT_STALL_CHECK_TIME": "5", "PSRT_CYCLE_TIME": "1000"})
    assert config_from_env({"PSRT_STALL_CHECK_TIME": "20", "PSRT_CYCLE_TIME": "1000"}).cycle_time_ms == 1000


def test_config_accepts_horovod_names_and_prefers_psrt_ones():
    config = config_from_env({"HOROVOD_FUSION_THRESHOLD": "1024", "HOROVOD_CYCLE_TIME": "5",
                              "HOROVOD_STALL_CHECK_TIME_SECONDS": "7",
                              "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "9"})
    assert (config.fusion_threshold, config.cycle_time_ms) == (1024, 5.0)
    assert (config.stall_check_time_s, config.stall_shutdown_time_s) == (7.0, 9.0)
    both = config_from_env({"HOROVOD_FUSION_THRESHOLD": "1024", "PSRT_FUSION_THRESHOLD": "2048"})
    assert both.fusion_threshold == 2048


def test_mismatch_message_names_tensor_ranks_and_values():
    base = (("collective", "allreduce"), ("dtype", "torch.float32"))
    message = describe_mismatch("grad.fc1", {0: base + (("shape", (4, 3)),),
                                             1: base + (("shape", (4, 3)),),
                                             2: base + (("shape", (5, 3)),)})
    assert "allreduce of tensor 'grad.fc1'" in message
    assert "shape differs: ranks 0,1 have (4, 3); rank 2 has (5, 3)" in message
    assert "dtype" not in message


def test_launcher_detection_and_exception_description():
    assert launched_by_mpi({"OMPI_COMM_WORLD_SIZE": "2"})
    assert not launched_by_mpi({})
    assert describe_exception(ValueError("boom\n  more\n")) == "raised ValueError: boom more"  # one line, whole
    assert describe_exception(KeyError()) == "raised KeyError"
