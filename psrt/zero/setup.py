"""Checking what ``ZeroOptimizer`` is given and planning its layout, before any tensor moves.

Argument errors are raised on the calling rank before any communication.  The
one collective here compares every rank's parameters (names, shapes, dtypes and
a digest of the values) with the first rank's, so that a model initialised
differently on some rank is an error at wrap time, not a silently wrong run.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from psrt.dp import Slot, plan_buckets
from psrt.engine import Channel
from psrt.errors import ArgumentTypeError, InvalidArgumentError
from psrt.runtime import Runtime
from psrt.topology import ProcessSet
from psrt.zero.partition import ParamInfo, Partition
from psrt.zero.units import BLOCKS, UnitsOption, check_units_option, plan_units

STAGES = (0, 1, 2, 3)
COMPUTE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)


@dataclass
class ZeroLayout:
    """The trainable parameters (registration order), their names, the partition, this rank's
    shard index, for stage 3 each unit's module with its flat-group indices, and the optimizer's
    parameter groups: each group's own options and its parameters' indices in the order given
    (one group of every parameter, in registration order, when none are given); and the process
    set's engine channel, which every collective of the optimizer goes through."""

    channel: Channel
    params: list[torch.nn.Parameter]
    names: list[str]
    partition: Partition
    shard: int
    units: list[tuple[torch.nn.Module, list[int]]]
    optimizer_groups: list[tuple[dict, list[int]]]
    shared_uses: list[tuple[torch.nn.Module, int]]  # stage 3: (module, unit) where a module uses a tied parameter
    aliases: dict[str, str]  # another name of a tied trainable parameter -> the name it is trained under

    def optimizer_group_of(self, flat_group: int) -> int:
        """The optimizer group whose parameters flat group ``flat_group`` holds (one, by construction)."""
        first = self.partition.groups[flat_group].params[0]
        return next(g for g, (_, members) in enumerate(self.optimizer_groups) if first in members)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def plan_layout(model: torch.nn.Module, optimizer_class: type, optimizer_kwargs: dict, *, runtime: Runtime,
                stage: int, process_set: ProcessSet, compute_dtype: torch.dtype | None, reduce_bucket_size: int,
                allgather_bucket_size: int, overlap: bool | None, param_groups: list[dict] | None,
                units_option: UnitsOption = BLOCKS) -> ZeroLayout:
    """Check the arguments, then (one collective, on ``process_set``'s channel of ``runtime``)
    that every rank wraps the same model; nothing is changed yet, so an error leaves the model as
    it was."""
    _check_arguments(model, optimizer_class, optimizer_kwargs, stage, compute_dtype, reduce_bucket_size,
                     allgather_bucket_size, overlap, param_groups)
    check_units_option(model, units_option)
    named = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    if not named:
        raise InvalidArgumentError("ZeRO: the model has no trainable parameters")
    for name, param in named:
        if not param.is_floating_point():
            raise InvalidArgumentError(f"ZeRO: parameter {name!r} has dtype {param.dtype}; "
                                       "only floating-point parameters can be trained")
    names, params = [name for name, _ in named], [param for _, param in named]
    infos = [ParamInfo(name, tuple(param.shape), dtype_name(param.dtype)) for name, param in named]
    optimizer_groups = _optimizer_groups(param_groups, model, params, names)
    group_of = {index: g for g, (_, members) in enumerate(optimizer_groups) for index in members}
    units: list[tuple[torch.nn.Module, list[list[int]]]] = []
    shared_uses: list[tuple[torch.nn.Module, int]] = []
    if stage == 3:
        units, shared_uses = _unit_groups(model, params, group_of, units_option)
        groups = [group for _, module_groups in units for group in module_groups]
    else:
        groups = [bucket for _, members in optimizer_groups
                  for bucket in _buckets(params, sorted(members), reduce_bucket_size)]
        groups.sort(key=max, reverse=True)  # in the order backward completes them
    channel = runtime.channel(process_set)
    _check_same_on_every_rank(infos, params, [group_of[i] for i in range(len(params))], channel)
    num_shards = 1 if stage == 0 else channel.size
    partition = Partition.build(infos, groups, num_shards)
    unit_groups, next_group = [], 0
    for module, module_groups in units:
        unit_groups.append((module, list(range(next_group, next_group + len(module_groups)))))
        next_group += len(module_groups)
    return ZeroLayout(channel, params, names, partition, 0 if stage == 0 else channel.rank, unit_groups,
                      optimizer_groups, shared_uses, _aliases(model, params, names))


