"""torch.distributed's consumers on psrt's backend against one process and against gloo
(``psrun -np 2|4 python torch_backend_check.py``).

The default group is started by ``dist.init_process_group("psrt")`` with no ``MASTER_ADDR``
(psrt's ``env://`` start-up from MPI); a gloo group over the same ranks, made from its store,
runs the same collectives for comparison.  Every collective, in float32, float64, bfloat16,
float16 and int32 where torch allows, must give gloo's result (an average: gloo's sum over
the size; gloo has no average).  DDP (several buckets, ``no_sync``), FSDP2 (full precision
and bf16 parameters with fp32 reductions), DTensor tensor parallelism (on 4 ranks a 2-D
mesh of FSDP × TP, whose sub-groups psrt makes for their members only),
``torch.distributed.pipelining`` with ``Schedule1F1B``, distributed checkpoints (saved at
this size, loaded here and in one process; with psrt's checksums, a flipped byte refused on
every rank) and a Lightning ``Trainer`` with
``DDPStrategy(process_group_backend="psrt")`` each train a few steps and must match the same
computation in one process.  On 2 ranks, transformers' ``Trainer`` (examples/trainer_hf.py)
must end with gloo's parameters.  torchrun's ``RANK``, ``LOCAL_RANK`` and the rest, which psrun
sets, must say each rank's place.
"""
from __future__ import annotations

import copy
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import psrt.runtime
import psrt.torch as hvd
from psrt.errors import CollectiveMismatchError, InvalidArgumentError, UnsupportedOperationError

import _harness
import _listeners
from _training_common import expect_raises

warnings.filterwarnings("ignore", category=FutureWarning)  # torch's renamed *_into_tensor calls
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32)
STEPS, LR = 3, 0.05
EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def values(shape: tuple[int, ...], dtype: torch.dtype, salt: int) -> torch.Tensor:
    """Small integers, different on every rank: exact in every dtype, whatever the order of a sum."""
    generator = torch.Generator().manual_seed(1000 * dist.get_rank() + salt)
    return torch.randint(-3, 4, shape, generator=generator).to(dtype)


def against_gloo(gloo: dist.ProcessGroup, dtypes: tuple[torch.dtype, ...], run) -> None:
    """``run(group, dtype)`` returns tensors; psrt's default group must give gloo's."""
    for dtype in dtypes:
        mine, theirs = run(None, dtype), run(gloo, dtype)
        assert len(mine) == len(theirs), f"{dtype}: {len(mine)} results against gloo's {len(theirs)}"
        for got, want in zip(mine, theirs):
            assert got.dtype == want.dtype and got.shape == want.shape, f"{dtype}: {got.dtype}{tuple(got.shape)}"
            assert torch.equal(got, want), f"{dtype}: psrt {got.flatten()[:6]} gloo {want.flatten()[:6]}"


