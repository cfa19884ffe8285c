"""Models, data and comparisons shared by the training checks.

Every input is a pure function of (check key, step, ...), so each rank builds
the whole global batch, trains on its own rows, and trains a single-process
reference on all rows itself: no rank trusts psrt to move the reference data.
"""
from __future__ import annotations

import zlib

import torch

import psrt.torch as hvd

FEATURES, HIDDEN, OUTPUTS = 6, 16, 3
ROWS_PER_RANK = 4


def generator(key: str, *parts: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32("|".join(map(str, (key, *parts))).encode()))


def randn(key: str, shape, *parts: object, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(shape, generator=generator(key, *parts), dtype=torch.float64).to(dtype)


class Mlp(torch.nn.Module):
    """Two layers and an optional extra head, which ``forward`` uses only when asked."""

    def __init__(self, key: str, dtype=torch.float64) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(FEATURES, HIDDEN)
        self.out = torch.nn.Linear(HIDDEN, OUTPUTS)
        self.extra = torch.nn.Linear(FEATURES, OUTPUTS)
        with torch.no_grad():
            for name, param in self.named_parameters():
                param.copy_(randn(key, param.shape, "init", name) * 0.5)
        self.to(dtype)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        y = self.out(torch.tanh(self.hidden(x)))
        return y + self.extra(x) if use_extra else y


def global_batch(key: str, step: int, micro: int = 0, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    rows = ROWS_PER_RANK * hvd.size()
    return randn(key, (rows, FEATURES), "x", step, micro, dtype=dtype), \
        randn(key, (rows, OUTPUTS), "y", step, micro, dtype=dtype)


def my_rows(tensor: torch.Tensor) -> torch.Tensor:
    return tensor[hvd.rank() * ROWS_PER_RANK:(hvd.rank() + 1) * ROWS_PER_RANK]


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x, use_extra), y)


def zero_grads(model: torch.nn.Module) -> None:
    """Reference gradients start at zero, not None: a parameter without a gradient in a step
    then steps with a zero gradient, as it does under DistributedOptimizer (and Horovod, DDP)."""
    for param in model.parameters():
        param.grad = torch.zeros_like(param)


def assert_params_close(model: torch.nn.Module, reference: torch.nn.Module, what: str,
                        rtol: float = 1e-10, atol: float = 1e-12) -> None:
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{what}: {n}: {m}")


def assert_params_equal(model: torch.nn.Module, other: torch.nn.Module, what: str) -> None:
    for (name, got), want in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(got, want), f"{what}: {name} differs, max |diff| {float((got - want).abs().max()):.3g}"


def failure_of(call) -> str | None:
    """The AssertionError ``call`` raises, as text, for checks that must finish their collectives
    before they report (a rank leaving early would leave the others waiting)."""
    try:
        call()
    except AssertionError as exc:
        return str(exc)
    return None


def expect_raises(kind: type[BaseException] | tuple[type[BaseException], ...], call, fragment: str,
                  what: str) -> None:
    try:
        call()
    except kind as exc:
        assert fragment in str(exc), f"{what}: message {str(exc)!r} does not mention {fragment!r}"
        return
    kinds = kind if isinstance(kind, tuple) else (kind,)
    raise AssertionError(f"{what}: did not raise {' or '.join(k.__name__ for k in kinds)}")
