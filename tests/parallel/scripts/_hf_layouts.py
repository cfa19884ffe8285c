"""The layouts ``hf_check.py`` runs at 2 and 4 ranks and the names of its checks (plain data,
shared with ``test_hf.py``, which must not import torch or psrt itself)."""
from __future__ import annotations

CHECKPOINT_MODELS = ("gpt2", "llama")

LAYOUTS_2 = [("gpt2", 1, 2, 1, {}), ("llama", 1, 2, 1, {}), ("llama_eager", 1, 2, 1, {}),
             ("gpt2", 1, 1, 2, {}), ("llama", 1, 1, 2, {}), ("mistral", 1, 1, 2, {}),
             ("gpt2", 1, 1, 2, {"chunks": 2}), ("llama", 1, 1, 2, {"chunks": 2}),
             ("llama", 1, 1, 2, {"schedule": "zb-h1"}), ("gpt2", 1, 1, 2, {"schedule": "gpipe"}),
             ("gpt2", 1, 2, 1, {"sequence_parallel": True}), ("llama", 1, 2, 1, {"sequence_parallel": True}),
             ("llama", 2, 1, 1, {"zero": 2}), ("llama", 1, 1, 2, {"balance": "measured"})]
LAYOUTS_4 = [(model, 1, 2, 2, {}) for model in ("gpt2", "llama")] + \
            [(model, 2, 2, 1, {}) for model in ("gpt2", "llama")] + \
            [("gpt2", 1, 2, 2, {"sequence_parallel": True}), ("llama", 1, 2, 2, {"sequence_parallel": True}),
             ("gpt2", 2, 2, 1, {"zero": 2}), ("llama", 2, 1, 2, {"zero": 2}), ("mistral", 1, 2, 2, {}),
             ("gpt2", 1, 2, 2, {"recompute": "full", "sequence_parallel": True})]


def name_of(model: str, dp: int, tp_size: int, pp_size: int, options: dict) -> str:
    extra = "".join(f"/{k}_{v}" if not isinstance(v, bool) else f"/{k}" for k, v in options.items())
    return f"match/{model}/dp{dp}_tp{tp_size}_pp{pp_size}{extra}"


def expected(np: int) -> list[str]:
    """Every check ``hf_check.py`` reports at ``np`` ranks, in order."""
    names = [name_of(model, dp, tp, pp, options) for model, dp, tp, pp, options in (LAYOUTS_4 if np == 4 else LAYOUTS_2)]
    if np == 4:
        names += [f"checkpoint/{model}/saved_at_122_loads_at_212_and_in_one_process" for model in CHECKPOINT_MODELS]
        names += ["checkpoint/zero3_save_and_load_hold_only_own_slices"]
    return names + ["errors/before_communication", "errors/stages_cut_differently"]
