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

import psrt.torch as hvd
from psrt.errors import ArgumentTypeError, InvalidArgumentError
from psrt.topology import ProcessSet
from psrt.torch._buckets import Slot, plan_buckets
from psrt.zero.partition import ParamInfo, Partition

STAGES = (0, 1, 2, 3)
COMPUTE_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)


@dataclass
class Layout:
    """The trainable parameters (registration order), their names, the partition, this rank's
    shard index and, for stage 3, each unit's module with its group indices."""

    params: list[torch.nn.Parameter]
    names: list[str]
    partition: Partition
    shard: int
    units: list[tuple[torch.nn.Module, list[int]]]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def plan_layout(model: torch.nn.Module, optimizer_class: type, optimizer_kwargs: dict, *, stage: int,
                process_set: ProcessSet, compute_dtype: torch.dtype | None, reduce_bucket_size: int,
                allgather_bucket_size: int, overlap: bool | None) -> Layout:
    """Check the arguments, then (one collective) that every rank wraps the same model; nothing
    is changed yet, so an error leaves the model as it was."""
    _check_arguments(model, optimizer_class, optimizer_kwargs, stage, compute_dtype, reduce_bucket_size,
                     allgather_bucket_size, overlap)
    named = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    if not named:
        raise InvalidArgumentError("ZeRO: the model has no trainable parameters")
    for name, param in named:
        if not param.is_floating_point():
            raise InvalidArgumentError(f"ZeRO: parameter {name!r} has dtype {param.dtype}; "
                                       "only floating-point parameters can be trained")
    names, params = [name for name, _ in named], [param for _, param in named]
    infos = [ParamInfo(name, tuple(param.shape), dtype_name(param.dtype)) for name, param in named]
    units: list[tuple[torch.nn.Module, list[list[int]]]] = []
    if stage == 3:
        units = _units(model, params, names)
        groups = [group for _, module_groups in units for group in module_groups]
    else:
        groups = _buckets(params, reduce_bucket_size)
    _check_same_on_every_rank(infos, params, process_set)
    num_shards = 1 if stage == 0 else process_set.size()
    partition = Partition.build(infos, groups, num_shards)
    unit_groups, next_group = [], 0
    for module, module_groups in units:
        unit_groups.append((module, list(range(next_group, next_group + len(module_groups)))))
        next_group += len(module_groups)
    return Layout(params, names, partition, 0 if stage == 0 else process_set.rank(), unit_groups)


def _check_arguments(model, optimizer_class, optimizer_kwargs, stage, compute_dtype, reduce_bucket_size,
                     allgather_bucket_size, overlap) -> None:
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
    try:  # the optimizer's own argument checks, on a stand-in parameter
        optimizer_class([torch.zeros(1, requires_grad=True)], **optimizer_kwargs)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{optimizer_class.__name__}(params, **{optimizer_kwargs!r}) is refused: "
                                   f"{exc}") from exc


def _buckets(params: list[torch.nn.Parameter], bucket_elements: int) -> list[list[int]]:
    """Gradient buckets in the order backward produces them (reverse registration), as
    DistributedOptimizer plans them; each bucket's parameters in registration order."""
    last = len(params) - 1
    slots = [Slot(param.numel(), 1, param.dtype) for param in reversed(params)]
    buckets = plan_buckets(slots, first_bucket_bytes=bucket_elements, bucket_bytes=bucket_elements)
    return [sorted(last - slot for slot in bucket.members) for bucket in buckets]


def _units(model: torch.nn.Module, params: list[torch.nn.Parameter],
           names: list[str]) -> list[tuple[torch.nn.Module, list[list[int]]]]:
    """Each module owning trainable parameters directly, with its parameters split by dtype."""
    index_of = {id(param): index for index, param in enumerate(params)}
    owner: dict[int, str] = {}
    units = []
    for module_name, module in model.named_modules():
        by_dtype: dict[torch.dtype, list[int]] = {}
        for param in module.parameters(recurse=False):
            if id(param) not in index_of:
                continue
            if id(param) in owner:
                raise InvalidArgumentError(
                    f"ZeRO stage 3: parameter {names[index_of[id(param)]]!r} is registered in both module "
                    f"{owner[id(param)]!r} and {module_name!r}; shared (tied) parameters need stage 0-2")
            owner[id(param)] = module_name
            by_dtype.setdefault(param.dtype, []).append(index_of[id(param)])
        if by_dtype:
            units.append((module, list(by_dtype.values())))
    return units


def _digest(param: torch.Tensor) -> str:
    data = param.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.blake2b(data.numpy().tobytes(), digest_size=16).hexdigest()


def _check_same_on_every_rank(infos: list[ParamInfo], params: list[torch.nn.Parameter],
                              process_set: ProcessSet) -> None:
    mine = [(info, _digest(param)) for info, param in zip(infos, params)]
    every = hvd.allgather_object(mine, name="zero.wrap.parameters", process_set=process_set)
    reference = every[0]
    for set_rank, theirs in enumerate(every[1:], start=1):
        if len(theirs) != len(reference):
            raise InvalidArgumentError(f"ZeRO: rank {set_rank} of the process set has {len(theirs)} trainable "
                                       f"parameters, rank 0 has {len(reference)}: every rank must wrap the same model")
        for (info0, _), (info, _) in zip(reference, theirs):
            if info != info0:
                raise InvalidArgumentError(f"ZeRO: parameter {info.name!r} on rank {set_rank} of the process set "
                                           f"is {info}, on rank 0 {info0}: every rank must wrap the same model")
    for set_rank, theirs in enumerate(every[1:], start=1):
        for (info, digest0), (_, digest) in zip(reference, theirs):
            if digest != digest0:
                raise InvalidArgumentError(
                    f"ZeRO: parameter {info.name!r} has different values on rank {set_rank} and rank 0 of "
                    "the process set; initialise with the same seed or call "
                    "hvd.broadcast_parameters(model.state_dict(), root_rank=0) before wrapping")
