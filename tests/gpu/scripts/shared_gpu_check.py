"""Every rank of the job on the same GPU (2 or 4 ranks, one device): psrt carries their CUDA
tensors through host memory (NCCL refuses two ranks on one device; see psrt.comm.staged),
and each strategy must still give what one process gives on the CPU with torch alone, in
float64: every collective (sync and async), DP, ZeRO 1/2/3, TP × PP for every split of the
ranks, CP ring attention, EP (MoE), and the elastic state's sync, commit and restore.

Reports one JSON line per check on rank 0 (tests/parallel/scripts/_harness.py).  ``--device
cpu`` runs the same checks on the host (to check the script where there is no GPU);
``--parts`` picks some (``ps`` runs only under ``psrun --num-servers``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "parallel" / "scripts"))

import _harness  # noqa: E402
import psrt.torch as hvd  # noqa: E402
from _training_common import Mlp, global_batch, loss_of, my_rows, randn  # noqa: E402
from psrt import cp, ep, pp, tp  # noqa: E402
from psrt.grid import ProcessGrid  # noqa: E402
from psrt.zero import ZeroOptimizer  # noqa: E402

STEPS = 3
PARTS = ("collectives", "dp", "zero", "tp_pp", "cp", "ep", "elastic")
DEVICE = torch.device("cpu")  # set by main()


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.device.type == DEVICE.type, f"{what}: the result is on {got.device}, not {DEVICE}"
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=1e-10, atol=1e-12, msg=lambda m: f"{what}: {m}")


def check_collectives(key: str) -> None:
    """Each collective on the device equals the same call on host tensors."""
    rank = hvd.rank()
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int32):
        host = (torch.arange(30).reshape(10, 3) + rank).to(dtype)
        here = host.to(DEVICE)
        for op in (hvd.Sum, hvd.Average, hvd.Min, hvd.Max) if dtype.is_floating_point else (hvd.Sum, hvd.Min):
            assert torch.equal(hvd.allreduce(here, op=op).cpu(), hvd.allreduce(host, op=op)), (dtype, op)
        uneven = host[: rank + 1]
        assert torch.equal(hvd.allgather(uneven.to(DEVICE)).cpu(), hvd.allgather(uneven)), dtype
        assert torch.equal(hvd.broadcast(here, hvd.size() - 1).cpu(), hvd.broadcast(host, hvd.size() - 1)), dtype
        splits = [1 + (rank + r) % 3 for r in range(hvd.size())]
        got, got_splits = hvd.alltoall(host[: sum(splits)].to(DEVICE), splits=splits)
        want, want_splits = hvd.alltoall(host[: sum(splits)], splits=splits)
        assert torch.equal(got.cpu(), want) and torch.equal(got_splits.cpu(), want_splits), dtype
        if dtype.is_floating_point:
            assert torch.equal(hvd.reducescatter(here, op=hvd.Sum).cpu(), hvd.reducescatter(host, op=hvd.Sum)), dtype
    in_place = torch.full((1 << 16,), float(rank + 1), device=DEVICE)
    handle = hvd.allreduce_async_(in_place, op=hvd.Sum, name=f"{key}.async")
    assert hvd.synchronize(handle) is in_place
    total = hvd.size() * (hvd.size() + 1) / 2
    assert torch.equal(in_place.cpu(), torch.full((1 << 16,), total)), "allreduce_async_"
    gathered = hvd.synchronize(hvd.allgather_async(torch.full((2,), float(rank), device=DEVICE), name=f"{key}.ag"))
    assert torch.equal(gathered.cpu(), torch.arange(hvd.size()).double().repeat_interleave(2).float())


def train_reference(key: str, make_optimizer) -> nn.Module:
    """One process, the whole batch on the CPU."""
    model = Mlp(key)
    optimizer = make_optimizer(model.parameters())
    for step in range(STEPS):
        optimizer.zero_grad()
        loss_of(model, *global_batch(key, step), use_extra=True).backward()
        optimizer.step()
    return model


def train_mine(key: str, model: nn.Module, optimizer) -> None:
    """This rank's rows of the same batches, on the device."""
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = (my_rows(t).to(DEVICE) for t in global_batch(key, step))
        loss_of(model, x, y, use_extra=True).backward()
        optimizer.step()


