"""``ZeroOptimizer``: data parallelism that shards optimizer state (stage 1), gradients (stage 2)
and parameters (stage 3) over the data-parallel ranks, as DeepSpeed's ZeRO does.

Every rank builds the same model, with the same initial values (checked when it
is wrapped), and trains it on its own batch:

    opt = psrt.zero.ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=1e-3)
    loss = loss_fn(model(x), y)   # stage 3: parameters are gathered per unit (block) as it runs
    loss.backward()               # stages 2, 3: gradients reduce-scattered during backward
    opt.step()                    # the shard's update, then parameters gathered (stages 1, 2)
    opt.zero_grad()

Gradients are averaged over the set, as in ``hvd.DistributedOptimizer``.  Several
``backward()`` calls before ``step()`` accumulate gradients; stages 2 and 3 reduce after
each one, so only the gradient shard is kept between them.  ``step()`` consumes the
gradients.
"""
from __future__ import annotations

import functools
import warnings
from contextlib import contextmanager
from typing import Iterator

import torch

from psrt.background_save import SaveHandle
from psrt.errors import InvalidArgumentError
from psrt.runtime import Runtime, given, global_process_set
from psrt.topology import ProcessSet
from psrt.dp import Bucket, BucketStrategy, GradientReducer, overlap_pays_here
from psrt.zero import comm
from psrt.zero.flat import GatheredBytes, ShardedGroup, publish_all
from psrt.zero.precision import LossScaler
from psrt.zero.setup import plan_layout
from psrt.zero.stage3 import ParameterGatherer, Unit
from psrt.zero.units import BLOCKS, UnitsOption

#: Elements per gradient bucket: one reduce-scatter in stages 1-2 (and one all-gather of the
#: updated shards after the step), one allreduce in stage 0; DeepSpeed counts bucket sizes in
#: elements too.  One million elements (4 MB in fp32): each bucket is also one tensor for the
#: optimizer, and on CPU torch's Adam ran up to 2x slower on 5M-element tensors than on
#: 1M-element ones (benchmarks/RESULTS.md).
REDUCE_BUCKET_SIZE = 1_000_000
#: Stage 3: elements of parameters gathered ahead of the running unit, in forward and
#: backward order: DeepSpeed's prefetch bucket.  Units are added until the budget is spent,
#: so at least the next unit is prefetched and the last one may overshoot the budget.  One million
#: elements keeps about one layer of a 1024-wide MLP in flight.
ALLGATHER_BUCKET_SIZE = 1_000_000


