"""ZeRO's state in the form FSDP2 gives ``torch.distributed.checkpoint`` (DCP), so that a
checkpoint moves between psrt's ZeRO and torch's FSDP2 on any numbers of ranks:

    import torch.distributed.checkpoint as dcp
    from psrt.zero.dcp import ModelState, OptimizerState

    state = {"model": ModelState(zero), "optim": OptimizerState(zero)}
    dcp.save(state, checkpoint_id=path)   # or dcp.load(state, checkpoint_id=path)

:func:`get_model_state_dict` and :func:`get_optimizer_state_dict` return what the functions
of those names in ``torch.distributed.checkpoint.state_dict`` return for the same model and
optimizer under FSDP2: the same keys (the parameters' names), the same nesting
(``{"state": {name: {"step", "exp_avg", ...}}, "param_groups": [...]}``), the same shapes.
Only the sharded tensors differ: FSDP2's are DTensors holding a block of rows, psrt's are
:class:`FlatRangeShard`: this rank's flat range of the parameter (or of its optimizer state),
given to DCP as the few boxes of :mod:`psrt.zero.boxes`, each a view of the shard.  DCP's own
planners then save each rank's boxes and load into them from whatever chunks a checkpoint
holds (FSDP2's rows, another number of ZeRO ranks): no rank gathers a whole parameter.  The
``set_*`` functions (which ``ModelState``/``OptimizerState`` call after a load) take the
values back: the step and hyperparameters, and the parameters the model computes with.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from psrt.errors import InvalidArgumentError
from psrt.zero.boxes import boxes_of_range
from psrt.zero.flat import publish_all
from psrt.zero.flat_range import FlatRangeShard

__all__ = ["FlatRangeShard", "ModelState", "OptimizerState", "get_model_state_dict", "get_optimizer_state_dict",
           "set_model_state_dict", "set_optimizer_state_dict"]


# -- the state dicts -------------------------------------------------------------------------------
def get_model_state_dict(zero) -> dict[str, torch.Tensor]:
    """The model's state as FSDP2's ``get_model_state_dict`` has it: each trained parameter
    (under every name it has) a :class:`FlatRangeShard` of this rank's range of the master
    weights, the buffers and frozen parameters the model's own tensors.  A load writes into
    them; :func:`set_model_state_dict` then passes the values on to the model.

    :param zero: the :class:`~psrt.zero.ZeroOptimizer` whose model it is.
    """
    entries = dict(zero.unsharded_state_dict())
    entries.update(_shards(zero, lambda group: group.master))
    for alias, name in zero.aliases.items():
        entries[alias] = entries[name]
    return entries


def get_optimizer_state_dict(zero) -> dict[str, Any]:
    """The optimizer's state as FSDP2's ``get_optimizer_state_dict`` has it:
    ``{"state": {name: {key: value}}, "param_groups": [{..., "params": [names]}]}``, each
    per-element state (AdamW's ``exp_avg``, ``exp_avg_sq``) a :class:`FlatRangeShard` of this
    rank's shard, each other entry (``step``, kept per flat group by ZeRO) a copy per
    parameter.  An optimizer that has not stepped yet gets its state first, as torch does: one
    step with zero gradients and learning rate 0.

    :param zero: the :class:`~psrt.zero.ZeroOptimizer`.
    """
    _initialise_state(zero)
    partition, state = zero.partition, {}
    for g, group in enumerate(zero.groups):
        own = zero.optimizer.state[group.master]
        per_element = {key: _shards(zero, lambda _, value=value: value, only=g)
                       for key, value in own.items() if _is_per_element(value, group)}
        for param in partition.groups[g].params:
            name = partition.params[param].name
            state[name] = {key: per_element[key][name] if key in per_element else _copy(value)
                           for key, value in own.items()}
    names = [info.name for info in partition.params]
    param_groups = [dict(_options(group), params=[names[i] for i in members])
                    for group, members in zip(zero.optimizer.param_groups, zero.optimizer_groups)]
    return {"state": state, "param_groups": param_groups}


def set_model_state_dict(zero, state_dict: Mapping[str, Any]) -> None:
    """Take back a model state: what :func:`get_model_state_dict` returned, after a load wrote
    into it, or whole tensors (a consolidated ``state_dict``), of which this rank keeps its
    range; then update the parameters the model computes with (stages 1-2 gather them).

    Collective: every rank of ``zero``'s process set calls it, in the same order.

    :param zero: the :class:`~psrt.zero.ZeroOptimizer`.
    :param state_dict: every entry of the model's ``state_dict()``, by name.
    """
    sharded = _shards(zero, lambda group: group.master)
    unsharded = zero.unsharded_state_dict()
    _check_names(set(state_dict), {*sharded, *unsharded, *zero.aliases}, "model state")
    copies = [(sharded[zero.aliases.get(name, name)], value, name) for name, value in state_dict.items()
              if zero.aliases.get(name, name) in sharded]
    copies = [copy for copy in copies if _needs_copy(*copy)]  # every entry checked before any is copied
    for name, tensor in unsharded.items():
        value = state_dict[name]
        if not isinstance(value, torch.Tensor) or value.shape != tensor.shape:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise InvalidArgumentError(f"{name}: expected a tensor of shape {tuple(tensor.shape)}, got {got}")
    with torch.no_grad():
        for mine, value, _ in copies:
            _copy_boxes(mine, value)
        for name, tensor in unsharded.items():
            tensor.copy_(state_dict[name])
    publish_all(zero.groups, zero.channel)


def set_optimizer_state_dict(zero, state_dict: Mapping[str, Any]) -> None:
    """Take back an optimizer state: what :func:`get_optimizer_state_dict` returned, after a
    load wrote into it, or one of whole tensors.  Every parameter of a flat group must have the
    same step (ZeRO keeps one per group).  The parameter groups must list the same names as
    this optimizer's; their hyperparameters are taken.

    :param zero: the :class:`~psrt.zero.ZeroOptimizer`.
    :param state_dict: ``{"state": ..., "param_groups": ...}`` as torch's
        ``get_optimizer_state_dict`` makes it.
    """
    _initialise_state(zero)
    partition = zero.partition
    names = [info.name for info in partition.params]
    saved_groups, state = state_dict["param_groups"], state_dict["state"]
    mine = [[names[i] for i in members] for members in zero.optimizer_groups]
    theirs = [list(group["params"]) for group in saved_groups]
    if theirs != mine:
        raise InvalidArgumentError(f"the optimizer state has parameter groups {theirs}, this ZeRO optimizer {mine}: "
                                   "build it with the same param_groups")
    _check_names(set(state), set(names), "optimizer state")
    copies, values = [], []  # every entry checked before any is taken
    for g, group in enumerate(zero.groups):
        own = zero.optimizer.state[group.master]
        members = [names[param] for param in partition.groups[g].params]
        for key, value in own.items():
            if _is_per_element(value, group):
                shards = _shards(zero, lambda _, value=value: value, only=g)
                copies += [(shards[name], _entry(state, name, key), f"{name}.{key}") for name in members]
            else:
                given = [(name, _entry(state, name, key)) for name in members]
                values.append((own, key, _one_value(value, given, key)))
    copies = [copy for copy in copies if _needs_copy(*copy)]
    with torch.no_grad():
        for mine, value, _ in copies:
            _copy_boxes(mine, value)
    for own, key, value in values:
        own[key] = value
    for saved, group in zip(saved_groups, zero.optimizer.param_groups):
        group.update(_options(saved))


class ModelState:
    """The model of a :class:`~psrt.zero.ZeroOptimizer` as a ``Stateful`` for
    ``torch.distributed.checkpoint``: the keys and shapes FSDP2's model gives DCP.

    :param zero: the :class:`~psrt.zero.ZeroOptimizer`.
    """

    def __init__(self, zero) -> None:
        self.zero = zero

    def state_dict(self) -> dict[str, torch.Tensor]:
        """:func:`get_model_state_dict`."""
        return get_model_state_dict(self.zero)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """:func:`set_model_state_dict`.

        Collective: every rank of the optimizer's process set calls it, in the same order (DCP's
        ``load`` does, on every rank of its process group).

        :param state_dict: what :meth:`state_dict` returned, loaded.
        """
        set_model_state_dict(self.zero, state_dict)


class OptimizerState:
    """The optimizer state of a :class:`~psrt.zero.ZeroOptimizer` as a ``Stateful`` for
    ``torch.distributed.checkpoint``: the keys and shapes FSDP2's optimizer gives DCP.

    :param zero: the :class:`~psrt.zero.ZeroOptimizer`.
    """

    def __init__(self, zero) -> None:
        self.zero = zero

    def state_dict(self) -> dict[str, Any]:
        """:func:`get_optimizer_state_dict`."""
        return get_optimizer_state_dict(self.zero)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """:func:`set_optimizer_state_dict`.

        :param state_dict: what :meth:`state_dict` returned, loaded.
        """
        set_optimizer_state_dict(self.zero, state_dict)


# -- helpers ---------------------------------------------------------------------------------------
def _shards(zero, flat_of, only: int | None = None) -> dict[str, FlatRangeShard]:
    """A :class:`FlatRangeShard` per trained parameter (of flat group ``only``, or of all), over
    ``flat_of(group)``: a tensor of this rank's shard of the group."""
    partition, found = zero.partition, {}
    for g, group in enumerate(zero.groups):
        if only is not None and g != only:
            continue
        flat = flat_of(group)
        pieces = {piece.param: piece for piece in partition.pieces(g, zero.shard_index)}
        for param in partition.groups[g].params:
            info, piece = partition.params[param], pieces.get(param)
            boxes = [] if piece is None else [(box, piece.shard_offset + box.start - piece.start)
                                              for box in boxes_of_range(info.shape, piece.start, piece.stop)]
            found[info.name] = FlatRangeShard(info.shape, flat, boxes)
    return found


