"""Parameter-server mode against single-process and allreduce references, in one job.

Run with servers (``psrun -np 3 --num-servers 1 python ps_check.py``): every check
runs on the workers, which build their references themselves from the same seeds;
worker 0 prints one JSON line per check (see ``_harness``).  Stores are created
in the same order on every worker, one or more per check.
"""
from __future__ import annotations

import time

import torch

import psrt.ps as ps
import psrt.torch as hvd
from psrt.errors import ArgumentTypeError, InvalidArgumentError, ParameterServerError

import _harness
import _listeners
from _training_common import Mlp, assert_params_close, expect_raises, global_batch, loss_of, my_rows, zero_grads

STEPS = 4


def train(model, optimizer, key, *, distributed: bool, scheduler=None) -> None:
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=False)
        x, y = global_batch(key, step)
        if distributed:
            x, y = my_rows(x), my_rows(y)
        loss_of(model, x, y).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def check_sync_matches_references(key: str, make, with_scheduler: bool = False) -> None:
    """PS sync training equals allreduce DP on the same workers and one process on the whole batch."""
    trained = {}
    for kind in ("ps", "allreduce", "single"):
        model = Mlp(key)
        if kind == "single":
            zero_grads(model)  # the unused head steps with zero gradients, as in DP
        optimizer = make(model)
        if kind == "ps":
            optimizer = ps.DistributedOptimizer(optimizer, model.named_parameters(), mode="sync")
        elif kind == "allreduce":
            optimizer = hvd.DistributedOptimizer(optimizer, model.named_parameters())
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5) if with_scheduler else None
        train(model, optimizer, key, distributed=kind != "single", scheduler=scheduler)
        trained[kind] = model
    assert_params_close(trained["ps"], trained["allreduce"], "ps sync vs allreduce DP")
    assert_params_close(trained["ps"], trained["single"], "ps sync vs single process")


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=0.01)


def sgd_groups(model):
    """Two groups with different hyperparameters: each is a store of its own on the servers."""
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    weights = [p for name, p in model.named_parameters() if not name.endswith("bias")]
    return torch.optim.SGD([{"params": biases, "weight_decay": 0.0, "lr": 0.05}, {"params": weights}],
                           lr=0.1, momentum=0.9, weight_decay=0.01)