def _optimizer_groups(param_groups: list[dict] | None, model: torch.nn.Module, params: list[torch.nn.Parameter],
                      names: list[str]) -> list[tuple[dict, list[int]]]:
    """Each group's options and the indices of its parameters, checked to cover every
    trainable parameter exactly once (as torch's optimizers require of their groups)."""
    if param_groups is None:
        return [({}, list(range(len(params))))]
    index_of = {id(param): index for index, param in enumerate(params)}
    frozen = {id(param): name for name, param in model.named_parameters() if not param.requires_grad}
    placed: dict[int, int] = {}
    groups = []
    for g, group in enumerate(param_groups):
        members = []
        for param in group["params"]:
            if id(param) in frozen:
                raise InvalidArgumentError(f"ZeRO: parameter group {g} lists {frozen[id(param)]!r}, which does not "
                                           "require a gradient; leave frozen parameters out of the groups")
            if id(param) not in index_of:
                raise InvalidArgumentError(f"ZeRO: parameter group {g} lists a tensor of shape {tuple(param.shape)} "
                                           "that is not a parameter of the model")
            index = index_of[id(param)]
            if index in placed:
                raise InvalidArgumentError(f"ZeRO: parameter {names[index]!r} is in parameter groups {placed[index]} "
                                           f"and {g}; each parameter belongs to one group")
            placed[index] = g
            members.append(index)
        groups.append(({key: value for key, value in group.items() if key != "params"}, members))
    missing = [names[i] for i in range(len(params)) if i not in placed]
    if missing:
        raise InvalidArgumentError(f"ZeRO: trainable parameters {missing[:5]} are in no parameter group; put every "
                                   "trainable parameter in one group, or freeze it (requires_grad_(False))")
    return groups


def _check_arguments(model, optimizer_class, optimizer_kwargs, stage, compute_dtype, reduce_bucket_size,
                     allgather_bucket_size, overlap, param_groups) -> None:
    if isinstance(stage, bool) or stage not in STAGES:
        raise InvalidArgumentError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if not isinstance(model, torch.nn.Module):
        raise ArgumentTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise ArgumentTypeError("optimizer_class must be a torch.optim.Optimizer subclass such as "
                                f"torch.optim.AdamW, got {optimizer_class!r}")
    if compute_dtype not in COMPUTE_DTYPES:
        raise InvalidArgumentError(f"compute_dtype must be None, torch.float32, torch.bfloat16 or "
                                   f"torch.float16, got {compute_dtype!r}")
    for what, value in (("reduce_bucket_size", reduce_bucket_size),
                        ("allgather_bucket_size", allgather_bucket_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"{what} must be a positive int (elements), got {value!r}")
    if overlap is not None and not isinstance(overlap, bool):
        raise ArgumentTypeError(f"overlap must be a bool or None, got {overlap!r}")
    if param_groups is not None and not (
            isinstance(param_groups, (list, tuple)) and param_groups
            and all(isinstance(group, dict) and "params" in group for group in param_groups)):
        raise ArgumentTypeError("param_groups must be a non-empty list of dicts, each with a 'params' list "
                                f"(as torch.optim takes them), got {param_groups!r:.200}")
    groups = [{}] if param_groups is None else [{k: v for k, v in g.items() if k != "params"} for g in param_groups]
    try:  # the optimizer's own argument checks, on a stand-in parameter per group
        optimizer_class([dict(group, params=[torch.zeros(1, requires_grad=True)]) for group in groups],
                        **optimizer_kwargs)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{optimizer_class.__name__}(params, **{optimizer_kwargs!r}) with groups' "
                                   f"options {groups!r} is refused: {exc}") from exc


