"""GPT-2 (``transformers``' ``GPT2LMHeadModel``): fused ``c_attn`` (q, k, v) in ``Conv1D``
layout, learned positions, output head tied to the token embedding."""
from __future__ import annotations

import torch
from torch import nn

from psrt.errors import InvalidArgumentError
from psrt.models import BlockInputs, Family, causal_mask, has
from psrt.models import tp_styles as tp
from psrt.models.stage_layout import StageLayout

BLOCKS = "transformer.h"


def _matches(model: nn.Module) -> bool:
    return getattr(getattr(model, "config", None), "model_type", None) == "gpt2" and has(model, "transformer.wte", "transformer.wpe", "transformer.ln_f", f"{BLOCKS}.0.attn.c_attn",
               f"{BLOCKS}.0.mlp.c_fc")


def _check_heads(model: nn.Module, size: int) -> None:
    config = model.config
    if getattr(config, "add_cross_attention", False):
        raise InvalidArgumentError("GPT-2 with cross-attention is not split by plan='auto'; write the plan")
    if config.n_head % size:
        raise InvalidArgumentError(f"the number of attention heads ({config.n_head}) is not divisible by the "
                                   f"tensor-parallel size ({size})")


def _tp_plan(*, loss_parallel: bool = False) -> tp.TpPlan:
    block = f"{BLOCKS}.*"
    return {
        "transformer.wte": tp.VocabEmbedding(),
        f"{BLOCKS}.0": tp.SequenceScatter(),
        f"{block}.attn": tp.SequenceGather(),
        f"{block}.attn.c_attn": tp.ColumnWise(stride=3),
        f"{block}.attn.c_proj": tp.RowWise(),
        f"{block}.attn.resid_dropout": tp.SequenceParallel(),
        f"{block}.mlp": tp.SequenceGather(),
        f"{block}.mlp.c_fc": tp.ColumnWise(),
        f"{block}.mlp.c_proj": tp.RowWise(),
        f"{block}.mlp.dropout": tp.SequenceParallel(),
        f"{block}.ln_[12]": tp.SequenceParallel(),
        "transformer.ln_f": tp.SequenceParallel(gather_output=True),
        "lm_head": tp.ColumnWise(gather_output=not loss_parallel, pad=True),
    }


def _after_tp(model: nn.Module, size: int) -> None:
    for block in model.get_submodule(BLOCKS):
        block.attn.split_size = block.attn.embed_dim // size  # c_attn's output is q, k, v of this rank's heads


def _layout(model: nn.Module) -> StageLayout:
    from transformers.masking_utils import create_causal_mask
    config = model.config
    inputs = BlockInputs()

    def embed(piece, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        hidden = piece.get_submodule("transformer.wte")(ids) + piece.get_submodule("transformer.wpe")(positions)
        return piece.get_submodule("transformer.drop")(hidden)

    def run_block(piece, block, hidden, length):
        positions = inputs.get("positions", hidden, length, lambda positions: positions)
        mask = inputs.get("mask", hidden, length,
                          lambda positions: causal_mask(create_causal_mask, config, hidden, length, positions))
        return block(hidden, None, mask, position_ids=positions)

    def head(piece, hidden):
        return piece.get_submodule("lm_head")(piece.get_submodule("transformer.ln_f")(hidden))

    return StageLayout(("transformer.wte", "transformer.wpe", "transformer.drop"), BLOCKS,
                       ("transformer.ln_f", "lm_head"), embed, run_block, head)


FAMILY = Family("GPT-2", _matches, _check_heads, _tp_plan, _after_tp, _layout)
