"""Training a torch model against the parameter servers with the usual optimizer habits.

``DistributedOptimizer`` (the parameter-server counterpart of
``psrt.torch.DistributedOptimizer``) keys every parameter by its name,
initialises the keys from worker 0's parameters, and installs the wrapped
optimizer's class and hyperparameters on the servers, which from then on do
the updating.  Each gradient is pushed from its post-accumulate hook, so
pushes overlap the rest of backward, and its updated value is requested at
once; ``step()`` waits for the values and writes them into the parameters
before the next forward.  ``zero_grad()`` and LR schedulers work as usual: a
changed learning rate goes to the servers before the next step's first push.
"""
from __future__ import annotations

import functools
import inspect

import torch

from psrt.errors import ArgumentTypeError, InvalidArgumentError
from psrt.ps.client import KVStore
from psrt.ps.shard import optimizer_spec
from psrt.ps.handles import Handle
from psrt.dp import Bucket, BucketStrategy, GradientReducer, check_names


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None, *, mode: str | None = None,
                         max_staleness: int | None = None, reduce: str | None = None,
                         store: KVStore | None = None) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that its updates run on the parameter servers; returns an
    instance of the optimizer's own class (use it from then on).

    Each parameter group gets a store of its own (with the first store's settings), whose
    servers run the optimizer with that group's hyperparameters; the keys start from worker
    0's parameters, and every worker starts from the servers' values.  ``step()`` waits for
    the updated values of this step's pushes and writes them into the parameters.

    Collective: every worker wraps the same model the same way, in the same order as its other
    stores, then calls ``step()`` once per backward, and ``save(path)`` and ``load(path)``
    (checkpoints of the servers, see :meth:`KVStore.save`), in the same order (in ``"sync"``
    mode a step waits for every worker's gradients).  ``stats()`` merges its stores'
    :meth:`KVStore.stats`.

    :param optimizer: a ``torch.optim`` optimizer (the servers run its class), not already
        wrapped.
    :param named_parameters: ``(name, parameter)`` pairs naming the keys, e.g.
        ``model.named_parameters()``; default None: ``param.<i>`` in optimizer order.
    :param mode: the store's mode (see :class:`~psrt.ps.KVStore`); default None: ``"sync"``, or
        the given ``store``'s.  Keyword only.
    :param max_staleness: the store's bound with ``mode="bounded"``; default None.  Keyword only.
    :param reduce: ``"mean"`` or ``"sum"``; default None: ``"mean"``, or the given ``store``'s.
        Keyword only.
    :param store: a :class:`~psrt.ps.KVStore` to train against (to share it, or read its
        ``stats()``); its settings then rule, and a ``mode``, ``max_staleness`` or ``reduce`` that
        differs from them is an error.  Default None: a new store.  Keyword only.
    :returns: the wrapper, an instance of ``type(optimizer)``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ArgumentTypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, _PsOptimizer):
        raise InvalidArgumentError("optimizer is already a parameter-server DistributedOptimizer")
    base = type(optimizer)
    if getattr(torch.optim, base.__name__, None) is not base:
        raise InvalidArgumentError(f"the servers run torch.optim optimizers; {base.__name__} is not one")
    if store is None:
        store = KVStore(mode or "sync", max_staleness=max_staleness, reduce=reduce or "mean")
    else:
        _check_store(store, mode=mode, max_staleness=max_staleness, reduce=reduce)
    cls = _wrapped_class(base)
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update((key, value) for key, value in vars(optimizer).items() if key != "step")
    wrapped._setup_servers(base, named_parameters, store)
    return wrapped


def _check_store(store: object, **settings: object) -> None:
    """A given store's settings rule: refuse any setting also passed that differs from them."""
    if not isinstance(store, KVStore):
        raise ArgumentTypeError(f"store must be a psrt.ps.KVStore, got {type(store).__name__}")
    for name, value in settings.items():
        if value is not None and value != getattr(store, name):
            raise InvalidArgumentError(
                f"{name}={value!r} conflicts with the store passed as store=, which has {name}="
                f"{getattr(store, name)!r}: set {name} when making the KVStore, or leave it out here")


@functools.lru_cache(maxsize=None)
def _wrapped_class(base: type) -> type:
    return type(base.__name__, (_PsOptimizer, base), {"__module__": base.__module__})


def _hyperparameters(base: type, group: dict) -> dict:
    """The group's options that ``base`` takes as hyperparameters (what its servers run)."""
    accepted = set(inspect.signature(base.__init__).parameters) - {"self", "params"}
    options = {k: v for k, v in group.items() if k in accepted}
    if isinstance(options.get("lr"), torch.Tensor):
        options["lr"] = float(options["lr"])
    return options


class _PsOptimizer:
    """Mixin placed before the wrapped optimizer's class."""

    #: its directory in an elastic commit: a psrt.stateful.ShardedStateful
    checkpoint_name = "ps"

    def _setup_servers(self, base: type, named_parameters, store: KVStore) -> None:
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        if named_parameters is None:
            named = [(f"param.{i}", p) for i, p in enumerate(params)]
        else:
            in_optimizer = {id(p) for p in params}
            named = [(n, p) for n, p in check_names(list(named_parameters), params) if id(p) in in_optimizer]
        self.store = store  # the first group's; self.stores holds one per group
        self.steps_restored: int | None = None  # by the last load(): the steps the servers had applied
        self._named = named
        self._pulled = {name: torch.empty_like(p, device="cpu") for name, p in named}
        self._inflight: dict[str, Handle] = {}
        name_of = {id(p): name for name, p in named}
        self.stores, self._sent_lr, self._store_of = [], [], {}
        for index, group in enumerate(self.param_groups):
            group_store = store if index == 0 else KVStore(store.mode, max_staleness=store.max_staleness,
                                                           reduce=store.reduce, runtime=store.runtime)
            hyperparameters = _hyperparameters(base, group)
            group_store.set_optimizer(optimizer_spec(base, hyperparameters).name, **hyperparameters)
            for p in group["params"]:
                if id(p) in name_of:
                    group_store.init(name_of[id(p)], p.detach())
                    self._store_of[name_of[id(p)]] = group_store
            self.stores.append(group_store)
            self._sent_lr.append(hyperparameters.get("lr"))
        self._pull_parameters()
        # One bucket per parameter: each gradient is pushed as soon as backward completes it.
        self._reducer = GradientReducer([p for _, p in named], [[i] for i in range(len(named))], _Push(self),
                                        names=[name for name, _ in named], param_names=[name for name, _ in named])

    def _pull_parameters(self) -> None:
        """Every worker starts from (and, after a load, resumes with) the servers' values."""
        handles = [(p, self._store_of[name].pull_async(name, self._pulled[name])) for name, p in self._named]
        self._write(handles)

    @staticmethod
    def _write(handles: list[tuple[torch.Tensor, Handle]]) -> None:
        with torch.no_grad():
            for p, handle in handles:
                p.copy_(handle.wait())

    def _push(self, name: str, gradient: torch.Tensor) -> None:
        if not self._inflight:
            self._send_learning_rate()
        self._inflight[name] = self._store_of[name].push_pull_async(name, gradient, self._pulled[name])

    def _send_learning_rate(self) -> None:
        """Each group's learning rate, to its store, where a scheduler changed it."""
        for index, (group, group_store) in enumerate(zip(self.param_groups, self.stores)):
            lr = float(group["lr"]) if isinstance(group["lr"], torch.Tensor) else group["lr"]
            if lr != self._sent_lr[index]:
                group_store.set_learning_rate(lr)
                self._sent_lr[index] = lr

    def step(self, closure=None):
        """Wait for the servers' updated values and copy them into the parameters.
        A parameter that got no gradient this step pushes zeros, as in allreduce DP."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._reducer.synchronize()
        return loss

    def stats(self) -> dict:
        """The servers' counts for this optimizer's keys, over its stores (as
        :meth:`psrt.ps.KVStore.stats`): pushes applied and updates per key, and how many pulls
        were answered at each staleness."""
        merged: dict = {"pushes_applied": {}, "updates": {}, "staleness": {}, "max_staleness": 0}
        for group_store in self.stores:
            counts = group_store.stats()
            merged["pushes_applied"].update(counts["pushes_applied"])
            merged["updates"].update(counts["updates"])
            for lead, count in counts["staleness"].items():
                merged["staleness"][lead] = merged["staleness"].get(lead, 0) + count
            merged["max_staleness"] = max(merged["max_staleness"], counts["max_staleness"])
        merged["staleness"] = dict(sorted(merged["staleness"].items()))
        return merged

    def save(self, path: str, extra: dict | None = None) -> None:
        """Checkpoint the servers, every group's store, into ``path`` (see :meth:`KVStore.save`),
        with ``extra`` (anything JSON can hold, e.g. the epoch), which :meth:`load` returns.

        Collective: every worker calls it, in the same order, after the same step.
        """
        self.store.save(path, extra)

    def load(self, path: str) -> dict | None:
        """Restore a checkpoint into the servers and the model; returns the ``extra`` saved with
        it (:attr:`steps_restored` holds the steps the servers had applied), as
        ``ZeroOptimizer.load`` does.

        Collective: every worker calls it, in the same order.
        """
        self.steps_restored, extra = self.store.restore(path)
        self._pull_parameters()
        # the checkpoint brought its own learning rates: send this optimizer's before the next step
        self._sent_lr = [None] * len(self.stores)
        return extra


class _Push(BucketStrategy):
    """The parameter server's bucket, one parameter: its gradient pushed to the servers with a
    request for the updated value, which ``finish`` writes into the parameter."""

    def __init__(self, optimizer: _PsOptimizer) -> None:
        self.optimizer = optimizer

    def launch(self, bucket: Bucket) -> None:
        self.optimizer._push(bucket.name, bucket.params[0].grad)

    def finish(self, bucket: Bucket) -> None:
        handle = self.optimizer._inflight.pop(bucket.name)
        with torch.no_grad():
            bucket.params[0].copy_(handle.wait())

    def too_many_passes(self, name: str) -> BaseException:
        return InvalidArgumentError(f"the gradient of {name!r} was computed twice before step(): gradient "
                                    "accumulation is not supported by the parameter-server optimizer; call "
                                    "step() after every backward")
