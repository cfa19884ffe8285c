"""Two ranks, one GPU each: every collective on CUDA equals the same call on CPU."""
from __future__ import annotations

import torch

import psrt.torch as hvd


def main() -> None:
    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    rank = hvd.rank()
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.int32, torch.int16):
        cpu = (torch.arange(30).reshape(10, 3) + rank).to(dtype)
        cuda = cpu.cuda()
        for op in (hvd.Sum, hvd.Average, hvd.Min, hvd.Max):
            assert torch.equal(hvd.allreduce(cuda, op=op).cpu(), hvd.allreduce(cpu, op=op)), op
        uneven = cpu[: rank + 1]
        assert torch.equal(hvd.allgather(uneven.cuda()).cpu(), hvd.allgather(uneven))
        assert torch.equal(hvd.broadcast(cuda, 1).cpu(), hvd.broadcast(cpu, 1))
        splits = [rank + 1, 9 - rank]
        got_cuda, splits_cuda = hvd.alltoall(cuda, splits=splits)
        got_cpu, splits_cpu = hvd.alltoall(cpu, splits=splits)
        assert torch.equal(got_cuda.cpu(), got_cpu) and torch.equal(splits_cuda, splits_cpu)
        odd = cpu[:7]
        assert torch.equal(hvd.reducescatter(odd.cuda(), op=hvd.Sum).cpu(),
                           hvd.reducescatter(odd, op=hvd.Sum))
    print(f"rank {rank}: nccl check ok", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