def check_dp(key: str) -> None:
    def sgd(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    model = Mlp(key).to(DEVICE)
    optimizer = hvd.DistributedOptimizer(sgd(model.parameters()), named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    train_mine(key, model, optimizer)
    for (name, got), want in zip(model.named_parameters(), train_reference(key, sgd).parameters()):
        close(got.detach(), want.detach(), f"parameter {name}")


def check_zero(key: str, stage: int) -> None:
    model = Mlp(key).to(DEVICE)
    zero = ZeroOptimizer(model, torch.optim.Adam, stage=stage, reduce_bucket_size=40, lr=0.01)
    train_mine(key, model, zero)
    reference = train_reference(key, lambda params: torch.optim.Adam(params, lr=0.01))
    with zero.gathered_parameters():
        for (name, got), want in zip(model.named_parameters(), reference.parameters()):
            close(got.detach(), want.detach(), f"stage {stage} parameter {name}")


def check_tp_pp(key: str, tp_size: int, pp_size: int) -> None:
    """Four transformer blocks, heads split over TP, blocks cut over PP, four micro-batches."""
    grid = ProcessGrid(dp=1, tp=tp_size, pp=pp_size)
    torch.manual_seed(4)
    reference = nn.Sequential(*(tp.ParallelTransformerBlock(16, 4).double() for _ in range(4)))
    blocks = []
    for whole in reference:
        block = tp.ParallelTransformerBlock(16, 4, process_set=grid.tp_set).double()
        tp.load_full_state_dict(block, whole.state_dict())
        blocks.append(block.to(DEVICE))
    stage = pp.PipelineStage(blocks, grid.pp_set)
    x, y = randn(key, (8, 4, 16), "x"), randn(key, (8, 4, 16), "y")
    want = ((reference(x) - y) ** 2).sum()
    want.backward()
    pipeline = pp.Pipeline(stage, lambda out, target: ((out - target) ** 2).sum(), microbatches=4,
                           loss_reduction="sum")
    loss = pipeline.step(x.to(DEVICE) if grid.is_first_stage else None, y.to(DEVICE) if grid.is_last_stage else None)
    if grid.is_last_stage:  # Pipeline.step gives the loss as a float64 on the stage's device, on every stage
        torch.testing.assert_close(loss.cpu(), want.detach().reshape(loss.shape), rtol=1e-10, atol=1e-12)
    grads = dict(reference.named_parameters())
    for name, param in stage.named_parameters():
        sharding = tp.sharding.sharding_of(param)
        full = grads[name].grad
        close(param.grad, full if sharding is None else sharding.shard(full), f"gradient of {name}")
    grid.free()


def check_cp(key: str, causal: bool, grid: ProcessGrid) -> None:
    """Ring attention's output and q, k, v gradients equal full attention's parts."""
    cp_set = grid.cp_set
    rank, size = cp_set.rank(), cp_set.size()

    def mine(tensor: torch.Tensor) -> torch.Tensor:
        return cp.split(tensor, 2, rank, size) if causal else tensor.chunk(size, 2)[rank]

    full = [randn(key, (2, 4, 4 * size, 8), name).requires_grad_() for name in "qkv"]
    weights = randn(key, (2, 4, 4 * size, 8), "R")
    want = nn.functional.scaled_dot_product_attention(*full, is_causal=causal)
    (want * weights).sum().backward()
    parts = [mine(t.detach()).to(DEVICE).requires_grad_() for t in full]
    got = cp.ring_attention(*parts, cp_set, causal=causal)
    (got * mine(weights).to(DEVICE)).sum().backward()
    close(got.detach(), mine(want.detach()), "output")
    for name, part, whole in zip("qkv", parts, full):
        close(part.grad, mine(whole.grad), f"gradient of {name}")


def check_ep(key: str, top_k: int, grid: ProcessGrid) -> None:
    """The MoE layer with experts over every rank equals the layer in one process on each
    rank's tokens (dropless), outputs and input gradients."""
    torch.manual_seed(7)
    reference = ep.MoE(8, 12, 2 * hvd.size(), top_k=top_k, aux_loss_coef=0.3).double()
    torch.manual_seed(7)
    layer = ep.MoE(8, 12, 2 * hvd.size(), top_k=top_k, aux_loss_coef=0.3, process_set=grid.ep_set).double()
    layer.to(DEVICE)
    tokens = randn(key, (2, 5, 8), "x", hvd.rank()).requires_grad_()
    weights = randn(key, (2, 5, 8), "R", hvd.rank())
    want = reference(tokens)
    (want * weights).sum().backward()
    x = tokens.detach().to(DEVICE).requires_grad_()
    out = layer(x)
    (out * weights.to(DEVICE)).sum().backward()
    close(out.detach(), want.detach(), "output")
    close(x.grad, tokens.grad, "input gradient")
    close(layer.aux_loss.detach(), reference.aux_loss.detach(), "load-balancing loss")


def check_elastic(key: str) -> None:
    """``TorchState`` with a model and optimizer on the device: restore goes back to the commit;
    sync (broadcasts of the device's parameters and momentum) leaves every rank with rank 0's
    objects and the committed values."""
    model = Mlp(key).to(DEVICE)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, epoch=0)
    train_mine(key, model, optimizer)  # the same values on every rank, momentum on the device
    state.commit()
    committed = {name: value.detach().cpu().clone() for name, value in model.state_dict().items()}
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    state.restore()
    for name, value in model.state_dict().items():
        close(value, committed[name], f"restored {name}")
    state.epoch = 5 if hvd.rank() == 0 else -1
    state.save()
    state.sync()
    assert state.epoch == 5, f"rank {hvd.rank()} has epoch {state.epoch} after sync, rank 0 had 5"
    root = hvd.broadcast_object(committed, root_rank=0, name=f"{key}.root")
    for name, value in model.state_dict().items():
        close(value, root[name], f"synced {name}")
    for group in optimizer.state.values():
        assert group["momentum_buffer"].device.type == DEVICE.type, "momentum left the device"


def check_ps(key: str) -> None:
    """Sync parameter-server training of device tensors equals one process on the whole batch."""
    import psrt.ps as ps

    def sgd(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    model = Mlp(key).to(DEVICE)
    optimizer = ps.DistributedOptimizer(sgd(model.parameters()), model.named_parameters(), mode="sync")
    train_mine(key, model, optimizer)
    for (name, got), want in zip(model.named_parameters(), train_reference(key, sgd).parameters()):
        close(got.detach(), want.detach(), f"parameter {name}")


def splits(n: int) -> list[tuple[int, int]]:
    """(tp, pp) for every way to lay ``n`` ranks out (TP at most 4: the blocks have 4 heads)."""
    return [(t, n // t) for t in (1, 2, 4) if n % t == 0 and t <= 4 and n // t <= 4]


def main() -> None:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS + ('ps',)}")
    args = parser.parse_args()
    parts = args.parts.split(",")
    hvd.init()
    if args.device == "cuda":
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        DEVICE = torch.device("cuda", torch.cuda.current_device())
    n = hvd.size()
    checks = _harness.Checks()
    if "collectives" in parts:
        checks.add("collectives/every_collective_matches_the_host", check_collectives)
    if "dp" in parts:
        checks.add("dp/distributed_optimizer_matches_one_process", check_dp)
    if "zero" in parts:
        for stage in (1, 2, 3):
            checks.add(f"zero/stage{stage}_matches_one_process", check_zero, stage)
    if "tp_pp" in parts:
        for tp_size, pp_size in splits(n):
            checks.add(f"tp_pp/tp{tp_size}_pp{pp_size}_matches_one_process", check_tp_pp, tp_size, pp_size)
    if "cp" in parts:
        cp_grid = ProcessGrid(cp=n)
        for causal in (True, False):
            checks.add(f"cp/ring_attention_{'causal' if causal else 'full'}_matches_full_attention",
                       check_cp, causal, cp_grid)
    if "ep" in parts:
        ep_grid = ProcessGrid(dp=n, ep=n)
        for top_k in (1, 2):
            checks.add(f"ep/moe_top{top_k}_matches_one_process", check_ep, top_k, ep_grid)
    if "elastic" in parts:
        checks.add("elastic/state_commit_restore_and_sync", check_elastic)
    if "ps" in parts:
        checks.add("ps/sync_training_matches_one_process", check_ps)
    _harness.run(checks, check_timeout_s=120.0)
    hvd.shutdown()


if __name__ == "__main__":
    main()
