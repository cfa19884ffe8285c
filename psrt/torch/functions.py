"""Broadcast of parameters, optimizer state and Python objects, allgather of objects, join.

Horovod's helpers for starting every rank from the same state.  Each is a
collective: every rank of the process set must call it, in the same order,
with structurally equal arguments (the same parameter names and shapes, the
same optimizer layout).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from psrt import runtime
from psrt.errors import ArgumentTypeError, InvalidArgumentError
from psrt.runtime import global_process_set
from psrt.topology import ProcessSet
from psrt.torch.collectives._differentiable import WorkGroup, start_each
from psrt.torch.collectives.broadcast import broadcast_work
from psrt.torch.optimizer import _DistributedOptimizer
from psrt.torch.validation import check_name, check_root, check_tensor

__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "join"]


def broadcast_parameters(params, root_rank: int, prefix: str = "Parameter.",
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite ``params`` in place with ``root_rank``'s values.

    All broadcasts are started before any is waited for.

    Collective: every rank of ``process_set`` calls it, in the same order.

    :param params: a ``state_dict()`` (broadcast in sorted key order), or an iterable of
        ``(name, tensor)`` pairs (``named_parameters()``) or of tensors; names must be unique,
        and every rank must pass the same names, shapes and dtypes.
    :param root_rank: the rank whose values everyone gets: a world rank that is a member of
        ``process_set``, the same on every rank.
    :param prefix: put before each name to name its broadcast; default ``"Parameter."``.
    :param process_set: the ranks taking part: a registered process set this rank belongs to;
        default ``global_process_set`` (every rank).
    """
    named = _named_tensors(params, prefix)
    _broadcast_all(named, root_rank, process_set)


def _named_tensors(params, prefix: str) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, Mapping):
        items = sorted(params.items())
    elif isinstance(params, Iterable) and not isinstance(params, torch.Tensor):
        items = [item if isinstance(item, tuple) else (str(i), item) for i, item in enumerate(params)]
    else:
        raise ValueError(f"invalid params of type: {type(params).__name__}; pass a state_dict(), "
                         "named_parameters() or a list of tensors")
    named = []
    for name, tensor in items:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"params[{name!r}] is a {type(tensor).__name__}, not a torch.Tensor")
        named.append((f"{prefix}{name}", tensor))
    names = [name for name, _ in named]
    if len(set(names)) != len(names):
        duplicates = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"parameter names must be unique; duplicates: {', '.join(duplicates)}")
    return named


def _broadcast_all(named: list[tuple[str, torch.Tensor]], root_rank: int, process_set: ProcessSet) -> None:
    channel = runtime.current().channel(process_set)
    root = check_root(root_rank, channel.ranks)
    # detach(): the same memory, but writing into it is not an autograd operation on a leaf.
    tensors = [(name, check_tensor(tensor).detach()) for name, tensor in named]
    works = start_each(channel, [lambda name=name, tensor=tensor: broadcast_work(channel, tensor, root, name, True)
                                 for name, tensor in tensors])
    WorkGroup(channel, works).result()


# -- optimizer state -------------------------------------------------------------------------
@dataclass(frozen=True)
class _TensorSpec:
    """What a rank needs to allocate a state tensor the root will fill."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    on_cpu: bool


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: torch.nn.Module | None = None,
                              process_set: ProcessSet = global_process_set) -> None:
    """Make ``optimizer``'s hyper-parameters (``param_groups`` options such as ``lr``) and
    per-parameter state equal to ``root_rank``'s, in place.

    If the root's optimizer has no state yet (torch creates it at the first step), every
    rank whose optimizer has none either creates it as Horovod does, so that scripts find
    state and gradients afterwards: each trainable parameter's gradient is replaced by
    zeros (sparse for ``SparseAdam`` and for the sparse embeddings of ``model``) and the
    wrapped optimizer takes one step, without any allreduce; on zero gradients that step
    moves parameters only through weight decay.  Otherwise no step is taken, so a rank
    resuming from the root's checkpoint keeps its parameters: state the root has but this
    rank lacks is allocated here and filled by the broadcast, and state the root lacks is
    dropped.  Options keep their Python types.

    Collective: every rank of ``process_set`` calls it, in the same order.

    :param optimizer: a torch optimizer (or ``DistributedOptimizer``); every rank's must have
        the same parameter groups with the same sizes.
    :param root_rank: the rank whose values everyone gets: a world rank that is a member of
        ``process_set``, the same on every rank.
    :param model: the model the optimizer trains, consulted only to make sparse zero gradients
        for its sparse embeddings when state is created; default None.
    :param process_set: the ranks taking part: a registered process set this rank belongs to;
        default ``global_process_set`` (every rank).
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    layout = _root_layout(optimizer, params, root_rank, process_set)
    if not any(layout["state"].values()):
        if not any(optimizer.state.values()):
            _initialize_state(optimizer, model)
        layout = _root_layout(optimizer, params, root_rank, process_set)
    sizes = [len(group["params"]) for group in optimizer.param_groups]
    if sizes != layout["group_sizes"]:
        raise ValueError(f"rank {runtime.rank()}: the optimizer's parameter groups have "
                         f"{sizes} parameters, root rank {root_rank}'s have {layout['group_sizes']}")
    for group, options in zip(optimizer.param_groups, layout["options"]):
        group.update(options)
    tensors = _match_state(optimizer, params, layout["state"])
    _broadcast_all(tensors, root_rank, process_set)


