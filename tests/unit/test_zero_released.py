"""A released stage-3 parameter (``psrt.zero.released``) refuses reads by name and keeps its
metadata; gathering gives it back its own class.  No runtime: the class switch alone."""
from __future__ import annotations

import pytest
import torch

from psrt.errors import ParameterReleasedError
from psrt.zero.released import is_released, mark_gathered, mark_released, name_parameter


class TaggedParameter(torch.nn.Parameter):
    """A user's Parameter subclass, which must come back as itself."""


def released(param: torch.nn.Parameter, name: str = "layer.weight") -> torch.nn.Parameter:
    name_parameter(param, name)
    mark_released(param)
    return param


@pytest.mark.parametrize("read", [lambda p: p.sum(), lambda p: p.clone(), lambda p: p.data, lambda p: p + 1,
                                  lambda p: torch.nn.functional.linear(torch.ones(2, 3), p), lambda p: p.detach(),
                                  lambda p: p.tolist(), lambda p: p.copy_(torch.zeros(4, 3))],
                         ids=["sum", "clone", "data", "add", "linear", "detach", "tolist", "copy_"])
def test_reading_a_released_parameter_raises_naming_it(read):
    param = released(torch.nn.Parameter(torch.ones(4, 3)))
    with pytest.raises(ParameterReleasedError, match=r"'layer.weight'.*gathered_parameters\(\)"):
        read(param)


def test_a_released_parameter_keeps_its_metadata_gradient_and_hooks():
    param = released(torch.nn.Parameter(torch.ones(4, 3, dtype=torch.float64)))
    assert param.shape == (4, 3) and param.size(1) == 3 and param.numel() == 12 and param.dim() == 2
    assert param.dtype == torch.float64 and param.device.type == "cpu" and param.requires_grad and param.is_leaf
    param.grad = torch.full((4, 3), 2.0, dtype=torch.float64)
    assert param.grad.sum().item() == 24.0
    param.register_post_accumulate_grad_hook(lambda p: None)
    assert isinstance(param, torch.nn.Parameter) and {param: 1}[param] == 1
    assert param.untyped_storage().nbytes() == param.nbytes == 96  # not freed here: only the class switched
    assert "released" in repr(param) and "'layer.weight'" in repr(param)


def test_gathering_gives_the_parameter_back_its_own_class():
    plain, tagged = released(torch.nn.Parameter(torch.ones(2))), released(TaggedParameter(torch.ones(2)))
    assert is_released(plain) and is_released(tagged)
    mark_gathered(plain)
    mark_gathered(tagged)
    assert type(plain) is torch.nn.Parameter and type(tagged) is TaggedParameter
    assert plain.sum().item() == 2.0 and not is_released(tagged)