def collective_checks(gloo: dist.ProcessGroup) -> dict:
    n, rank = dist.get_world_size(), dist.get_rank()
    floats = DTYPES[:4]

    def all_reduce(op):
        def run(group, dtype):
            t = values((5, 3), dtype, 1)
            dist.all_reduce(t, op=op, group=group)
            return [t]
        return run

    def average(group, dtype):
        t = values((6,), dtype, 2)
        if group is None:
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
        else:
            dist.all_reduce(t, group=group)
            t = t / n
        return [t]

    def broadcast(group, dtype):
        t = values((3, 2), dtype, 3)
        dist.broadcast(t, src=n - 1, group=group)
        return [t]

    def all_gather(group, dtype):
        parts = [torch.empty((2, 3), dtype=dtype) for _ in range(n)]
        dist.all_gather(parts, values((2, 3), dtype, 4), group=group)
        return parts

    def all_gather_into_tensor(group, dtype):
        out = torch.empty((2 * n, 3), dtype=dtype)
        dist.all_gather_into_tensor(out, values((2, 3), dtype, 5), group=group)
        return [out]

    def reduce_scatter_tensor(group, dtype):
        out = torch.empty((2, 3), dtype=dtype)
        dist.reduce_scatter_tensor(out, values((2 * n, 3), dtype, 6), group=group)
        return [out]

    def reduce_scatter_tensor_average(group, dtype):  # what FSDP2 sends its fp32/bf16 gradients through
        out = torch.empty((4,), dtype=dtype)
        if group is None:
            dist.reduce_scatter_tensor(out, values((4 * n,), dtype, 7), op=dist.ReduceOp.AVG)
            return [out]
        dist.reduce_scatter_tensor(out, values((4 * n,), dtype, 7), group=group)
        return [out / n]

    def reduce_scatter_tensor_premul_sum(group, dtype):  # FSDP2's, with a gradient divide factor
        out = torch.empty((4,), dtype=dtype)
        if group is None:
            dist.reduce_scatter_tensor(out, values((4 * n,), dtype, 19), op=dist._make_nccl_premul_sum(0.5))
            return [out]
        dist.reduce_scatter_tensor(out, values((4 * n,), dtype, 19), group=group)
        return [out * 0.5]

    def reduce_scatter(group, dtype):
        out = torch.empty((3,), dtype=dtype)
        dist.reduce_scatter(out, [values((3,), dtype, 8 + r) for r in range(n)], group=group)
        return [out]

    def all_to_all_single_uneven(group, dtype):
        sends = [1 + (rank + r) % 3 for r in range(n)]  # rows to member r
        receives = [1 + (r + rank) % 3 for r in range(n)]  # rows from member r
        out = torch.empty((sum(receives), 2), dtype=dtype)
        dist.all_to_all_single(out, values((sum(sends), 2), dtype, 9), receives, sends, group=group)
        return [out]

    def all_to_all_single_zero_rows(group, dtype):  # rank 0 sends nothing to the last rank, which sends it none
        sends = [0 if {rank, r} == {0, n - 1} else 2 for r in range(n)]
        out = torch.empty((sum(sends), 3), dtype=dtype)  # what a rank sends r, r sends it (symmetric)
        dist.all_to_all_single(out, values((sum(sends), 3), dtype, 20), sends, sends, group=group)
        return [out]

    def all_to_all_single_even(group, dtype):  # no split sizes: dim 0 split evenly
        out = torch.empty((2 * n, 2), dtype=dtype)
        dist.all_to_all_single(out, values((2 * n, 2), dtype, 21), group=group)
        return [out]

    def non_contiguous(group, dtype):
        """Columns of a matrix, reduced and broadcast in place; gloo (which reads such a
        view as if it were contiguous, and gets it wrong) gets contiguous copies."""
        a, b = values((4, 6), dtype, 22), values((4, 6), dtype, 23)
        for view, call in ((a[:, 1::2], lambda t: dist.all_reduce(t, group=group)),
                           (b.t()[2:], lambda t: dist.broadcast(t, src=n - 1, group=group))):
            if group is None:
                call(view)
            else:
                copy = view.contiguous()
                call(copy)
                view.copy_(copy)
        return [a, b]

    def all_to_all(group, dtype):  # gloo's takes equal sizes only
        outs = [torch.empty((2,), dtype=dtype) for r in range(n)]
        dist.all_to_all(outs, [values((2,), dtype, 10 + r) for r in range(n)], group=group)
        return outs

    def gather(group, dtype):
        parts = [torch.empty((3,), dtype=dtype) for _ in range(n)] if rank == 1 else None
        dist.gather(values((3,), dtype, 11), parts, dst=1, group=group)
        return parts or []

    def scatter(group, dtype):
        out = torch.empty((2, 2), dtype=dtype)
        dist.scatter(out, [values((2, 2), dtype, 12 + r) for r in range(n)] if rank == 0 else None, src=0, group=group)
        return [out]

    def reduce(group, dtype):
        t = values((4,), dtype, 13)
        dist.reduce(t, dst=n - 1, group=group)
        if rank != n - 1:  # gloo leaves partial results there; psrt leaves the tensor as it was
            assert group is not None or torch.equal(t, values((4,), dtype, 13)), "reduce changed a non-root tensor"
            return []
        return [t]

    def send_recv_ring(group, dtype):
        into = torch.empty((2, 2), dtype=dtype)
        ops = [dist.P2POp(dist.isend, values((2, 2), dtype, 14), (rank + 1) % n, group),
               dist.P2POp(dist.irecv, into, (rank - 1) % n, group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return [into]

    def asynchronous(group, dtype):
        t, out = values((8,), dtype, 15), torch.empty((n * 8,), dtype=dtype)
        works = [dist.all_reduce(t, group=group, async_op=True),
                 dist.all_gather_into_tensor(out, values((8,), dtype, 16), group=group, async_op=True)]
        for work in works:
            work.wait()
        return [t, out]

    def coalesced(group, dtype):
        tensors = [values((3,), dtype, 17), values((2, 2), dtype, 18)]
        with dist._coalescing_manager(group=group):
            for t in tensors:
                dist.all_reduce(t, group=group)
        return tensors

    return {"all_reduce/sum": (all_reduce(dist.ReduceOp.SUM), DTYPES),
            "all_reduce/min": (all_reduce(dist.ReduceOp.MIN), DTYPES),
            "all_reduce/max": (all_reduce(dist.ReduceOp.MAX), DTYPES),
            "all_reduce/product": (all_reduce(dist.ReduceOp.PRODUCT), (torch.float64, torch.int32)),
            "all_reduce/avg": (average, floats), "broadcast": (broadcast, DTYPES),
            "all_gather": (all_gather, DTYPES), "all_gather_into_tensor": (all_gather_into_tensor, DTYPES),
            "reduce_scatter_tensor/sum": (reduce_scatter_tensor, DTYPES),
            "reduce_scatter_tensor/avg": (reduce_scatter_tensor_average, (torch.float32, torch.bfloat16)),
            "reduce_scatter_tensor/premul_sum": (reduce_scatter_tensor_premul_sum, (torch.float32, torch.bfloat16)),
            "reduce_scatter": (reduce_scatter, DTYPES), "all_to_all_single/uneven": (all_to_all_single_uneven, DTYPES),
            "all_to_all_single/zero_rows": (all_to_all_single_zero_rows, DTYPES),
            "all_to_all_single/even_without_sizes": (all_to_all_single_even, DTYPES),
            "non_contiguous_in_place": (non_contiguous, DTYPES),
            "all_to_all": (all_to_all, DTYPES), "gather": (gather, DTYPES), "scatter": (scatter, DTYPES),
            "reduce": (reduce, DTYPES), "send_recv/batch_isend_irecv_ring": (send_recv_ring, DTYPES),
            "async_op/wait": (asynchronous, floats), "coalescing_manager": (coalesced, floats)}


def check_collective(name: str, gloo: dist.ProcessGroup, run, dtypes) -> None:
    against_gloo(gloo, dtypes, run)


def check_rooted_on_a_subgroup(name: str, gloo_world: dist.ProcessGroup) -> None:
    """Roots and peers are global ranks in torch's calls and group ranks inside the backend:
    on rank 0 and the odd ranks, with the last member (global rank n - 1) as the root,
    broadcast, gather, scatter, reduce and a send to the root must give gloo's result."""
    n, rank = dist.get_world_size(), dist.get_rank()
    members = [0, *range(1, n, 2)]
    groups = {"psrt": dist.new_group(members), "gloo": dist.new_group(members, backend="gloo")}
    if rank not in members:
        return
    root, first = members[-1], members[1] if len(members) > 2 else 0
    results = {}
    for label, group in groups.items():
        b, t, out = values((3,), torch.float32, 30), values((3,), torch.float32, 31), torch.empty(3)
        dist.broadcast(b, src=root, group=group)
        parts = [torch.empty(3) for _ in members] if rank == root else None
        dist.gather(values((3,), torch.float32, 32), parts, dst=root, group=group)
        dist.scatter(out, [values((3,), torch.float32, 33 + i) for i in members] if rank == root else None,
                     src=root, group=group)
        dist.reduce(t, dst=root, group=group)
        got = torch.empty(3)
        if rank == first:
            dist.send(values((3,), torch.float32, 40), dst=root, group=group)
        elif rank == root:
            dist.recv(got, src=first, group=group)
        results[label] = [b, out, *(parts or []), *([t, got] if rank == root else [])]
    for mine, theirs in zip(results["psrt"], results["gloo"], strict=True):
        assert torch.equal(mine, theirs), f"psrt {mine} gloo {theirs}"


def check_wrong_outputs_refused_before_communication(name: str) -> None:
    """Outputs that cannot hold the result are an error on this rank before any
    communication (gloo raises likewise); the group goes on afterwards."""
    n = dist.get_world_size()
    expect_raises(InvalidArgumentError, lambda: dist.all_gather([torch.empty(2)], torch.ones(2)),
                  "tensor_list holds 1 tensors", "short all_gather list")
    expect_raises(InvalidArgumentError, lambda: dist.all_gather([torch.empty(3)] * n, torch.ones(2)),
                  "tensor_list[0] is a torch.float32 tensor of shape (3,)", "wrong all_gather sizes")
    expect_raises(InvalidArgumentError, lambda: dist.all_to_all_single(torch.empty(2 * n, 1), torch.ones(2 * n, 2)),
                  "cannot hold rows of torch.float32 of shape (2,)", "narrow all_to_all_single output")
    expect_raises(InvalidArgumentError, lambda: dist.all_gather_into_tensor(torch.empty(n, dtype=torch.int32),
                                                                            torch.ones(1)),
                  "the output holds", "all_gather_into_tensor of another dtype")
    dist.barrier()


def check_different_roots_and_a_lone_barrier_name_the_ranks(name: str) -> None:
    rank = dist.get_rank()
    expect_raises(CollectiveMismatchError, lambda: dist.reduce(torch.ones(2), dst=0 if rank else 1),
                  "reduce from rank", "different roots")
    call = dist.barrier if rank == 0 else (lambda: dist.all_reduce(torch.ones(2)))
    expect_raises(CollectiveMismatchError, call, "has barrier", "a barrier against an all_reduce")
    dist.barrier()


def check_destroyed_groups_are_freed(name: str) -> None:
    topology = psrt.runtime.current().topology
    before = len(topology._made_for_others)
    for _ in range(3):
        group = dist.new_group(list(range(dist.get_world_size())))
        dist.all_reduce(torch.ones(1), group=group)
        dist.destroy_process_group(group)
    assert len(topology._made_for_others) == before, (before, len(topology._made_for_others))


def check_barrier_and_objects(name: str) -> None:
    dist.barrier()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"rank": dist.get_rank()})
    assert everyone == [{"rank": r} for r in range(dist.get_world_size())], everyone