class ZeroOptimizer:
    """Wrap ``model``'s trainable parameters and an optimizer of ``optimizer_class`` built on this
    rank's shards.

    Stage 0 is plain data parallelism through the same code (every rank keeps everything);
    stage 1 shards the optimizer state, stage 2 the gradients too, stage 3 the parameters too
    (gathered per unit, by default per repeated block, as forward and backward reach it).
    Gradients are averaged over ``process_set``, as in ``hvd.DistributedOptimizer``.

    Collective: every rank of ``process_set`` constructs it with the same model (same
    parameters, shapes and initial values), in the same order relative to other ZeRO optimizers
    over that set, then runs forward and backward through the model and calls ``step()``, in
    the same order (stages 2 and 3 communicate during backward, stage 3 during forward too).

    :param model: the model whose trainable (floating-point) parameters are trained; it must
        have at least one.
    :param optimizer_class: a ``torch.optim.Optimizer`` subclass such as ``torch.optim.AdamW``,
        built on this rank's shards.
    :param stage: 0, 1, 2 (the default) or 3.  Keyword only, as are all that follow.
    :param process_set: the data-parallel ranks the state is sharded and gradients averaged
        over; default ``global_process_set`` (every rank).
    :param compute_dtype: None (the default: the parameters' own dtype), ``torch.float32``,
        ``torch.bfloat16`` or ``torch.float16``: the model's parameters are cast to it for
        forward and backward, while master weights and optimizer state stay in the parameters'
        own dtype on the owning shard.
    :param loss_scale: None (the default: dynamic loss scaling for float16, none otherwise),
        ``"dynamic"``, or a fixed positive number; see :meth:`scale_loss`.
    :param reduce_bucket_size: elements per gradient bucket, a positive int (default
        :data:`REDUCE_BUCKET_SIZE`): one reduce-scatter in stages 1-2, one allreduce in stage 0.
    :param allgather_bucket_size: stage 3: elements of parameters gathered ahead of the running
        unit, a positive int (default :data:`ALLGATHER_BUCKET_SIZE`).
    :param units: stage 3: which modules gather their parameters together (:mod:`psrt.zero.units`):
        ``"blocks"`` (the default: each repeated block of an ``nn.ModuleList``/``ModuleDict``/
        ``Sequential``, as FSDP2's ``fully_shard`` is applied per transformer block, and a root
        unit, the whole model, for the other parameters), ``"modules"`` (each module that
        registers parameters itself, as DeepSpeed's ZeRO-3 hooks do), or a list of the model's
        modules (and the root unit for the rest).  Other stages check it and need none.
    :param overlap: start each bucket's reduce-scatter during backward (stages 2 and 3): True,
        False, or None (the default: where it can pay, as for ``DistributedOptimizer``, see
        ``psrt.dp.overlap_pays``).
    :param param_groups: the optimizer's parameter groups as torch takes them (a non-empty list
        of dicts, each with ``"params"`` and its own options, say ``weight_decay=0.0`` for
        biases and norms); every trainable parameter must be in exactly one group.  No flat
        group mixes two of them, so each shard's optimizer applies each group's options; the
        ``param_groups`` property is then one entry per group, in the order given, for LR
        schedulers.  Default None: one group of every trainable parameter.
    :param runtime: the psrt runtime it works in; default None: the current one.
    :param optimizer_kwargs: the options of ``optimizer_class`` (``lr``, ``momentum``,
        ``betas``, ...): every group's defaults, checked here by the optimizer itself.
    """

    #: its directory in an elastic commit: a psrt.stateful.ShardedStateful
    checkpoint_name = "zero"

    def __init__(self, model: torch.nn.Module, optimizer_class: type, *, stage: int = 2,
                 process_set: ProcessSet = global_process_set, compute_dtype: torch.dtype | None = None,
                 loss_scale: float | str | None = None, reduce_bucket_size: int = REDUCE_BUCKET_SIZE,
                 allgather_bucket_size: int = ALLGATHER_BUCKET_SIZE, overlap: bool | None = None,
                 param_groups: list[dict] | None = None, units: UnitsOption = BLOCKS,
                 runtime: Runtime | None = None, **optimizer_kwargs) -> None:
        self.runtime = given(runtime)
        self.loss_scaler = LossScaler.create(loss_scale, compute_dtype)
        layout = plan_layout(model, optimizer_class, optimizer_kwargs, runtime=self.runtime, stage=stage,
                             process_set=process_set,
                             compute_dtype=compute_dtype, reduce_bucket_size=reduce_bucket_size,
                             allgather_bucket_size=allgather_bucket_size, overlap=overlap, param_groups=param_groups,
                             units_option=units)
        self.model, self.stage, self.process_set, self.channel = model, stage, process_set, layout.channel
        self.partition, self.param_names, self.shard_index = layout.partition, layout.names, layout.shard
        self.aliases = layout.aliases  # other state_dict names of tied parameters -> their trained name
        self.optimizer_groups = [members for _, members in layout.optimizer_groups]
        self.overlap = (overlap_pays_here(layout.params, self.runtime.topology.local.size) if overlap is None
                        else overlap)
        name = self.runtime.names.instance("zero", process_set.process_set_id)
        meter = GatheredBytes()  # stage 3's gathered parameter bytes, kept by the groups
        self.groups = [ShardedGroup(f"{name}.{index}", self.partition, index, [layout.params[i] for i in flat.params],
                                    layout.shard, self.channel, compute_dtype, gathered_on_demand=stage == 3,
                                    keep_grad_buffer=stage >= 2 and self.channel.size == 1, meter=meter)
                       for index, flat in enumerate(self.partition.groups)]
        owner = [layout.optimizer_group_of(index) for index in range(len(self.groups))]
        self.optimizer = optimizer_class(
            [dict(options, params=[group.master for group, g in zip(self.groups, owner) if g == index])
             for index, (options, _) in enumerate(layout.optimizer_groups)], **optimizer_kwargs)
        self._group_of = {id(param): group for group in self.groups for param in group.params}
        self._reduced = False             # stages 0-1: this step's gradients are reduced
        self._step_ok: bool | None = None  # master gradients prepared: False if they overflowed
        params = [param for group in self.groups for param in group.params]
        name_of = {id(param): name for param, name in zip(layout.params, layout.names)}
        starts = [0]
        for group in self.groups:
            starts.append(starts[-1] + len(group.params))
        # Stages 2 and 3 reduce at the end of every backward (only the shard is kept between
        # backward passes); stages 0 and 1 once per step, in synchronize().
        self._reducer = GradientReducer(
            params, [range(start, stop) for start, stop in zip(starts, starts[1:])], _ReduceIntoShards(self),
            names=[group.name for group in self.groups],
            param_names=[name_of[id(param)] for param in params],
            overlap=self.overlap, hooks=stage >= 2, every_backward=stage >= 2)
        self.gatherer = None
        self._state_dict_allowed = stage < 3
        if stage == 3:
            self.gatherer = ParameterGatherer(
                [Unit(module, [self.groups[g] for g in groups]) for module, groups in layout.units],
                allgather_bucket_size, layout.shared_uses, meter)
            holders = [module for module in model.modules()
                       if any(id(param) in self._group_of for param in module.parameters(recurse=False))]
            for module in holders:  # every module registering a sharded parameter, whatever its unit
                module.register_state_dict_pre_hook(self._refuse_sharded_state_dict)
                # torch marks the hook with an attribute, which a bound method cannot take
                module.register_state_dict_post_hook(functools.partial(self._copy_gathered_entries))

    # -- torch.optim.Optimizer's surface --------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient: the parameters' and the shards'.  Also clears what a backward that
        raised left behind, so the next step starts clean.  It starts no communication (it waits for
        reductions a backward already started).

        :param set_to_none: accepted for torch's signature; ZeRO always frees the gradients.
        """
        self._reducer.wait()
        with torch._C.DisableTorchFunctionSubclass():  # a released stage-3 parameter's .grad, unchecked
            for group in self.groups:
                group.grad = None
                group.master.grad = None
                for param in group.params:
                    param.grad = None
        self._reduced, self._step_ok = False, None

    def step(self, closure=None):
        """Reduce gradients if not done yet, update this rank's shard, and make the updated
        parameters available (gathered now in stages 1 and 2, on use in stage 3).

        With dynamic loss scaling, a step whose gradients overflowed on any rank is skipped
        everywhere (the scale is lowered) and returns None.

        Collective: every rank of ``process_set`` calls it, in the same order.

        :param closure: called first, if given, to recompute the loss (as torch's ``step``);
            default None.
        :returns: the closure's loss; None without a closure or when the step was skipped.
        """
        loss = closure() if closure is not None else None
        taken = self._prepare_master_gradients()
        if taken:
            self.optimizer.step()
            publish_all(self.groups, self.channel)
        self.loss_scaler.finish_step(taken)
        self.zero_grad()
        return loss if taken else None

    # -- ZeRO-specific -------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish reducing this step's gradients into the shards (``step()`` does it otherwise).

        Stages 0 and 1 reduce here, once per step, every group on every rank (parameters
        without a gradient count as zeros); stages 2 and 3 already did during backward.

        Collective: every rank of ``process_set`` calls it, in the same order.
        """
        if self.stage <= 1 and not self._reduced:
            self._reduced = True
            self._reducer.synchronize()
        self._reducer.wait()

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale (1 without float16): call backward on this.

        :param loss: the loss of this rank's batch.
        """
        return self.loss_scaler.scale(loss)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the averaged gradients by their norm over every shard, as
        ``torch.nn.utils.clip_grad_norm_`` on the whole model; returns the total norm.

        Each rank's partial statistic is combined over the set before any scaling, so every
        shard is scaled by the same coefficient.  Call it after backward, before ``step()``.
        Gradients that overflowed (float16) are left alone: ``step()`` will skip them.

        Collective: every rank of ``process_set`` calls it, in the same order.

        :param max_norm: the largest norm the gradients keep.
        :param norm_type: the p of the p-norm: positive, or ``inf`` for the largest magnitude;
            default 2.0.
        :returns: the total norm before clipping (inf when the gradients overflowed).
        """
        norm_type = float(norm_type)
        if not norm_type > 0:
            raise ValueError(f"norm_type must be positive (or inf), got {norm_type}")
        if not self._prepare_master_gradients():
            return torch.tensor(float("inf"))
        grads = [group.master.grad for group in self.groups if group.master.grad is not None]
        if norm_type == float("inf"):
            partial = max((g.abs().max() for g in grads), default=torch.tensor(0.0)).double()
        else:
            partial = sum((g.double().abs().pow(norm_type).sum() for g in grads), torch.tensor(0.0).double())
        total = comm.total_norm(self.channel, partial.reshape(1), norm_type, self.partition.num_shards > 1)[0]
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(coefficient.to(grad.dtype))
        return total

    def save(self, directory: str, extra: dict | None = None, *, background: bool = False) -> SaveHandle | None:
        """Save a sharded checkpoint; see :func:`psrt.zero.save`.

        Collective: every rank of ``process_set`` calls it, in the same order.

        :param directory: where the shards go, the same on every rank (a shared file system when
            the ranks are on several hosts).
        :param extra: anything JSON can hold (e.g. the step count), returned by :meth:`load`;
            default None.
        :param background: return once the shards are copied, while a thread writes them; default
            False.
        :returns: the background save's handle (``wait()`` for it), or None.
        """
        from psrt.zero.checkpoint import save
        return save(self, directory, extra, background=background)

    def load(self, directory: str) -> dict | None:
        """Load a sharded checkpoint written by any number of ranks; returns its ``extra``.
        See :func:`psrt.zero.load`.

        Collective: every rank of ``process_set`` calls it, in the same order.

        :param directory: the checkpoint's directory, the same on every rank.
        :returns: the ``extra`` saved with it.
        """
        from psrt.zero.checkpoint import load
        return load(self, directory)

    @contextmanager
    def gathered_parameters(self) -> Iterator[None]:
        """Within the block, every parameter of the model holds its full value in the compute
        dtype, for reading: stage 3 gathers them all (do not run forward inside the block, which
        frees them again) and frees them on exit; other stages always hold them.
        ``model.state_dict()`` works inside the block and returns copies, which stay readable
        after it; a parameter read outside the block raises ``ParameterReleasedError``.  For
        fp32 masters use :meth:`save` and :func:`psrt.zero.consolidate`.

        Collective in stage 3: every rank of ``process_set`` enters the block, in the same order.
        """
        if self.gatherer is None:
            yield
            return
        for index in range(len(self.gatherer.units)):
            self.gatherer.gather(index)
        self._state_dict_allowed = True
        try:
            yield
        finally:
            self._state_dict_allowed = False
            self.gatherer.release_all()

    def unsharded_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's ``state_dict`` entries that ZeRO does not manage: buffers and frozen
        parameters (the same on every rank).  A managed parameter is left out under every name
        it has (a tied one's alias too), by identity."""
        allowed, self._state_dict_allowed = self._state_dict_allowed, True
        try:  # the parameters themselves (keep_vars): the sharded ones are dropped unread
            entries = self.model.state_dict(keep_vars=True)
        finally:
            self._state_dict_allowed = allowed
        return {name: tensor.detach() for name, tensor in entries.items() if id(tensor) not in self._group_of}

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds now in parameters, gradients and optimizer state (fp32 masters
        included when they are separate), read from the tensors' storages, each counted once."""
        from psrt.zero.memory import report
        return report(self)

    def _refuse_sharded_state_dict(self, module, prefix, keep_vars) -> None:
        """Stage 3 state_dict pre-hook: outside a forward/backward the parameters hold no values."""
        if not self._state_dict_allowed:
            raise InvalidArgumentError(
                "ZeRO stage 3: the model's parameters are sharded and hold no values outside their module's "
                "forward and backward; call state_dict() inside `with opt.gathered_parameters():`, or save "
                "with opt.save() and consolidate (psrt zero-to-full)")

    def _copy_gathered_entries(self, module, state_dict, prefix, local_metadata) -> None:
        """Stage 3 state_dict post-hook: a gathered parameter's entry becomes a copy, which stays
        readable once the gather ends and the parameter's memory is freed (``keep_vars=True``
        entries are the parameters themselves, and stay so)."""
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            entry = state_dict.get(prefix + name)
            if id(param) in self._group_of and entry is not None and entry is not param:
                state_dict[prefix + name] = entry.clone()

    def _prepare_master_gradients(self) -> bool:
        """Reduce, hand the shard gradients to the master copies and unscale them, once per step;
        False if the loss scaler found an overflow on some rank (the step must be skipped)."""
        if self._step_ok is not None:
            return self._step_ok
        self.synchronize()
        for group in self.groups:
            if group.grad is not None:
                group.master.grad = group.grad if group.master is group.shard else group.grad.to(group.master.dtype)
        masters = [group.master.grad for group in self.groups if group.master.grad is not None]
        self._step_ok = self.loss_scaler.unscale_(masters, self.channel)
        if not self._step_ok:
            warnings.warn(f"ZeRO: gradients overflowed; step skipped, loss scale lowered to "
                          f"{self.loss_scaler.value:g}")
        return self._step_ok


class _ReduceIntoShards(BucketStrategy):
    """ZeRO's bucket, a flat group: its gradients reduce-scattered into this rank's shard
    (averaged in place in stage 0); stage 3 frees the group's parameters once their gradients
    are in, and whatever is still gathered once backward's groups are reduced."""

    def __init__(self, zero: ZeroOptimizer) -> None:
        self.zero = zero

    def ready(self, bucket: Bucket) -> None:
        if self.zero.gatherer is not None:
            self.zero.groups[bucket.index].release()

    def launch(self, bucket: Bucket) -> None:
        bucket.started = self.zero.groups[bucket.index].start_reduction(wake=not bucket.awaited)

    def finish(self, bucket: Bucket) -> None:
        self.zero.groups[bucket.index].finish_reduction(bucket.started)

    def all_finished(self) -> None:
        if self.zero.gatherer is not None:
            self.zero.gatherer.release_all()
