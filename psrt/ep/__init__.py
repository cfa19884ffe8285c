"""Expert parallelism: a mixture-of-experts layer (top-k router, load-balancing loss,
capacity factor or dropless) whose experts are sharded over an EP process set, tokens
dispatched and combined with uneven all-to-alls."""
from psrt.ep.comm import all_to_all, stats
from psrt.ep.moe import MoE, expert_parameters

__all__ = ["MoE", "all_to_all", "expert_parameters", "stats"]
