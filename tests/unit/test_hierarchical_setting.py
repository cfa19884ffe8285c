"""The hierarchical-allreduce setting: off by default, on under psrt's or Horovod's name."""
from __future__ import annotations

import pytest

from psrt.config import Config, config_from_env
from psrt.errors import InvalidArgumentError


def test_hierarchical_allreduce_is_off_by_default():
    assert Config().hierarchical_allreduce is False
    assert config_from_env({}).hierarchical_allreduce is False


@pytest.mark.parametrize("name", ["PSRT_HIERARCHICAL_ALLREDUCE", "HOROVOD_HIERARCHICAL_ALLREDUCE"])
def test_hierarchical_allreduce_is_turned_on_by_either_name(name):
    assert config_from_env({name: "1"}).hierarchical_allreduce is True
    assert config_from_env({name: "off"}).hierarchical_allreduce is False
    with pytest.raises(InvalidArgumentError, match=f"{name}='sometimes' is not a boolean"):
        config_from_env({name: "sometimes"})


def test_psrt_name_wins_over_horovod_name():
    env = {"PSRT_HIERARCHICAL_ALLREDUCE": "0", "HOROVOD_HIERARCHICAL_ALLREDUCE": "1"}
    assert config_from_env(env).hierarchical_allreduce is False
