"""The Llama layout (``transformers``' Llama, Mistral and Qwen2, whose modules have the same
names and compute the same things): separate ``q_proj``/``k_proj``/``v_proj``/``o_proj`` (grouped-query attention:
fewer key/value heads than query heads), gated MLP ``gate_proj``/``up_proj``/``down_proj``,
RMS norms, rotary positions computed once per forward, sliding-window layers where the
config asks for them."""
from __future__ import annotations

from torch import nn

from psrt.errors import InvalidArgumentError
from psrt.models import BlockInputs, Family, causal_mask, has
from psrt.models import tp_styles as tp
from psrt.models.stage_layout import StageLayout

BLOCKS = "model.layers"
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


#: The ``config.model_type`` of the families known to compute what Llama's layout computes: no
#: scaled embeddings (Gemma), no embedding or logit multipliers (Granite), no per-head norms (Qwen3).
MODEL_TYPES = ("llama", "mistral", "qwen2")


def _matches(model: nn.Module) -> bool:
    first = f"{BLOCKS}.0"
    if getattr(getattr(model, "config", None), "model_type", None) not in MODEL_TYPES:
        return False
    return has(model, "model.embed_tokens", "model.norm", "model.rotary_emb",
               *(f"{first}.self_attn.{n}" for n in _ATTENTION), *(f"{first}.mlp.{n}" for n in _MLP))


def _check_heads(model: nn.Module, size: int) -> None:
    config = model.config
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    for what, heads in (("attention heads", config.num_attention_heads), ("key/value heads", kv_heads)):
        if heads % size:
            raise InvalidArgumentError(f"the number of {what} ({heads}) is not divisible by the tensor-parallel "
                                       f"size ({size})")


def _tp_plan(*, loss_parallel: bool = False) -> tp.TpPlan:
    block = f"{BLOCKS}.*"
    return {
        "model.embed_tokens": tp.VocabEmbedding(),
        f"{BLOCKS}.0": tp.SequenceScatter(),
        f"{block}.self_attn": tp.SequenceGather(),
        f"{block}.self_attn.[qkv]_proj": tp.ColumnWise(),
        f"{block}.self_attn.o_proj": tp.RowWise(),
        f"{block}.mlp": tp.SequenceGather(),
        f"{block}.mlp.gate_proj": tp.ColumnWise(),
        f"{block}.mlp.up_proj": tp.ColumnWise(),
        f"{block}.mlp.down_proj": tp.RowWise(),
        f"{block}.*_layernorm": tp.SequenceParallel(),
        "model.norm": tp.SequenceParallel(gather_output=True),
        "lm_head": tp.ColumnWise(gather_output=not loss_parallel, pad=True),
    }


def _after_tp(model: nn.Module, size: int) -> None:
    """Nothing to fix: the attention reshapes with -1 heads and keeps its query/key ratio."""


def _layout(model: nn.Module) -> StageLayout:
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    config = model.config
    masks = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
    layer_types = getattr(config, "layer_types", None)  # per layer (Qwen2); else one kind for all (Mistral)
    every_layer = "full_attention" if getattr(config, "sliding_window", None) is None else "sliding_attention"
    inputs = BlockInputs()

    def embed(piece, ids):
        return piece.get_submodule("model.embed_tokens")(ids)

    def run_block(piece, block, hidden, length):
        kind = layer_types[block.self_attn.layer_idx] if layer_types else every_layer
        positions = inputs.get("positions", hidden, length, lambda positions: positions)
        rotary = inputs.get("rotary", hidden, length,
                            lambda positions: piece.get_submodule("model.rotary_emb")(hidden, positions))
        mask = inputs.get(kind, hidden, length,
                          lambda positions: causal_mask(masks[kind], config, hidden, length, positions))
        return block(hidden, attention_mask=mask, position_ids=positions, position_embeddings=rotary)

    def head(piece, hidden):
        return piece.get_submodule("lm_head")(piece.get_submodule("model.norm")(hidden))

    return StageLayout(("model.embed_tokens",), BLOCKS, ("model.norm", "lm_head"), embed, run_block, head,
                       shared=("model.rotary_emb",))


FAMILY = Family("Llama layout", _matches, _check_heads, _tp_plan, _after_tp, _layout)