def _root_layout(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], root_rank: int,
                 process_set: ProcessSet) -> dict:
    """The root's :func:`_describe`, on every rank."""
    return broadcast_object(_describe(optimizer, params) if runtime.rank() == root_rank else None,
                            root_rank, name="broadcast_optimizer_state.layout", process_set=process_set)


def _initialize_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None) -> None:
    """Horovod's state initialization: a step of the wrapped optimizer on zero gradients.
    A ``DistributedOptimizer`` steps as its plain class, since other ranks may not step."""
    sparse = {id(p) for m in (model.modules() if model is not None else ())
              if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
                if isinstance(optimizer, torch.optim.SparseAdam) or id(param) in sparse:
                    param.grad = param.grad.to_sparse()
    step = super(_DistributedOptimizer, optimizer).step if isinstance(optimizer, _DistributedOptimizer) \
        else optimizer.step
    step(lambda: 0.0)  # a closure, which LBFGS requires; others evaluate and ignore it


def _describe(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> dict:
    """The root's layout: group sizes and options, and each parameter's state with tensors
    replaced by their specs (their data follows by broadcast)."""
    position = {id(p): i for i, p in enumerate(params)}
    state = {}
    for param, entries in optimizer.state.items():
        if id(param) in position:
            state[position[id(param)]] = {
                key: _TensorSpec(tuple(v.shape), v.dtype, v.is_cpu) if isinstance(v, torch.Tensor) else v
                for key, v in entries.items()}
    return {"group_sizes": [len(group["params"]) for group in optimizer.param_groups],
            "options": [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups],
            "state": state}


def _match_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
                 root_state: dict[int, dict[str, Any]]) -> list[tuple[str, torch.Tensor]]:
    """Give this rank's optimizer the root's state layout; return the tensors to broadcast into."""
    tensors = []
    for index, param in enumerate(params):
        if index not in root_state:
            optimizer.state.pop(param, None)
            continue
        local = optimizer.state.get(param, {})
        entries = {}
        for key, value in root_state[index].items():
            if isinstance(value, _TensorSpec):
                value = _reuse_or_allocate(local.get(key), value, param.device)
                tensors.append((f"broadcast_optimizer_state.{index}.{key}", value))
            entries[key] = value
        optimizer.state[param] = entries
    return tensors


def _reuse_or_allocate(current: object, spec: _TensorSpec, param_device: torch.device) -> torch.Tensor:
    device = torch.device("cpu") if spec.on_cpu else param_device
    if (isinstance(current, torch.Tensor) and tuple(current.shape) == spec.shape and current.dtype == spec.dtype
            and current.device == device):
        return current
    return torch.empty(spec.shape, dtype=spec.dtype, device=device)


# -- Python objects ----------------------------------------------------------------------------
def broadcast_object(obj: object, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> object:
    """Return ``root_rank``'s ``obj`` on every rank.

    The object travels pickled and is unpickled on every other rank: broadcast only between
    ranks you trust.

    Collective: every rank of ``process_set`` calls it, in the same order.

    :param obj: the object to send, on the root (anything pickle takes); other ranks may pass
        anything, None included.
    :param root_rank: the sending rank: a world rank that is a member of ``process_set``, the
        same on every rank; default 0.
    :param name: the name the ranks match the call by; default None: ``"broadcast_object"``.
    :param process_set: the ranks taking part: a registered process set this rank belongs to;
        default ``global_process_set`` (every rank).
    :returns: the root's object (on the root, ``obj`` itself).
    """
    check_name(name)
    channel = runtime.current().channel(process_set)
    return channel.broadcast_object(obj, check_root(root_rank, channel.ranks), name=name or "broadcast_object")


def allgather_object(obj: object, name: str | None = None,
                     process_set: ProcessSet = global_process_set) -> list:
    """Every rank's ``obj``, as a list indexed by rank within the process set.

    The objects travel pickled and are unpickled on every rank: gather only between ranks you
    trust.

    Collective: every rank of ``process_set`` calls it, in the same order.

    :param obj: this rank's object (anything pickle takes).
    :param name: the name the ranks match the call by; default None: ``"allgather_object"``.
    :param process_set: the ranks taking part: a registered process set this rank belongs to;
        default ``global_process_set`` (every rank).
    :returns: a list of every rank's object, in set-rank order.
    """
    check_name(name)
    return runtime.current().channel(process_set).allgather_object(obj, name=name or "allgather_object")


# -- join --------------------------------------------------------------------------------------
def join(device: int = -1) -> int:
    """This rank has run out of data: until every rank has joined, contribute zeros to the
    other ranks' allreduces (Average still divides by the full set size).  Returns the last
    rank to join, the same on every rank, after which every collective works again.

    Collective: every rank of the world calls it, in the same order.

    :param device: Horovod's: the device for the zeros (-1, the default, for the CPU, else a
        CUDA index).  psrt makes each allreduce's zeros on the device that allreduce names, so
        it is only checked.
    :returns: the world rank that joined last.
    """
    if isinstance(device, bool) or not isinstance(device, int):
        raise ArgumentTypeError(f"join: device must be an int (-1 for the CPU, else a CUDA device "
                                f"index), got {device!r} ({type(device).__name__})")
    if device < -1:
        raise InvalidArgumentError(f"join: device must be -1 (the CPU) or a CUDA device index, got {device}")
    return runtime.join()
