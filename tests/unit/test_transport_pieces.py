"""Pure pieces of the transport and runtime, testable without communication."""
from __future__ import annotations

import pytest

from psrt.comm.bootstrap import describe_exception, launched_by_mpi
from psrt.comm.ring import chunk_bounds
from psrt.config import Config, config_from_env
from psrt.errors import InvalidArgumentError
from psrt.torch.agreement import describe_mismatch, signature
from psrt.torch.collectives import reducescatter_rows


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
    config = config_from_env({"PSRT_RING_THRESHOLD": "1024", "PSRT_CHECK_CONSISTENCY": "off"})
    assert config.ring_threshold == 1024 and config.check_consistency is False
    with pytest.raises(InvalidArgumentError, match="PSRT_RING_SEGMENT='big'"):
        config_from_env({"PSRT_RING_SEGMENT": "big"})
    with pytest.raises(InvalidArgumentError, match="boolean"):
        config_from_env({"PSRT_CHECK_CONSISTENCY": "maybe"})


def test_signature_is_stable_and_distinguishes_descriptors():
    a = (("collective", "allreduce"), ("shape", (2, 3)))
    assert signature(a) == signature(tuple(a))
    assert signature(a) != signature((("collective", "allreduce"), ("shape", (3, 2))))


def test_mismatch_message_names_tensor_ranks_and_values():
    base = (("collective", "allreduce"), ("dtype", "torch.float32"))
    message = describe_mismatch("grad.fc1", [base + (("shape", (4, 3)),),
                                             base + (("shape", (4, 3)),),
                                             base + (("shape", (5, 3)),)])
    assert "allreduce of tensor 'grad.fc1'" in message
    assert "shape differs: ranks 0,1 have (4, 3); rank 2 has (5, 3)" in message
    assert "dtype" not in message


def test_launcher_detection_and_exception_description():
    assert launched_by_mpi({"OMPI_COMM_WORLD_SIZE": "2"})
    assert not launched_by_mpi({})
    assert describe_exception(ValueError("boom\nmore")) == "raised ValueError: boom"
    assert describe_exception(KeyError()) == "raised KeyError"
