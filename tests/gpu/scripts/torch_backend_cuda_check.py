"""torch.distributed on psrt's backend with CUDA tensors (NCCL through CuPy), on one rank:
collectives in fp32, bf16 and fp16, a ``Work`` waited for from another stream, DDP and
FSDP2 with bf16 parameters, each against the same computation on the GPU without a process
group.  Prints ``torch backend cuda check ok`` when everything matches."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

import psrt.torch  # noqa: F401  (registers the backend)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16)).cuda()


def train(model: nn.Module, steps: int = 3) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = (torch.randn(8, 16, generator=generator).cuda() for _ in range(2))
        opt.zero_grad()
        nn.functional.mse_loss(model(x).float(), y).backward()
        opt.step()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().cpu()
            for k, v in model.state_dict().items()}


def check_collectives() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = torch.arange(6, device="cuda").to(dtype)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        out = torch.empty(6, device="cuda", dtype=dtype)
        dist.all_gather_into_tensor(out, t)
        dist.reduce_scatter_tensor(t, out)
        dist.broadcast(t, 0)
        assert torch.equal(t.cpu(), torch.arange(6).to(dtype)), (dtype, t)


def check_work_orders_streams() -> None:
    """A collective enqueued on a side stream behind a long kernel; after ``work.wait()``
    the default stream sees its result."""
    side = torch.cuda.Stream()
    big = torch.randn(2048, 2048, device="cuda")
    t = torch.zeros(1 << 20, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(20):
            big = big @ big / 2048
        t.add_(1)
        work = dist.all_reduce(t, async_op=True)
    work.wait()
    assert t.sum().item() == t.numel(), "the default stream read the tensor before the collective"


def main() -> None:
    dist.init_process_group("psrt")
    check_collectives()
    check_work_orders_streams()
    want = train(net())
    got = train(nn.parallel.DistributedDataParallel(net()))
    for key, value in want.items():
        torch.testing.assert_close(got[f"module.{key}"], value, msg=lambda m: f"DDP {key}: {m}")

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    reference = net()
    model = copy.deepcopy(reference)
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    got = train(model)
    for key, value in train(reference).items():
        torch.testing.assert_close(got[key], value, rtol=5e-2, atol=5e-2, msg=lambda m: f"FSDP2 {key}: {m}")
    dist.destroy_process_group()
    print("torch backend cuda check ok", flush=True)


if __name__ == "__main__":
    main()