def check_mismatched_shapes_name_the_ranks(name: str) -> None:
    """gloo would fail with a size error on some ranks (or not at all); psrt names both."""
    shape = (4,) if dist.get_rank() == 0 else (5,)
    expect_raises(CollectiveMismatchError, lambda: dist.all_reduce(torch.ones(shape)),
                  "rank 0 has all_reduce of a float32 tensor of shape (4,)" if dist.get_rank() else
                  "has all_reduce of a float32 tensor of shape (5,)", "mismatched shapes")
    dist.barrier()  # the group goes on after the error


def check_different_collectives_name_the_ranks(name: str) -> None:
    """Rank 0 broadcasts while the others all-reduce: an error on every rank, never a
    broadcast matched with an all-reduce."""
    t = torch.ones(3)
    call = (lambda: dist.broadcast(t, src=0)) if dist.get_rank() == 0 else (lambda: dist.all_reduce(t))
    expect_raises(CollectiveMismatchError, call, "broadcast from rank 0 of a float32 tensor of shape (3,)",
                  "different collectives")
    dist.barrier()


def check_process_group_over_a_process_set(name: str) -> None:
    """psrt.torch.process_group over the even ranks: torch's collectives and a DeviceMesh on
    it, and NON_GROUP_MEMBER elsewhere."""
    from torch.distributed.device_mesh import DeviceMesh

    evens = hvd.add_process_set(list(range(0, dist.get_world_size(), 2)))
    group = hvd.process_group(evens)
    assert hvd.process_group() is dist.group.WORLD
    if dist.get_rank() % 2:
        assert group is dist.GroupMember.NON_GROUP_MEMBER, group
        return
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=group)
    assert t.item() == sum(range(0, dist.get_world_size(), 2)), t
    mesh = DeviceMesh.from_group(group, "cpu")
    assert mesh.size() == evens.size() and dist.get_world_size(mesh.get_group()) == evens.size()


