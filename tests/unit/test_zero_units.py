"""Stage 3's units as a plain value (``psrt.zero.units.plan_units``): which modules gather which
parameters, computed without a runtime or any communication."""
from __future__ import annotations

import pytest
from torch import nn

from psrt.zero.units import plan_units


class Block(nn.Module):
    def __init__(self, experts: int = 0) -> None:
        super().__init__()
        self.attn, self.mlp = nn.Linear(4, 4), nn.Linear(4, 4)
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(experts))


class HFLike(nn.Module):
    """Hugging Face's GPT-2 layout: transformer.{wte, h[i], ln_f}, lm_head tied to wte."""

    def __init__(self, layers: int = 3, experts: int = 0) -> None:
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.wte = nn.Embedding(7, 4)
        self.transformer.h = nn.ModuleList(Block(experts) for _ in range(layers))
        self.transformer.ln_f = nn.LayerNorm(4)
        self.lm_head = nn.Linear(4, 7, bias=False)
        self.lm_head.weight = self.transformer.wte.weight


def plan(model: nn.Module, option="blocks"):
    """The plan, with units as module names and parameters as names, for reading."""
    params = list(model.parameters())
    name_of_param = {id(p): n for n, p in model.named_parameters()}
    name_of_module = {id(m): n or "<root>" for n, m in model.named_modules()}
    result = plan_units(model, params, option)
    units = {name_of_module[id(module)]: [name_of_param[id(params[i])] for i in members]
             for module, members in result.units}
    uses = [(name_of_module[id(module)], list(units)[unit]) for module, unit in result.shared_uses]
    return units, uses


def test_the_blocks_of_a_module_list_are_units_and_the_rest_is_the_root():
    units, uses = plan(HFLike())
    assert list(units) == ["<root>", "transformer.h.0", "transformer.h.1", "transformer.h.2"]
    assert units["<root>"] == ["transformer.wte.weight", "transformer.ln_f.weight", "transformer.ln_f.bias"]
    assert units["transformer.h.1"] == ["transformer.h.1.attn.weight", "transformer.h.1.attn.bias",
                                        "transformer.h.1.mlp.weight", "transformer.h.1.mlp.bias"]
    assert uses == [], "lm_head's tied weight is in the root, which is gathered around the whole forward"


def test_a_block_s_own_lists_are_not_searched():
    units, _ = plan(HFLike(layers=2, experts=2))
    assert list(units) == ["<root>", "transformer.h.0", "transformer.h.1"]
    assert "transformer.h.0.experts.1.weight" in units["transformer.h.0"]


def test_a_module_dict_of_layers_gives_blocks_and_parameterless_repeats_give_none():
    model = nn.Module()
    model.layers = nn.ModuleDict({str(i): Block() for i in range(2)})
    model.mlp = nn.Sequential(nn.ReLU(), nn.Linear(4, 4), nn.ReLU())
    units, _ = plan(model)
    assert list(units) == ["layers.0", "layers.1", "<root>"]  # in the order they first hold a parameter
    assert units["<root>"] == ["mlp.1.weight", "mlp.1.bias"]


def test_modules_gives_each_module_with_its_own_parameters_and_tied_uses():
    units, uses = plan(HFLike(layers=1), "modules")
    assert list(units) == ["transformer.wte", "transformer.h.0.attn", "transformer.h.0.mlp", "transformer.ln_f"]
    assert uses == [("lm_head", "transformer.wte")]


def test_a_weight_tied_across_two_blocks_is_used_by_the_second():
    model = HFLike()
    model.transformer.h[2].mlp.weight = model.transformer.h[0].mlp.weight
    units, uses = plan(model)
    assert "transformer.h.0.mlp.weight" in units["transformer.h.0"]
    assert uses == [("transformer.h.2.mlp", "transformer.h.0")]


def test_a_list_of_modules_gives_those_units_nested_ones_included():
    model = HFLike()
    units, _ = plan(model, [model.transformer.h, model.transformer.h[1]])
    assert list(units) == ["<root>", "transformer.h", "transformer.h.1"]
    assert all(".h.1." not in name for name in units["transformer.h"])
    assert len(units["transformer.h"]) == 8 and len(units["transformer.h.1"]) == 4


@pytest.mark.parametrize("option", ["blocks", "modules"])
def test_every_trainable_parameter_is_in_exactly_one_unit(option):
    model = HFLike(layers=2, experts=2)
    model.transformer.h[0].attn.bias.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    held = sorted(i for _, members in plan_units(model, params, option).units for i in members)
    assert held == list(range(len(params)))
