"""``hvd.elastic``: psrt's elastic training under Horovod's module name (see :mod:`psrt.elastic`).

Names are looked up in :mod:`psrt.elastic` on first use: that package builds on
``psrt.torch``, so importing it here, while ``psrt.torch`` itself is being imported,
would be circular."""
from __future__ import annotations

__all__ = ["BatchPlan", "ElasticError", "ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt",
           "ObjectState", "State", "TorchState", "plan_batch", "run"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module 'psrt.torch.elastic' has no attribute {name!r}")
    import psrt.elastic
    return getattr(psrt.elastic, name)