def _buckets(params: list[torch.nn.Parameter], members: list[int], bucket_elements: int) -> list[list[int]]:
    """Gradient buckets of the parameters ``members`` (indices in registration order) in the
    order backward produces them (reverse registration), as DistributedOptimizer plans them;
    each bucket's parameters in registration order.  ``bucket_elements`` is DeepSpeed's unit;
    the planner counts bytes, so each dtype's cap is that many of its elements."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index in members[::-1]:
        by_dtype.setdefault(params[index].dtype, []).append(index)
    buckets = []
    for dtype, backward in by_dtype.items():
        cap = bucket_elements * dtype.itemsize
        slots = [Slot(params[index].numel(), dtype.itemsize, dtype) for index in backward]
        buckets += [sorted(backward[slot] for slot in bucket.members)
                    for bucket in plan_buckets(slots, first_bucket_bytes=cap, bucket_bytes=cap)]
    return buckets


def _unit_groups(model: torch.nn.Module, params: list[torch.nn.Parameter], group_of: dict[int, int], option: UnitsOption
                 ) -> tuple[list[tuple[torch.nn.Module, list[list[int]]]], list[tuple[torch.nn.Module, int]]]:
    """Stage 3's units (:mod:`psrt.zero.units`), each with its parameters split by dtype and
    optimizer group into flat groups; and the uses of a unit's (tied) parameter by a module
    outside it."""
    plan = plan_units(model, params, option)
    units = []
    for module, members in plan.units:
        by_dtype: dict[tuple[torch.dtype, int], list[int]] = {}
        for index in members:
            by_dtype.setdefault((params[index].dtype, group_of[index]), []).append(index)
        units.append((module, list(by_dtype.values())))
    return units, list(plan.shared_uses)


def _aliases(model: torch.nn.Module, params: list[torch.nn.Parameter], names: list[str]) -> dict[str, str]:
    """The other names under which ``state_dict()`` lists a trainable parameter (GPT-2's
    ``lm_head.weight`` is ``transformer.wte.weight``), each with the name it is trained under."""
    name_of = {id(param): name for param, name in zip(params, names)}
    return {name: name_of[id(param)] for name, param in model.named_parameters(remove_duplicate=False)
            if id(param) in name_of and name != name_of[id(param)]}


def _digest(param: torch.Tensor) -> str:
    data = param.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.blake2b(data.numpy().tobytes(), digest_size=16).hexdigest()


def _check_same_on_every_rank(infos: list[ParamInfo], params: list[torch.nn.Parameter], group_of: list[int],
                              channel: Channel) -> None:
    mine = [(info, _digest(param), group) for info, param, group in zip(infos, params, group_of)]
    every = channel.allgather_object(mine, name="zero.wrap.parameters")
    reference = every[0]
    for set_rank, theirs in enumerate(every[1:], start=1):
        if len(theirs) != len(reference):
            raise InvalidArgumentError(f"ZeRO: rank {set_rank} of the process set has {len(theirs)} trainable "
                                       f"parameters, rank 0 has {len(reference)}: every rank must wrap the same model")
        for (info0, _, group0), (info, _, group) in zip(reference, theirs):
            if info != info0:
                raise InvalidArgumentError(f"ZeRO: parameter {info.name!r} on rank {set_rank} of the process set "
                                           f"is {info}, on rank 0 {info0}: every rank must wrap the same model")
            if group != group0:
                raise InvalidArgumentError(f"ZeRO: parameter {info.name!r} is in parameter group {group} on rank "
                                           f"{set_rank} of the process set, in group {group0} on rank 0: every rank "
                                           "must pass the same param_groups")
    for set_rank, theirs in enumerate(every[1:], start=1):
        for (info, digest0, _), (_, digest, _) in zip(reference, theirs):
            if digest != digest0:
                raise InvalidArgumentError(
                    f"ZeRO: parameter {info.name!r} has different values on rank {set_rank} and rank 0 of "
                    "the process set; initialise with the same seed or call "
                    "hvd.broadcast_parameters(model.state_dict(), root_rank=0) before wrapping")
