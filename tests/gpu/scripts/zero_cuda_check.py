"""ZeRO stages 0-3 with a CUDA model (one rank: the gathers and reductions are copies on the
GPU, no collective), against the same training of a CPU copy with torch alone, then a sharded
checkpoint saved and loaded back.  Prints ``zero cuda check ok`` when everything matches."""
from __future__ import annotations

import tempfile

import torch

import psrt.torch as hvd
from psrt.zero import ZeroOptimizer


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 53), torch.nn.Tanh(), torch.nn.Linear(53, 3)).double()


def main() -> None:
    hvd.init()
    for stage in (0, 1, 2, 3):
        model, reference = net().cuda(), net()
        zero = ZeroOptimizer(model, torch.optim.Adam, stage=stage, reduce_bucket_size=100, lr=0.01)
        expected = torch.optim.Adam(reference.parameters(), lr=0.01)
        for step in range(3):
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
            model(x.cuda()).pow(2).mean().backward()
            zero.clip_grad_norm_(0.1)
            zero.step()
            expected.zero_grad()
            reference(x).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
            expected.step()
        with zero.gathered_parameters():
            for got, want in zip(model.parameters(), reference.parameters()):
                assert got.device.type == "cuda", got.device
                torch.testing.assert_close(got.cpu(), want, rtol=1e-10, atol=1e-12)
        with tempfile.TemporaryDirectory() as directory:
            zero.save(directory)
            fresh = net().cuda()
            with torch.no_grad():
                for param in fresh.parameters():
                    param.mul_(2.0)
            restored = ZeroOptimizer(fresh, torch.optim.Adam, stage=stage, reduce_bucket_size=100, lr=0.01)
            restored.load(directory)
            with restored.gathered_parameters():
                for got, want in zip(fresh.parameters(), reference.parameters()):
                    torch.testing.assert_close(got.cpu(), want, rtol=1e-10, atol=1e-12)
    model = net().float().cuda()
    zero = ZeroOptimizer(model, torch.optim.AdamW, stage=3, compute_dtype=torch.bfloat16, lr=0.01)
    model(torch.randn(4, 8, device="cuda").bfloat16()).float().pow(2).mean().backward()
    zero.step()
    assert all(group.master.dtype == torch.float32 and group.master.is_cuda for group in zero.groups)
    print("zero cuda check ok", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