def check_unsupported_reduction(name: str) -> None:
    expect_raises(UnsupportedOperationError, lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32),
                                                                   op=dist.ReduceOp.BAND), "no BAND", "BAND")


# -- consumers ---------------------------------------------------------------------------
def mlp(width: int = 8, depth: int = 4, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def batches(rows: int, width: int = 8, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [(torch.randn(rows, width, generator=generator), torch.randn(rows, width, generator=generator))
            for _ in range(steps)]


def local_rows(x: torch.Tensor) -> torch.Tensor:
    return x.chunk(dist.get_world_size())[dist.get_rank()]


def reference(model: nn.Module, data) -> nn.Module:
    """The same steps in one process on the global batches."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in data:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model


def assert_close(got: dict, want: dict, tol: float, what: str) -> None:
    for key, value in want.items():
        mine = got[key]
        mine = mine.full_tensor() if hasattr(mine, "full_tensor") else mine
        error = (mine.detach().float() - value.detach().float()).abs().max().item()
        assert error <= tol, f"{what}: {key} differs by {error:.3g} (tolerance {tol:g})"


def check_ddp(name: str, gloo: dist.ProcessGroup) -> None:
    """Several buckets, and every other step accumulated under no_sync; psrt and gloo alike."""
    n = dist.get_world_size()
    data = batches(4 * n, steps=2 * STEPS)
    merged = [(torch.cat([x, x2]), torch.cat([y, y2])) for (x, y), (x2, y2) in zip(data[::2], data[1::2])]
    want = reference(mlp(), merged).state_dict()
    for group in (None, gloo):
        model = nn.parallel.DistributedDataParallel(mlp(), process_group=group, bucket_cap_mb=0.0005)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for step in range(STEPS):
            opt.zero_grad()
            (x, y), (x2, y2) = data[2 * step], data[2 * step + 1]
            with model.no_sync():
                (nn.functional.mse_loss(model(local_rows(x)), local_rows(y)) / 2).backward()
            (nn.functional.mse_loss(model(local_rows(x2)), local_rows(y2)) / 2).backward()
            opt.step()
        assert_close(model.module.state_dict(), want, 1e-5, f"DDP over {'gloo' if group else 'psrt'}")


def check_fsdp2(name: str, gloo: dist.ProcessGroup, mixed: bool) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    n = dist.get_world_size()
    data = batches(2 * n)
    want = reference(mlp(), data).state_dict()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed \
        else MixedPrecisionPolicy()
    results = []
    for group in (None, gloo):
        mesh = DeviceMesh.from_group(group or dist.group.WORLD, "cpu")
        model = mlp()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for x, y in data:
            opt.zero_grad()
            nn.functional.mse_loss(model(local_rows(x)).float(), local_rows(y)).backward()
            opt.step()
        state = {k: v.full_tensor() for k, v in model.state_dict().items()}
        results.append(state)
        assert_close(state, want, 5e-2 if mixed else 1e-5, f"FSDP2 over {'gloo' if group else 'psrt'}")
    assert_close(results[0], results[1], 1e-6, "FSDP2 over psrt against gloo")  # sums in another order


def check_dtensor_tp(name: str, gloo: dist.ProcessGroup) -> None:
    """ColwiseParallel then RowwiseParallel on each pair of layers, over every rank on psrt
    and on gloo; on 4 ranks also a 2-D mesh that shards the same model with FSDP2 over "dp"
    (sub-groups made by their members only)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    n = dist.get_world_size()
    data = batches(4)
    want = reference(mlp(), data).state_dict()
    meshes = {"psrt": init_device_mesh("cpu", (n,)), "gloo": DeviceMesh.from_group(gloo, "cpu")}
    if n == 4:
        meshes["psrt 2-D"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    results = {}
    for label, mesh in meshes.items():
        two_d = mesh.ndim == 2
        model = mlp()
        plan = {str(i): ColwiseParallel() if i % 4 == 0 else RowwiseParallel() for i in range(0, 7, 2)}
        parallelize_module(model, mesh["tp"] if two_d else mesh, plan)
        dp, dp_rank = (2, mesh.get_local_rank("dp")) if two_d else (1, 0)
        if two_d:
            fully_shard(model, mesh=mesh["dp"])
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        for x, y in data:
            opt.zero_grad()
            nn.functional.mse_loss(model(x.chunk(dp)[dp_rank]), y.chunk(dp)[dp_rank]).backward()
            opt.step()
        results[label] = {k: v.full_tensor() for k, v in model.state_dict().items()}
        assert_close(results[label], want, 1e-5, f"DTensor TP over {label}")
    assert_close(results["psrt"], results["gloo"], 1e-6, "DTensor TP over psrt against gloo")


def check_pipelining_1f1b(name: str, gloo: dist.ProcessGroup) -> None:
    """One stage per rank (two layers each), four micro-batches, on psrt and on gloo."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    n, rank = dist.get_world_size(), dist.get_rank()
    data = batches(8)
    want = reference(mlp(depth=2 * n), data).state_dict()
    results = []
    for group in (None, gloo):
        full = mlp(depth=2 * n)
        layers = [m for m in full if isinstance(m, nn.Linear)]
        mine = nn.Sequential(layers[2 * rank], nn.Tanh(), layers[2 * rank + 1], *([nn.Tanh()] if rank < n - 1 else []))
        stage = PipelineStage(mine, rank, n, torch.device("cpu"), group=group)
        schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=nn.functional.mse_loss)
        opt = torch.optim.SGD(mine.parameters(), lr=LR)
        for x, y in data:
            opt.zero_grad()
            if rank == 0:
                schedule.step(x)
            elif rank == n - 1:
                schedule.step(target=y)
            else:
                schedule.step()
            opt.step()
        names = {id(p): k for k, p in full.named_parameters()}
        results.append({names[id(p)]: p.detach().clone() for p in mine.parameters()})
        assert_close(results[-1], {k: v for k, v in want.items() if k in results[-1]}, 1e-5,
                     f"pipelining 1F1B over {'gloo' if group else 'psrt'}")
    assert_close(results[0], results[1], 0.0, "pipelining 1F1B over psrt against gloo")


def shared_directory() -> str:
    """A new temporary directory, made by rank 0, named to every rank."""
    holder = [tempfile.mkdtemp(prefix="psrt-dcp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def check_dcp(name: str) -> None:
    """An FSDP2 model saved by every rank loads into another FSDP2 model and, in one
    process (no_dist), into a plain one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    path = shared_directory()
    trained = mlp(seed=3)
    want = copy.deepcopy(trained).state_dict()
    fully_shard(trained)
    dcp.save(trained.state_dict(), checkpoint_id=path)
    fresh = mlp(seed=4)
    fully_shard(fresh)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state)
    assert_close(fresh.state_dict(), want, 0.0, "dcp load at the same size")
    dist.barrier()
    if dist.get_rank() == 0:
        alone = mlp(seed=5).state_dict()
        dcp.load(alone, checkpoint_id=path, no_dist=True)
        assert_close(alone, want, 0.0, "dcp load in one process")
        shutil.rmtree(path)
    dist.barrier()


def check_dcp_checksums(name: str) -> None:
    """An FSDP2 model saved with psrt's checksummed writer loads equal through its reader;
    once a byte of the last rank's file is flipped, every rank's load is refused naming that
    file (the last rank's error, gathered by DCP's planning) and no rank's shards changed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.fsdp import fully_shard

    from psrt.checkpoint.dcp import ChecksummedReader, ChecksummedWriter
    from psrt.errors import CheckpointError

    path, last = shared_directory(), dist.get_world_size() - 1
    trained = mlp(seed=3)
    want = copy.deepcopy(trained).state_dict()
    fully_shard(trained)
    fresh = mlp(seed=4)
    fully_shard(fresh)
    state = fresh.state_dict()
    try:
        dcp.save(trained.state_dict(), storage_writer=ChecksummedWriter(path))
        dcp.load(state, storage_reader=ChecksummedReader(path))
    except CheckpointException as exc:  # a BaseException, which the harness would not report
        raise AssertionError(f"the round trip with checksums failed: {exc}") from None
    fresh.load_state_dict(state)
    assert_close(fresh.state_dict(), want, 0.0, "dcp load with checksums")
    damaged = os.path.join(path, f"__{last}_0.distcp")
    dist.barrier()
    if dist.get_rank() == last:  # a byte of a weight, which torch's own reader would load silently
        with open(damaged, "r+b") as f:
            data = bytearray(f.read())
            at = data.find(trained.state_dict()["0.weight"].to_local().numpy().tobytes()) + 3
            assert at >= 3, f"{damaged} does not hold the last rank's shard of 0.weight"
            data[at] ^= 0x01  # an exponent bit: the weight is 4 times larger or smaller
            f.seek(0)
            f.write(data)
    dist.barrier()
    before = {key: value.to_local().clone() for key, value in state.items()}
    try:
        dcp.load(state, storage_reader=ChecksummedReader(path))
    except CheckpointException as exc:
        assert f"{damaged} was changed after it was saved" in str(exc), str(exc)
        assert list(exc.failures) == [last] and isinstance(exc.failures[last][0], CheckpointError), exc.failures
    else:
        raise AssertionError(f"rank {dist.get_rank()}: a load from a checkpoint with a flipped byte in {damaged} "
                             "was not refused")
    assert_close({key: value.to_local() for key, value in state.items()}, before, 0.0, "state after the refusal")
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path)


# -- checkpoints moving between FSDP2 and psrt's ZeRO-3 through DCP -----------------------------------
ADAMW = {"lr": 0.02, "weight_decay": 0.1}
BEFORE, AFTER = 2, 2  # steps before the save and after the load


class OddNet(nn.Module):
    """1-, 2- and 3-D parameters, 117 elements in one flat group, so that ZeRO's flat ranges over
    2 or 4 ranks start and end inside rows (FSDP2 shards whole rows)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inner = nn.Linear(5, 7)
        self.mix = nn.Parameter(torch.randn(3, 7, 3) * 0.3)
        self.out = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.einsum("bi,kij->bj", torch.tanh(self.inner(x)), self.mix))


def odd_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(11)
    return [(torch.randn(8, 5, generator=generator), torch.randn(8, 3, generator=generator))
            for _ in range(BEFORE + AFTER)]


def train_odd(model: nn.Module, optimizer, data, part: int, parts: int) -> None:
    """Steps on rows ``part`` of ``parts`` of each global batch (the gradient is averaged over parts)."""
    for x, y in data:
        nn.functional.mse_loss(model(x.chunk(parts)[part]), y.chunk(parts)[part]).backward()
        optimizer.step()
        optimizer.zero_grad()


def odd_reference() -> dict[str, torch.Tensor]:
    """Torch's AdamW in one process, every step on the global batches."""
    model = OddNet(seed=1)
    train_odd(model, torch.optim.AdamW(model.parameters(), **ADAMW), odd_batches(), 0, 1)
    return model.state_dict()


def fsdp2_odd(seed: int, mesh=None) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = OddNet(seed)
    fully_shard(model.inner, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def check_fsdp2_checkpoint_continues_under_zero3(name: str) -> None:
    """FSDP2 over every rank trains and saves model and AdamW through DCP; ZeRO-3 over half the
    ranks loads them and trains on: equal to one process throughout."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from psrt.zero import ZeroOptimizer
    from psrt.zero.dcp import ModelState, OptimizerState

    n, data, want, path = dist.get_world_size(), odd_batches(), odd_reference(), shared_directory()
    model = fsdp2_odd(seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    train_odd(model, optimizer, data[:BEFORE], dist.get_rank(), n)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
             checkpoint_id=path)
    half = hvd.add_process_set(list(range(n // 2)))
    group = hvd.process_group(half)
    got, loaded = None, None
    if half.included():
        zmodel = OddNet(seed=2)
        zero = ZeroOptimizer(zmodel, torch.optim.AdamW, stage=3, process_set=half, lr=0.5,
                             weight_decay=0.0)  # the load brings ADAMW's
        dcp.load({"model": ModelState(zero), "optim": OptimizerState(zero)}, checkpoint_id=path, process_group=group)
        loaded = dict(zero.param_groups[0], params=None), {float(zero.state[g.master]["step"]) for g in zero.groups}
        train_odd(zmodel, zero, data[BEFORE:], half.rank(), half.size())
        with zero.gathered_parameters():
            got = {key: value.clone() for key, value in zmodel.state_dict().items()}
    finish_move(path, half, group)  # every rank gets here, so that a failure below ends no collective
    if got is not None:
        options, steps = loaded
        assert (options["lr"], options["weight_decay"]) == (ADAMW["lr"], ADAMW["weight_decay"]), \
            f"hyperparameters not loaded: {options}"
        assert steps == {float(BEFORE)}, f"step after the load: {steps}, saved {BEFORE}"
        assert_close(got, want, 1e-5, f"ZeRO-3 over {n // 2} rank(s) from FSDP2's checkpoint of {n}")


def check_zero3_checkpoint_continues_under_fsdp2(name: str) -> None:
    """ZeRO-3 over every rank trains and saves through DCP; FSDP2 over half the ranks loads the
    model and AdamW state with torch's own calls and trains on: equal to one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                          set_model_state_dict, set_optimizer_state_dict)
    from torch.distributed.device_mesh import DeviceMesh

    from psrt.zero import ZeroOptimizer
    from psrt.zero.dcp import ModelState, OptimizerState

    n, data, want, path = dist.get_world_size(), odd_batches(), odd_reference(), shared_directory()
    zmodel = OddNet(seed=1)
    zero = ZeroOptimizer(zmodel, torch.optim.AdamW, stage=3, **ADAMW)
    train_odd(zmodel, zero, data[:BEFORE], dist.get_rank(), n)
    dcp.save({"model": ModelState(zero), "optim": OptimizerState(zero)}, checkpoint_id=path)
    half = hvd.add_process_set(list(range(n // 2)))
    group = hvd.process_group(half)
    got, options = None, None
    if half.included():
        model = fsdp2_odd(seed=2, mesh=DeviceMesh.from_group(group, "cpu"))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.0)  # the load brings ADAMW's
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=path, process_group=group)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])
        options = dict(optimizer.param_groups[0], params=None)
        train_odd(model, optimizer, data[BEFORE:], half.rank(), half.size())
        got = {key: value.full_tensor() for key, value in model.state_dict().items()}
    finish_move(path, half, group)
    if got is not None:
        assert (options["lr"], options["weight_decay"]) == (ADAMW["lr"], ADAMW["weight_decay"]), \
            f"hyperparameters not loaded: {options}"
        assert_close(got, want, 1e-5, f"FSDP2 over {n // 2} rank(s) from ZeRO-3's checkpoint of {n}")


def finish_move(path: str, half, group) -> None:
    """Every rank: wait for the others, then free the half's group and set and the checkpoint."""
    dist.barrier()
    if group is not dist.GroupMember.NON_GROUP_MEMBER:
        dist.destroy_process_group(group)
    hvd.remove_process_set(half)
    if dist.get_rank() == 0:
        shutil.rmtree(path)


def check_lightning(name: str) -> None:
    """A Trainer with DDPStrategy(process_group_backend="psrt"), found through Lightning's
    MPIEnvironment; Lightning starts its own default group (env:// with its address, which
    psrt's start-up serves: rank 0's store listens on MASTER_ADDR alone, under a secret prefix)."""
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    n = dist.get_world_size()
    data = batches(2 * n)
    want = reference(mlp(), data).state_dict()
    # this rank's rows of each global batch, in order (Lightning's sampler would shuffle)
    xs, ys = torch.cat([local_rows(x) for x, _ in data]), torch.cat([local_rows(y) for _, y in data])

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def training_step(self, batch, index):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

    dist.destroy_process_group()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=2)
    module = Module()
    trainer = L.Trainer(accelerator="cpu", devices=n, strategy=DDPStrategy(process_group_backend="psrt"),
                        max_steps=STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, use_distributed_sampler=False)
    trainer.fit(module, loader)
    assert dist.get_backend() == "psrt", dist.get_backend()
    assert_close({k.removeprefix("net."): v for k, v in module.state_dict().items()}, want, 1e-5, "Lightning DDP")


