"""A zero-bubble pipeline's split backward (``psrt.pp.split_backward``) in one process: the
input half then the weight half give ordinary autograd's gradients, and a recomputed block
runs its forward again at most once per half (ZB-H1 with ``recompute="full"``)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from psrt import tp
from psrt.pp.split_backward import backward_input
from psrt.tp.recompute import checkpoint


class Counted(nn.Module):
    """``module`` with a count of its forwards."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module, self.forwards = module, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        return self.module(x)


def three_linears() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 4)).double()


def transformer_block() -> nn.Module:
    return tp.ParallelTransformerBlock(8, 2, dropout=0.1, attention_dropout=0.1).double()


def gradients(build, split: bool, recompute: bool) -> tuple[list[torch.Tensor], int]:
    """Input and parameter gradients of one micro-batch, and the forwards the block ran."""
    torch.manual_seed(0)
    tp.manual_seed(0)
    block = Counted(build())
    x = torch.randn(2, 3, 6 if build is three_linears else 8, dtype=torch.float64, requires_grad=True)
    out = checkpoint(block, x) if recompute else block(x)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    if split:
        weight_pass = backward_input(out, weights, x, list(block.parameters()))
        assert all(p.grad is None for p in block.parameters()), "the input half touched a parameter's gradient"
        weight_pass.run()
    else:
        out.backward(weights)
    return [x.grad] + [p.grad for p in block.parameters()], block.forwards


@pytest.mark.parametrize("build", [three_linears, transformer_block], ids=["three_linears", "transformer_block"])
@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
def test_split_backward_matches_autograd(build, recompute):
    want, _ = gradients(build, split=False, recompute=False)
    got, _ = gradients(build, split=True, recompute=recompute)
    for index, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m, i=index: f"gradient {i}: {m}")


@pytest.mark.parametrize("build", [three_linears, transformer_block], ids=["three_linears", "transformer_block"])
def test_a_recomputed_block_runs_forward_once_per_half(build):
    """The forward, one recomputation for the input half and one for the weight half (not one
    per group of parameters: that was 5 for three Linears and 8 for a transformer block)."""
    _, one_f_one_b = gradients(build, split=False, recompute=True)
    _, split = gradients(build, split=True, recompute=True)
    assert one_f_one_b == 2, f"an ordinary backward of a recomputed block ran {one_f_one_b} forwards"
    assert split <= 3, f"a split backward of a recomputed block ran {split} forwards, at most 3 expected"


def test_psrt_autograd_functions_on_the_input_path_run_their_backward_once():
    """The weight half gives the input's path no gradient: a psrt function there (a TP region,
    an expert all-to-all, a CP ring) runs nothing then, where it once ran on zeros."""
    from psrt.autograd import skips_without_gradient

    calls = []

    @skips_without_gradient
    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            calls.append(grad)
            return grad

    first, second = nn.Linear(4, 4).double(), nn.Linear(4, 3).double()
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    out = second(Identity.apply(first(x)))
    weight_pass = backward_input(out, torch.ones_like(out), x, [*first.parameters(), *second.parameters()])
    weight_pass.run()
    assert len(calls) == 1, f"the function's backward ran {len(calls)} times"
    assert all(p.grad is not None for p in [*first.parameters(), *second.parameters()])
