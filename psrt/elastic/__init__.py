"""Elastic training, with Horovod's API: ``hvd.elastic.run``, ``TorchState``, ``ObjectState``,
``ElasticSampler``, ``HostsUpdatedInterrupt``.  Launch with ``psrun --min-np N --max-np M``
(and ``--host-discovery-script`` or a hostfile): psrun relaunches the job when a rank or host
fails or hosts are added, and the job continues from its last ``state.commit()``.
"""
from psrt.elastic.batch import BatchPlan, plan_batch
from psrt.elastic.run import run
from psrt.elastic.sampler import ElasticSampler
from psrt.elastic.state import ObjectState, State
from psrt.elastic.torch_state import TorchState
from psrt.errors import CollectiveMismatchError as HorovodInternalError
from psrt.errors import ElasticError, HostsUpdatedInterrupt

__all__ = ["BatchPlan", "ElasticError", "ElasticSampler", "HorovodInternalError", "HostsUpdatedInterrupt",
           "ObjectState", "State", "TorchState", "plan_batch", "run"]
