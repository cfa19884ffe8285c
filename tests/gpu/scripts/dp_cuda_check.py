"""Data parallelism with CUDA tensors on one rank: ``DistributedOptimizer`` (accumulation
over two backward passes, fp16 compression, gradient clipping after ``synchronize``) and
``SyncBatchNorm`` against the same training of a CPU copy with torch alone.  Prints
``dp cuda check ok`` when everything matches."""
from __future__ import annotations

import torch

import psrt.torch as hvd


def net(batch_norm: type = torch.nn.BatchNorm1d) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), batch_norm(32), torch.nn.Tanh(), torch.nn.Linear(32, 3))


def batches(step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return [torch.randn(6, 8, generator=generator) for _ in range(2)]


def main() -> None:
    hvd.init()
    for compression in (hvd.Compression.none, hvd.Compression.fp16):
        model = net(hvd.SyncBatchNorm).cuda()
        reference = net()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(),
                                       backward_passes_per_step=2, compression=compression)
        expected = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        for step in range(4):
            opt.zero_grad()
            expected.zero_grad()
            for x in batches(step):
                model(x.cuda()).pow(2).mean().div(2).backward()
                reference(x).pow(2).mean().div(2).backward()
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
            with opt.skip_synchronize():
                opt.step()
            expected.step()
        tolerance = dict(rtol=1e-5, atol=1e-6) if compression is hvd.Compression.none else dict(rtol=2e-3, atol=2e-3)
        for (name, got), want in zip(model.state_dict().items(), reference.state_dict().values()):
            assert got.device.type == "cuda", (name, got.device)
            torch.testing.assert_close(got.cpu(), want, **tolerance, msg=lambda m: f"{name}: {m}")
    print("dp cuda check ok", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