def least_squares(key: str, noise: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A well-conditioned problem A w = b; each worker owns some rows.  Without noise every
    worker's rows share the optimum, so however unevenly asynchronous workers progress,
    SGD must reach it."""
    gen = torch.Generator().manual_seed(len(key))
    a = torch.randn(16 * hvd.size(), 8, generator=gen, dtype=torch.float64)
    b = a @ torch.randn(8, 1, generator=gen, dtype=torch.float64) + noise * torch.randn(
        16 * hvd.size(), 1, generator=gen, dtype=torch.float64)
    return a, b, torch.linalg.lstsq(a, b).solution


def my_block(t: torch.Tensor) -> torch.Tensor:
    rows = t.shape[0] // hvd.size()
    return t[hvd.rank() * rows:(hvd.rank() + 1) * rows]


def gradient(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return 2.0 * a.T @ (a @ w - b) / a.shape[0]


def check_async_pushes_applied_exactly_once(key: str) -> None:
    kv = ps.KVStore("async", reduce="sum")
    kv.init(key, torch.zeros(1000))
    kv.init(key + "/small", torch.zeros(3))
    kv.set_optimizer("SGD", lr=1.0)
    pushes = 7
    handles = [kv.push_async(k, torch.full(t, -1.0)) for _ in range(pushes) for k, t in
               ((key, (1000,)), (key + "/small", (3,)))]
    for handle in handles:
        handle.wait()
    kv.pull(key)   # returns once this worker's own pushes are applied
    hvd.barrier()  # ... and now everyone's are
    expected = float(pushes * hvd.size())
    assert torch.equal(kv.pull(key), torch.full((1000,), expected)), "sum of every push"
    stats = kv.stats()
    for k in (key, key + "/small"):
        assert stats["pushes_applied"][k] == [pushes * hvd.size()] * len(stats["pushes_applied"][k]), stats


def check_async_least_squares_converges(key: str) -> None:
    a, b, optimum = least_squares(key, noise=0.0)
    kv = ps.KVStore("async")
    kv.init(key, torch.zeros(8, 1, dtype=torch.float64))
    kv.set_optimizer("SGD", lr=0.4)
    w = kv.pull(key)
    for _ in range(300):
        w = kv.push_pull(key, gradient(my_block(a), my_block(b), w))
    kv.pull(key)
    hvd.barrier()
    w = kv.pull(key)
    torch.testing.assert_close(w, optimum, atol=1e-8, rtol=0, msg=lambda m: f"async SGD optimum: {m}")


def run_with_slow_worker(kv: ps.KVStore, key: str, steps: int) -> None:
    """Every worker but 0 sleeps before each step."""
    kv.init(key, torch.zeros(64))
    kv.set_optimizer("SGD", lr=0.01)
    for _ in range(steps):
        if hvd.rank() != 0:
            time.sleep(0.03)
        kv.push_pull(key, torch.ones(64))
    hvd.barrier()


def check_bounded_holds_the_fast_worker_within_tau(key: str, tau: int) -> None:
    """Unbounded, worker 0 runs ahead by more than tau; bounded, it is held at exactly tau."""
    free = ps.KVStore("async")
    run_with_slow_worker(free, key + "/async", steps=12)
    bounded = ps.KVStore("bounded", max_staleness=tau)
    run_with_slow_worker(bounded, key, steps=12)
    seen, seen_async = bounded.stats()["max_staleness"], free.stats()["max_staleness"]
    assert seen_async > tau, f"without a bound the fast worker only got {seen_async} ahead: the test proves nothing"
    assert seen == tau, f"bounded mode answered pulls up to {seen} steps ahead of the slowest worker (tau {tau})"


def check_bounded_tau_0_equals_sync(key: str) -> None:
    a, b, _ = least_squares(key, noise=0.1)
    results = []
    for mode, options in (("sync", {}), ("bounded", {"max_staleness": 0})):
        kv = ps.KVStore(mode, **options)
        kv.init(key, torch.zeros(8, 1, dtype=torch.float64))
        kv.set_optimizer("SGD", lr=0.1)
        w = kv.pull(key)
        for step in range(10):
            if hvd.rank() == 1 and step % 3 == 0:
                time.sleep(0.01)  # bounded must wait for it, as sync does
            w = kv.push_pull(key, gradient(my_block(a), my_block(b), w))
        results.append(w)
    torch.testing.assert_close(results[0], results[1], rtol=1e-12, atol=1e-14)


# -- bad input ------------------------------------------------------------------------------------
def check_bad_keys_shapes_and_dtypes_raise_on_the_worker(key: str) -> None:
    kv = ps.KVStore("sync")
    kv.init(key, torch.zeros(2, 3))
    expect_raises(InvalidArgumentError, lambda: kv.push("never", torch.zeros(1)), "never initialised", "unknown key")
    expect_raises(InvalidArgumentError, lambda: kv.pull("never"), "never initialised", "pull unknown key")
    expect_raises(InvalidArgumentError, lambda: kv.push(key, torch.zeros(3, 2)), "shape [2, 3]", "wrong shape")
    expect_raises(InvalidArgumentError, lambda: kv.push(key, torch.zeros(2, 3, dtype=torch.float64)),
                  "torch.float32", "wrong dtype")
    expect_raises(InvalidArgumentError, lambda: kv.pull(key, out=torch.zeros(6)), "shape [2, 3]", "wrong out")
    expect_raises(InvalidArgumentError, lambda: kv.init(key, torch.zeros(4)), "already initialised",
                  "init twice")
    expect_raises(ArgumentTypeError, lambda: kv.push(key, [1, 2]), "torch.Tensor", "not a tensor")
    expect_raises(ArgumentTypeError, lambda: kv.push(3, torch.zeros(2, 3)), "key must be a str", "int key")
    expect_raises(InvalidArgumentError, lambda: ps.KVStore("eventual"), "mode must be", "bad mode")
    expect_raises(InvalidArgumentError, lambda: ps.KVStore("bounded"), "max_staleness", "no tau")
    expect_raises(InvalidArgumentError, lambda: ps.KVStore("sync", reduce="median"), "reduce", "bad reduce")
    expect_raises(InvalidArgumentError, lambda: kv.set_learning_rate(-1.0), "learning rate", "negative lr")
    expect_raises(InvalidArgumentError, lambda: kv.set_optimizer("Sgdd", lr=0.1), "unknown optimizer", "optimizer")
    kv.set_optimizer("SGD", lr=0.1)
    assert kv.push_pull(key, torch.ones(2, 3)).shape == (2, 3), "the store still works"


def check_optimizer_refuses_settings_that_conflict_with_its_store(key: str) -> None:
    """store= with a mode, staleness or reduction other than the store's is refused (it used
    to be ignored); the same settings are accepted, and stats() reports the store's counts."""
    kv = ps.KVStore("bounded", max_staleness=2, reduce="sum")

    def wrap(**settings):
        model = Mlp(key)
        return ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                       store=kv, **settings)

    expect_raises(InvalidArgumentError, lambda: wrap(mode="async"),
                  "mode='async' conflicts with the store passed as store=, which has mode='bounded'", "mode")
    expect_raises(InvalidArgumentError, lambda: wrap(max_staleness=1),
                  "max_staleness=1 conflicts with the store passed as store=, which has max_staleness=2", "staleness")
    expect_raises(InvalidArgumentError, lambda: wrap(reduce="mean"),
                  "reduce='mean' conflicts with the store passed as store=, which has reduce='sum'", "reduce")
    expect_raises(ArgumentTypeError, lambda: ps.DistributedOptimizer(torch.optim.SGD(Mlp(key).parameters(), lr=0.1),
                                                                     store="kv"),
                  "store must be a psrt.ps.KVStore, got str", "store of the wrong type")
    wrap(mode="bounded", max_staleness=2, reduce="sum")  # the store's own settings are accepted
    # stats() on a sync store, where step() returns only once every worker's push is applied
    model = Mlp(key + "/stats")
    optimizer = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                        store=ps.KVStore("sync"), mode="sync")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    stats = optimizer.stats()
    applied = stats["pushes_applied"]  # per key, per chunk: one push from every worker
    assert set(applied) == {name for name, _ in Mlp(key).named_parameters()} and all(
        count == hvd.size() for chunks in applied.values() for count in chunks), \
        f"pushes applied {stats['pushes_applied']}"