def _needs_copy(mine: FlatRangeShard, value: Any, name: str) -> bool:
    """Whether ``value``'s elements must be copied into this rank's boxes: not when it is
    ``mine`` (which a load has already written); raises if it cannot be."""
    if isinstance(value, FlatRangeShard):
        if value.is_view_of(mine):
            return False
        raise InvalidArgumentError(f"{name}: a FlatRangeShard of another ZeRO optimizer or layout; pass the "
                                   "state dict this optimizer's get_*_state_dict returned")
    if type(value) not in (torch.Tensor, torch.nn.Parameter):  # a DTensor, or not a tensor at all
        raise InvalidArgumentError(f"{name}: expected a whole tensor of shape {tuple(mine.shape)}, got "
                                   f"{type(value).__name__} (load a sharded state through "
                                   "torch.distributed.checkpoint)")
    if tuple(value.shape) != tuple(mine.shape):
        raise InvalidArgumentError(f"{name}: shape {tuple(value.shape)} given, the parameter's is {tuple(mine.shape)}")
    return True


def _copy_boxes(mine: FlatRangeShard, whole: torch.Tensor) -> None:
    for (offsets, sizes), view in zip(mine.boxes, mine.local_views()):
        view.copy_(whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))])


def _is_per_element(value: Any, group) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.shape == group.master.shape


