"""A DP step and ZeRO 0-3 steps on one GPU synchronise the host with nothing once warmed up
(``torch.cuda.set_sync_debug_mode("error")`` raises on any synchronisation), and give bitwise the
parameters of the same training with torch alone.  Prints ``sync free check ok``."""
from __future__ import annotations

import torch

import psrt.torch as hvd
from psrt.zero import ZeroOptimizer

WARMUP, STEPS = 2, 3


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64),
                               torch.nn.GELU(), torch.nn.Linear(64, 8)).cuda()


def batches() -> list[torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(1)
    return [torch.randn(32, 64, device="cuda", generator=generator) for _ in range(WARMUP + STEPS)]


def train(model: torch.nn.Module, optimizer, label: str) -> None:
    """WARMUP steps, then STEPS steps each under the sync debug mode."""
    for index, x in enumerate(batches()):
        torch.cuda.synchronize()
        if index >= WARMUP:
            torch.cuda.set_sync_debug_mode("error")
        try:
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        except RuntimeError as exc:
            raise AssertionError(f"{label}: step {index} synchronised the host: {exc}") from exc
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same(got: list[torch.Tensor], want: list[torch.Tensor], label: str) -> None:
    for index, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{label}: parameter {index} differs from torch's by {(a - b).abs().max()}"


def main() -> None:
    hvd.init()
    model = net()
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), "torch")
    plain = parameters(model)
    model = net()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters())
    train(model, optimizer, "DistributedOptimizer")
    same(parameters(model), plain, "DistributedOptimizer")
    for stage in (0, 1, 2, 3):
        model = net()
        zero = ZeroOptimizer(model, torch.optim.SGD, stage=stage, lr=0.1)
        train(model, zero, f"ZeRO-{stage}")
        with zero.gathered_parameters():  # stage 3 releases them between uses
            same(parameters(model), plain, f"ZeRO-{stage}")
    print("sync free check ok")


if __name__ == "__main__":
    main()
