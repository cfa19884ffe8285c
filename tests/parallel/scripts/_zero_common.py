"""The model, data and shard-by-shard comparisons shared by the ZeRO checks.

``ZNet`` has 737 trainable elements (45 + 477 + 53 + 159 + 3), none of its
parameters or groups a multiple of 2 or 4 elements, and a 53-element bias.
Every input is a pure function of (key, step, micro-batch), so each rank builds
the global batch, trains on its own rows, and trains the single-process
reference on all rows itself.
"""
from __future__ import annotations

import torch

import psrt.torch as hvd
from psrt.zero import ZeroOptimizer

from _training_common import randn

ROWS_PER_RANK = 3
FEATURES, OUTPUTS = 5, 3


class ZNet(torch.nn.Module):
    def __init__(self, key: str, dtype=torch.float64) -> None:
        super().__init__()
        self.first = torch.nn.Linear(FEATURES, 9, bias=False)
        self.middle = torch.nn.Linear(9, 53)
        self.last = torch.nn.Linear(53, OUTPUTS)
        with torch.no_grad():
            for name, param in self.named_parameters():
                param.copy_(randn(key, param.shape, "init", name) * 0.4)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.tanh(self.middle(torch.tanh(self.first(x)))))


def batch(key: str, step: int, micro: int, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    rows = ROWS_PER_RANK * hvd.size()
    return (randn(key, (rows, FEATURES), "x", step, micro, dtype=dtype),
            randn(key, (rows, OUTPUTS), "y", step, micro, dtype=dtype))


def mine(tensor: torch.Tensor) -> torch.Tensor:
    return tensor[hvd.rank() * ROWS_PER_RANK:(hvd.rank() + 1) * ROWS_PER_RANK]


def loss_of(model, x, y, accumulation: int) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y) / accumulation


def reference_step(model, optimizer, key: str, step: int, accumulation: int, dtype=torch.float64) -> None:
    """One single-process step on every rank's rows of every micro-batch."""
    optimizer.zero_grad()
    for micro in range(accumulation):
        x, y = batch(key, step, micro, dtype)
        loss_of(model, x, y, accumulation).backward()
    optimizer.step()


def shard_slices(zero: ZeroOptimizer):
    """(group tensor index, shard slice, parameter index, parameter slice) for this rank's shards."""
    for g in range(len(zero.groups)):
        for piece in zero.partition.pieces(g, zero.shard_index):
            yield g, slice(piece.shard_offset, piece.shard_offset + piece.stop - piece.start), \
                piece.param, slice(piece.start, piece.stop)


def assert_shards_match(zero: ZeroOptimizer, reference: torch.nn.Module, reference_optimizer, what: str,
                        rtol: float, atol: float) -> None:
    """Each shard's master values, reduced gradient (if present) and optimizer state against the
    matching slice of the reference."""
    ref_params = list(reference.parameters())
    for g, shard_part, param, param_part in shard_slices(zero):
        name = zero.param_names[param]
        master = zero.groups[g].master
        want_param = ref_params[param].detach().reshape(-1)[param_part]
        torch.testing.assert_close(master.detach()[shard_part], want_param.to(master.dtype), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{what}: master of {name}: {m}")
        reduced = zero.groups[g].grad  # this rank's averaged gradient shard, once reduced
        if reduced is not None:
            want = ref_params[param].grad.reshape(-1)[param_part]
            torch.testing.assert_close(reduced[shard_part], want.to(reduced.dtype), rtol=rtol, atol=atol,
                                       msg=lambda m: f"{what}: gradient of {name}: {m}")
        state = zero.optimizer.state.get(master, {})
        for key, value in reference_optimizer.state.get(ref_params[param], {}).items():
            if value.dim() == 0:
                torch.testing.assert_close(state[key], value, msg=lambda m: f"{what}: {key} of {name}: {m}")
            else:
                torch.testing.assert_close(state[key][shard_part], value.reshape(-1)[param_part], rtol=rtol,
                                           atol=atol, msg=lambda m: f"{what}: {key} of {name}: {m}")


def assert_model_matches(zero: ZeroOptimizer, reference: torch.nn.Module, what: str, rtol: float,
                         atol: float) -> None:
    with zero.gathered_parameters():
        for (name, got), want in zip(zero.model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(got.detach(), want.detach().to(got.dtype), rtol=rtol, atol=atol,
                                       msg=lambda m, n=name: f"{what}: {n}: {m}")