def check_only_the_launcher_listens_beyond_loopback(name: str) -> None:
    """Every process of the job (psrun, its lifeline, the MPI launcher, the ranks and their
    watchers) while the default group runs: rank 0's store listens on loopback, and nothing
    listens beyond it but the launcher (which psrun's note names)."""
    sockets = _listeners.check_only_the_launcher_listens_beyond_loopback(name)
    if hvd.rank() == 0:
        mine = [s["listens_on"] for s in sockets if s["pid"] == os.getpid()]
        assert mine and all(where.startswith("127.0.0.1:") for where in mine), f"rank 0 listens on {mine}"


def check_torchrun_variables(name: str) -> None:
    """torchrun's variables equal this rank's place as torch and psrt say it, on one host, and
    psrun's rank wrapper set the first four before Python started (the process's environment as
    it was exec'd), and none of those that would change how torch and Lightning start up."""
    place = {"RANK": dist.get_rank(), "WORLD_SIZE": dist.get_world_size(), "LOCAL_RANK": hvd.local_rank(),
             "LOCAL_WORLD_SIZE": hvd.local_size(), "GROUP_RANK": 0, "GROUP_WORLD_SIZE": 1}
    got = {variable: os.environ.get(variable) for variable in place}
    assert got == {variable: str(value) for variable, value in place.items()}, f"{got} != {place}"
    with open("/proc/self/environ", "rb") as f:
        started = dict(item.decode().split("=", 1) for item in f.read().split(b"\0") if b"=" in item)
    wrapper = {variable: started.get(variable) for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    assert wrapper == {variable: got[variable] for variable in wrapper}, f"psrun's wrapper set {wrapper}"
    unwanted = sorted(v for v in started if v in ("MASTER_ADDR", "MASTER_PORT") or v.startswith("TORCHELASTIC_"))
    assert not unwanted, f"the rank started with {unwanted}"
    places = hvd.allgather_object((got["RANK"], got["LOCAL_RANK"]), name=name)
    assert len(set(places)) == hvd.size(), f"ranks share a place: {places}"


def check_hf_trainer(name: str) -> None:
    """transformers' Trainer over psrt (the default group started on it before TrainingArguments)
    ends with gloo's parameters, bit for bit, and accelerate's state, which the Trainer runs on,
    has each rank's place (psrun's LOCAL_RANK) and the group's size."""
    import accelerate
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    sys.path.insert(0, str(EXAMPLES))
    import trainer_hf

    environ, threads = dict(os.environ), torch.get_num_threads()  # accelerate sets MASTER_PORT and threads
    dist.destroy_process_group()  # the Trainer runs on the default group: each backend's in turn
    trained = {}
    try:
        for backend in ("psrt", "gloo"):
            dist.init_process_group(backend)
            with tempfile.TemporaryDirectory() as output_dir:
                trainer = trainer_hf.train(4, output_dir)
            state = accelerate.PartialState()
            assert isinstance(trainer.model_wrapped, nn.parallel.DistributedDataParallel), type(trainer.model_wrapped)
            where = (state.distributed_type, state.process_index, state.local_process_index, state.num_processes)
            assert where == (DistributedType.MULTI_CPU, hvd.rank(), hvd.local_rank(), hvd.size()), \
                f"{backend}: accelerate's state says {where}"
            assert dist.get_backend() == backend, dist.get_backend()
            trained[backend] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
            dist.destroy_process_group()
            AcceleratorState._reset_state(reset_partial_state=True)
            os.environ.clear()
            os.environ.update(environ)
    finally:
        torch.set_num_threads(threads)
        if not dist.is_initialized():
            dist.init_process_group("psrt")
    untrained = trainer_hf.model().state_dict()
    assert not all(torch.equal(untrained[k], v) for k, v in trained["psrt"].items()), "the Trainer trained nothing"
    differ = [k for k, v in trained["psrt"].items() if not torch.equal(v, trained["gloo"][k])]
    assert not differ, f"psrt's parameters differ from gloo's in {differ}"


def main() -> None:
    dist.init_process_group("psrt")  # no MASTER_ADDR: psrt's env:// start-up from MPI
    assert hvd.is_initialized() and dist.get_rank() == hvd.rank() and dist.get_world_size() == hvd.size()
    gloo = dist.new_group(backend="gloo")
    checks = _harness.Checks()
    for collective, (run, dtypes) in collective_checks(gloo).items():
        checks.add(f"collectives/{collective}", check_collective, gloo, run, dtypes)
    checks.add("collectives/barrier_and_objects", check_barrier_and_objects)
    checks.add("collectives/rooted_on_a_subgroup", check_rooted_on_a_subgroup, gloo)
    checks.add("errors/wrong_outputs_refused_before_communication", check_wrong_outputs_refused_before_communication)
    checks.add("errors/different_roots_and_a_lone_barrier_name_the_ranks",
               check_different_roots_and_a_lone_barrier_name_the_ranks)
    checks.add("process_group/destroyed_groups_are_freed", check_destroyed_groups_are_freed)
    checks.add("errors/mismatched_shapes_name_the_ranks", check_mismatched_shapes_name_the_ranks)
    checks.add("errors/different_collectives_name_the_ranks", check_different_collectives_name_the_ranks)
    checks.add("errors/unsupported_reduction", check_unsupported_reduction)
    checks.add("process_group/over_a_process_set", check_process_group_over_a_process_set)
    checks.add("ddp/buckets_and_no_sync_match_single_process", check_ddp, gloo)
    checks.add("fsdp2/matches_single_process", check_fsdp2, gloo, False)
    checks.add("fsdp2/mixed_precision_matches_gloo", check_fsdp2, gloo, True)
    checks.add("dtensor/parallelize_module_matches_single_process_and_gloo", check_dtensor_tp, gloo)
    checks.add("pipelining/1f1b_matches_single_process_and_gloo", check_pipelining_1f1b, gloo)
    checks.add("dcp/saves_and_loads_here_and_in_one_process", check_dcp)
    checks.add("dcp/checksums_round_trip_and_refuse_a_flipped_byte", check_dcp_checksums)
    checks.add("dcp/fsdp2_checkpoint_continues_under_zero3_on_half_the_ranks",
               check_fsdp2_checkpoint_continues_under_zero3)
    checks.add("dcp/zero3_checkpoint_continues_under_fsdp2_on_half_the_ranks",
               check_zero3_checkpoint_continues_under_fsdp2)
    # before Lightning's own default group (its MASTER_ADDR may be the host's name)
    checks.add("listeners/only_the_launcher_listens_beyond_loopback", check_only_the_launcher_listens_beyond_loopback)
    checks.add("launcher/torchrun_variables_name_each_ranks_place", check_torchrun_variables)
    if dist.get_world_size() == 2:
        checks.add("hf_trainer/over_psrt_equals_gloo_and_accelerate_finds_the_ranks", check_hf_trainer)
    checks.add("lightning/ddp_strategy_matches_single_process", check_lightning)
    _harness.run(checks, check_timeout_s=90.0)
    hvd.shutdown()


if __name__ == "__main__":
    main()
