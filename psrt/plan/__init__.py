"""``psrt plan``: which layouts of a model fit a number of ranks and their memory, ranked by a
modelled step time.

    import psrt.plan
    model = psrt.plan.Transformer(layers=24, hidden=2048, heads=16, vocab=50304, sequence_length=2048)
    for plan in psrt.plan.layouts(model, global_batch=256, ranks=16, memory_per_rank="80GiB")[:5]:
        print(psrt.plan.describe(plan))

The model: bytes per rank after ZeRO's accounting of what psrt's optimizers hold and the
activations psrt's blocks keep (:mod:`psrt.plan.memory`); step time from FLOPs, the volume
of each strategy's communication and the pipeline bubble, over a machine's measured figures
(:mod:`psrt.plan.cost`, :mod:`psrt.plan.machine`, :mod:`psrt.plan.probe`).
"""
from psrt.plan.cost import StepTime
from psrt.plan.layout import Layout, Precision, precision
from psrt.plan.machine import Link, Machine, default_machine, load_machine
from psrt.plan.memory import MemoryBreakdown
from psrt.plan.model import ParameterBlocks, Transformer
from psrt.plan.readers import from_config, from_hf_config, from_module
from psrt.plan.report import describe, table
from psrt.plan.search import NothingFitsError, Plan, evaluate, layouts

__all__ = ["Layout", "Link", "Machine", "MemoryBreakdown", "NothingFitsError", "ParameterBlocks", "Plan",
           "Precision", "StepTime", "Transformer", "default_machine", "describe", "evaluate", "from_config", "from_hf_config",
           "from_module", "layouts", "load_machine", "precision", "table"]