def _copy(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _options(group: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}


def _entry(state: Mapping[str, Any], name: str, key: str) -> Any:
    if key not in state[name]:
        raise InvalidArgumentError(f"the optimizer state of {name!r} lacks {key!r} (it has {sorted(state[name])}); "
                                   "was it saved with another optimizer class?")
    return state[name][key]


def _one_value(current: Any, given: list[tuple[str, Any]], key: str) -> Any:
    """The one value of ``key`` that the parameters of a flat group share, in ``current``'s type."""
    first_name, first = given[0]
    for name, value in given[1:]:
        if not _same(value, first):
            raise InvalidArgumentError(
                f"ZeRO keeps one {key!r} per flat group, but {first_name!r} has {_show(first)} and {name!r} "
                f"{_show(value)}: their optimizer states cannot be merged")
    if isinstance(current, torch.Tensor):
        return torch.as_tensor(first, dtype=current.dtype, device=current.device).clone()
    return first.item() if isinstance(first, torch.Tensor) else first


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    return a == b


def _show(value: Any) -> str:
    return repr(value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value)


def _check_names(given: set[str], expected: set[str], what: str) -> None:
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if missing or unexpected:
        raise InvalidArgumentError(f"the {what} does not fit this ZeRO optimizer's model: missing {missing}, "
                                   f"unexpected {unexpected}")


def _initialise_state(zero) -> None:
    """Create the optimizer's state where it has none, as torch's ``get_optimizer_state_dict``
    does: one step with zero gradients and learning rate 0 (the weights do not change)."""
    fresh = [group.master for group in zero.groups if not zero.optimizer.state.get(group.master)]
    if not fresh:
        return
    if any(group.master.grad is not None for group in zero.groups):
        raise InvalidArgumentError("the ZeRO optimizer has not stepped yet and holds gradients: take its state "
                                   "between steps (after step() and zero_grad())")
    rates = [group["lr"] for group in zero.optimizer.param_groups]
    for master in fresh:
        master.grad = torch.zeros_like(master)
    try:
        for group in zero.optimizer.param_groups:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
        zero.optimizer.step()
    finally:
        for group, rate in zip(zero.optimizer.param_groups, rates):
            group["lr"] = rate
        for master in fresh:
            master.grad = None