def check_workers_init_a_key_with_different_shapes(key: str) -> None:
    kv = ps.KVStore("sync")
    shape = (4,) if hvd.rank() == 0 else (2, 2)
    errors = []
    try:
        kv.init(key, torch.zeros(shape))
    except ParameterServerError as e:
        errors.append(str(e))
    everyone = hvd.allgather_object(errors)
    texts = [t for theirs in everyone for t in theirs]
    assert len(texts) == hvd.size() - 1, f"expected every worker but the first to fail, got {everyone}"
    assert "[2, 2]" in texts[0] and "[4]" in texts[0] and repr(key) in texts[0], texts[0]


def check_workers_create_a_store_with_different_modes(key: str) -> None:
    errors = []
    try:
        ps.KVStore("sync" if hvd.rank() == 0 else "async")
    except ParameterServerError as e:
        errors.append(str(e))
    texts = [t for theirs in hvd.allgather_object(errors) for t in theirs]
    assert texts, "no worker was told the modes disagree"
    assert "'sync'" in texts[0] and "'async'" in texts[0], texts[0]


def check_a_failing_server_update_is_reported_to_the_worker(key: str) -> None:
    kv = ps.KVStore("sync")
    kv.init(key, torch.zeros(5))
    kv.set_optimizer("SparseAdam", lr=0.5)  # builds, then fails on the first dense gradient
    expect_raises(ParameterServerError, lambda: kv.push_pull(key, torch.ones(5)),
                  f"updating key {key!r}", "server-side failure")
    expect_raises(ParameterServerError, lambda: kv.pull(key), "SparseAdam", "the chunk stays failed")
    expect_raises(InvalidArgumentError, lambda: kv.init(key + "/int", torch.zeros(2, dtype=torch.int64)),
                  "reduce='sum'", "integer key in a mean store")
    other = ps.KVStore("sync")  # the server lives on
    other.init(key, torch.zeros(2))
    assert torch.equal(other.push_pull(key, torch.ones(2)), torch.ones(2))


def main() -> None:
    hvd.init()
    torch.optim.SGD([torch.zeros(1, requires_grad=True)])  # pay torch's lazy imports before the clocks
    assert ps.num_servers() >= 1 and ps.num_workers() == hvd.size() and ps.worker_rank() == hvd.rank()
    checks = _harness.Checks()
    checks.add("sync/sgd_momentum_matches_allreduce_and_single_process", check_sync_matches_references, sgd)
    checks.add("sync/adam_matches_allreduce_and_single_process", check_sync_matches_references, adam)
    checks.add("sync/lr_scheduler_reaches_the_servers", check_sync_matches_references, sgd, True)
    checks.add("sync/param_groups_match_allreduce_and_single_process", check_sync_matches_references, sgd_groups)
    checks.add("sync/param_groups_follow_the_lr_scheduler", check_sync_matches_references, sgd_groups, True)
    checks.add("async/every_push_applied_exactly_once", check_async_pushes_applied_exactly_once)
    checks.add("async/least_squares_converges", check_async_least_squares_converges)
    checks.add("bounded/holds_the_fast_worker_within_tau_1", check_bounded_holds_the_fast_worker_within_tau, 1)
    checks.add("bounded/holds_the_fast_worker_within_tau_2", check_bounded_holds_the_fast_worker_within_tau, 2)
    checks.add("bounded/tau_0_equals_sync", check_bounded_tau_0_equals_sync)
    checks.add("errors/bad_keys_shapes_and_dtypes", check_bad_keys_shapes_and_dtypes_raise_on_the_worker)
    checks.add("errors/workers_init_different_shapes", check_workers_init_a_key_with_different_shapes)
    checks.add("errors/optimizer_settings_conflict_with_its_store",
               check_optimizer_refuses_settings_that_conflict_with_its_store)
    checks.add("errors/workers_disagree_on_the_mode", check_workers_create_a_store_with_different_modes)
    checks.add("errors/failing_server_update_is_reported", check_a_failing_server_update_is_reported_to_the_worker)
    checks.add("listeners/only_the_launcher_listens_beyond_loopback",
               _listeners.check_only_the_launcher_listens_beyond_loopback)
    _harness.run(checks)
    hvd.shutdown()


if __name__ == "__main__":
    main()
