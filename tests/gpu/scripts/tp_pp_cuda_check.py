"""Pipeline and tensor parallelism with CUDA tensors against the same computation on the
CPU with torch alone: a 1F1B pipeline over every rank (activations staged through host
memory), and, where every rank has a GPU of its own (NCCL refuses two ranks on one
device), a tensor-parallel transformer block with and without sequence parallelism.
Prints ``tp pp cuda check ok`` when everything matches.  ``--device cpu`` runs the same
checks on the host (to check the script itself where there is no GPU)."""
from __future__ import annotations

import sys

import torch
from torch import nn

import psrt.torch as hvd
from psrt import pp, tp
from psrt.grid import ProcessGrid


def blocks(seed: int) -> list[nn.Module]:
    torch.manual_seed(seed)
    widths = [6, 16, 12, 16, 3]
    return [nn.Sequential(nn.Linear(a, b), nn.Tanh()).double() for a, b in zip(widths, widths[1:])]


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got.cpu(), want, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what}: {m}")


def check_pipeline(device: torch.device) -> None:
    grid = ProcessGrid(dp=1, tp=1, pp=hvd.size())
    reference = nn.Sequential(*blocks(1))
    stage = pp.PipelineStage([b.to(device) for b in blocks(1)], grid.pp_set)
    x = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y = torch.randn(8, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    ref_loss = ((reference(x) - y) ** 2).sum()
    ref_loss.backward()
    pipe = pp.Pipeline(stage, lambda out, target: ((out - target) ** 2).sum(), microbatches=4,
                       loss_reduction="sum")
    loss = pipe.step(x.to(device) if grid.is_first_stage else None, y.to(device) if grid.is_last_stage else None)
    close(loss, ref_loss.detach(), "pipeline loss")
    grads = dict(reference.named_parameters())
    for name, param in stage.named_parameters():
        assert param.device.type == device.type, f"{name} left {device}"
        close(param.grad, grads[name].grad, f"pipeline gradient of {name}")
    grid.free()


def check_tensor_parallel_block(device: torch.device, sequence_parallel: bool) -> None:
    grid = ProcessGrid(dp=1, tp=hvd.size(), pp=1)
    torch.manual_seed(4)
    reference = tp.ParallelTransformerBlock(16, 4).double()
    block = tp.ParallelTransformerBlock(16, 4, process_set=grid.tp_set, sequence_parallel=sequence_parallel)
    block.double().to(device)
    tp.load_full_state_dict(block, reference.state_dict())
    x = torch.randn(2, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5), requires_grad=True)
    reference(x).pow(2).sum().backward()
    mine = x.detach().chunk(hvd.size(), 1)[hvd.rank()] if sequence_parallel else x.detach()
    mine = mine.to(device).requires_grad_()
    block(mine).pow(2).sum().backward()
    want = x.grad.chunk(hvd.size(), 1)[hvd.rank()] if sequence_parallel else x.grad
    close(mine.grad, want, "block input gradient")
    grads = dict(reference.named_parameters())
    for name, param in block.named_parameters():
        sharding = tp.sharding.sharding_of(param)
        full = grads[name].grad
        close(param.grad, full if sharding is None else sharding.shard(full), f"block gradient of {name}")
    grid.free()


def main() -> None:
    hvd.init()
    if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
        device, own_gpus = torch.device("cpu"), True
    else:
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        device, own_gpus = torch.device("cuda", torch.cuda.current_device()), \
            torch.cuda.device_count() >= hvd.local_size()
    check_pipeline(device)
    if own_gpus:
        for sequence_parallel in (False, True):
            check_tensor_parallel_block(device, sequence_parallel)
    elif hvd.rank() == 0:
        print("tensor-parallel block skipped: fewer GPUs than ranks on this host")
    rank = hvd.rank()
    hvd.shutdown()
    if rank == 0:
        print("tp pp cuda check ok")


if __name__ == "__main__":
    main()
