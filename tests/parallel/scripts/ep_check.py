"""Expert parallelism over all ranks of the job (EP = 2 or 4; EP 2 × DP and EP 2 × TP 2 at 4
ranks): the MoE layer against the same layer in one process on every rank's tokens, in
float64 (outputs, input, router and expert gradients, load-balancing loss and dropped
tokens), top-1 and top-2, with a capacity factor and dropless; MoE layers in a two-stage
pipeline of 1, 2 and 4 micro-batches against one process adding the mean aux loss; and the
errors a user can trigger.
"""
from __future__ import annotations

import torch

import _harness
import psrt.torch as hvd
from _training_common import expect_raises, randn
from psrt import ep, pp, tp
from psrt.errors import CollectiveMismatchError, InvalidArgumentError
from psrt.grid import ProcessGrid

DIM, HIDDEN, TOKENS, COEF = 8, 12, 10, 0.3


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what}: {m}")


def grad_or_zeros(param: torch.Tensor) -> torch.Tensor:
    return param.grad if param.grad is not None else torch.zeros_like(param)


def check_moe(key: str, ep_set, group_ranks: list[int], top_k: int, capacity_factor: float | None,
              experts_per_rank: int = 2, expert=None, reference_expert=None, reduce_experts_over=None) -> None:
    """Every rank of ``group_ranks`` (the world ranks whose tokens this rank's reference replays,
    in order) routes its own tokens; the reference runs the one-process layer on each of them."""
    experts = experts_per_rank * (1 if ep_set is None else ep_set.size())
    options = dict(top_k=top_k, capacity_factor=capacity_factor, aux_loss_coef=COEF)
    torch.manual_seed(7)
    reference = ep.MoE(DIM, HIDDEN, experts, expert=reference_expert, **options).double()
    torch.manual_seed(7)
    layer = ep.MoE(DIM, HIDDEN, experts, process_set=ep_set, expert=expert, **options).double()
    tokens = {r: randn(key, (2, TOKENS // 2, DIM), "x", r).requires_grad_() for r in group_ranks}
    weights = {r: randn(key, (2, TOKENS // 2, DIM), "R", r) for r in group_ranks}
    reference_out, aux, dropped = {}, {}, {}
    for r in group_ranks:
        reference_out[r] = reference(tokens[r])
        (reference_out[r] * weights[r]).sum().backward()  # the aux loss's gradient joins through its coefficient
        aux[r], dropped[r] = reference.aux_loss.detach(), reference.dropped
    me = hvd.rank()
    x = tokens[me].detach().clone().requires_grad_()
    out = layer(x)
    (out * weights[me]).sum().backward()
    close(out.detach(), reference_out[me].detach(), "output")
    close(x.grad, tokens[me].grad, "input gradient")
    close(layer.aux_loss.detach(), aux[me], "load-balancing loss")
    assert layer.dropped == dropped[me], f"dropped {layer.dropped} assignments, the reference {dropped[me]}"
    if capacity_factor is not None and capacity_factor < 1:
        assert sum(dropped.values()) > 0, "the capacity factor dropped nothing: the check does not test dropping"
    # the router is replicated on every rank whose tokens the reference replays: the whole job
    router = hvd.allreduce(layer.router.weight.grad, op=hvd.Sum, name=f"{key}.router")
    close(router, reference.router.weight.grad, "router gradient (summed over the ranks' tokens)")
    want = dict(reference.named_parameters())
    for name, param in layer.experts.named_parameters():
        got = grad_or_zeros(param)
        if reduce_experts_over is not None:
            got = hvd.allreduce(got, op=hvd.Sum, name=f"{key}.{name}", process_set=reduce_experts_over)
        expected = grad_or_zeros(want[f"experts.{name}"])
        sharding = tp.sharding.sharding_of(param)
        close(got, expected if sharding is None else sharding.shard(expected), f"gradient of expert {name}")


def check_pure_ep(key: str, top_k: int, capacity_factor: float | None) -> None:
    """EP over the whole job: every expert sees the tokens of every rank."""
    check_moe(key, grid().ep_set, list(range(hvd.size())), top_k, capacity_factor)


def check_ep_with_dp(key: str) -> None:
    """EP 2 inside DP 4: expert gradients summed over the ranks holding the same experts (edp_set)
    equal the one-process gradients over all four ranks' tokens."""
    g = grid(dp=4, ep=2)
    mine = sorted(g.world_rank(dp=d, tp=0, pp=0) for d in range(4))
    check_moe(key, g.ep_set, mine, 2, None, reduce_experts_over=g.edp_set)


def check_ep_with_tp(key: str) -> None:
    """EP 2 over DP 2, every expert split over TP 2: the TP ranks of a DP replica hold the same
    tokens and route them alike; each expert's gradient is its TP block of the one-process one."""
    g = grid(dp=2, tp=2, ep=2)
    _check_ep_with_tp(key, g, lambda: tp.ParallelMLP(DIM, HIDDEN, process_set=g.tp_set),
                      lambda: tp.ParallelMLP(DIM, HIDDEN))


def _check_ep_with_tp(key: str, g: ProcessGrid, tp_expert, plain_expert) -> None:
    experts = 2 * g.ep_set.size()
    options = dict(top_k=2, capacity_factor=1.5, aux_loss_coef=COEF)
    torch.manual_seed(7)
    reference = ep.MoE(DIM, HIDDEN, experts, expert=plain_expert, **options).double()
    torch.manual_seed(7)
    layer = ep.MoE(DIM, HIDDEN, experts, process_set=g.ep_set, expert=tp_expert, **options).double()
    tokens = {d: randn(key, (2, TOKENS // 2, DIM), "x", d).requires_grad_() for d in range(2)}
    weights = {d: randn(key, (2, TOKENS // 2, DIM), "R", d) for d in range(2)}
    reference_out = {}
    for d in range(2):
        reference_out[d] = reference(tokens[d])
        (reference_out[d] * weights[d]).sum().backward()
    d = g.coords.dp
    x = tokens[d].detach().clone().requires_grad_()
    out = layer(x)
    (out * weights[d]).sum().backward()
    close(out.detach(), reference_out[d].detach(), "output")
    close(x.grad, tokens[d].grad, "input gradient")
    router = hvd.allreduce(layer.router.weight.grad, op=hvd.Sum, name=f"{key}.router", process_set=g.ep_set)
    close(router, reference.router.weight.grad, "router gradient")
    want = dict(reference.named_parameters())
    for name, param in layer.experts.named_parameters():
        expected = grad_or_zeros(want[f"experts.{name}"])
        sharding = tp.sharding.sharding_of(param)
        close(grad_or_zeros(param), expected if sharding is None else sharding.shard(expected),
              f"gradient of expert {name}")


class MoEBlock(torch.nn.Module):
    """``x + moe(x)``, the MoE's experts all on this rank."""

    def __init__(self, aux_loss_coef: float) -> None:
        super().__init__()
        self.moe = ep.MoE(DIM, HIDDEN, 4, top_k=2, aux_loss_coef=aux_loss_coef)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(x)


def moe_blocks(aux_loss_coef: float) -> list[torch.nn.Module]:
    torch.manual_seed(11)
    return [MoEBlock(aux_loss_coef).double() for _ in range(2)]


def check_pipeline_aux_loss(key: str, microbatches: int, loss_reduction: str) -> None:
    """Two pipeline stages of one MoE block each, m micro-batches: every gradient equals one
    process's for the reduced loss plus ``coef ×`` the micro-batches' mean aux loss (each
    micro-batch's aux term carries coef / m, as Megatron's 1/num_microbatches)."""
    g = grid(dp=hvd.size() // 2, ep=1, pp=2)
    x, target = randn(key, (8, 3, DIM), "x"), randn(key, (8, 3, DIM), "target")
    mse = torch.nn.functional.mse_loss
    stage = pp.PipelineStage(moe_blocks(COEF), g.pp_set, split=[1, 1])
    pipe = pp.Pipeline(stage, mse, microbatches=microbatches, schedule="1f1b", loss_reduction=loss_reduction)
    loss = pipe.step(x if g.coords.pp == 0 else None, target if g.coords.pp == 1 else None)
    reference = torch.nn.Sequential(*moe_blocks(0.0))
    losses, aux = [], []
    for rows, want in zip(x.chunk(microbatches), target.chunk(microbatches)):
        losses.append(mse(reference(rows), want))
        aux.append(sum(block.moe.aux_loss for block in reference))
    total = sum(losses) / (microbatches if loss_reduction == "mean" else 1)
    (total + COEF * sum(aux) / microbatches).backward()
    close(loss.detach(), total.detach(), "pipeline loss")
    mine = reference[g.coords.pp]
    for name, param in stage.named_parameters():
        close(grad_or_zeros(param), grad_or_zeros(mine.get_parameter(name.split(".", 1)[1])), f"gradient of {name}")


def check_errors(key: str) -> None:
    """Refused alike on every rank, before any token moves, naming the problem."""
    n = hvd.size()
    g = grid()
    expect_raises(InvalidArgumentError, lambda: ep.MoE(DIM, HIDDEN, n + 1, process_set=g.ep_set),
                  f"{n + 1} experts do not split over the expert-parallel size {n}", "experts not divisible")
    expect_raises(InvalidArgumentError, lambda: ep.MoE(DIM, HIDDEN, 2, top_k=3), "top_k (3) is more than the 2 "
                  "experts", "top_k above the expert count")
    few = ep.MoE(DIM, HIDDEN, 4 * n, top_k=1, capacity_factor=1.0, process_set=g.ep_set).double()
    expect_raises(InvalidArgumentError, lambda: few(randn(key, (1, 2, DIM), "x")),
                  f"2 tokens × top_k 1 give fewer assignments than the {4 * n} experts", "more experts than tokens")
    expect_raises(InvalidArgumentError, lambda: ProcessGrid(dp=n, ep=3), f"ep = 3 does not divide dp = {n}",
                  "ep not dividing dp")
    width = 3 if hvd.rank() == 0 else 4
    expect_raises(CollectiveMismatchError, lambda: ep.comm.exchange(torch.zeros(n, width), [1] * n, g.ep_set),
                  "float32 of shape (3,)" if hvd.rank() != 0 else "float32 of shape (4,)", "rows of another width")
    wide = DIM + 1 if hvd.rank() == 0 else DIM  # rank 0 built its MoE for wider tokens
    odd = ep.MoE(wide, HIDDEN, 2 * n, process_set=g.ep_set).double()
    expect_raises(CollectiveMismatchError, lambda: odd(randn(key, (1, 4, wide), "odd")),
                  "expert-parallel ranks disagree on the tokens", "a rank with another model width")
    tp_set = grid(dp=n // 2, tp=2, ep=1).tp_set
    expect_raises(InvalidArgumentError, lambda: tp.ParallelTransformerBlock(
        DIM, 2, process_set=tp_set, sequence_parallel=True,
        mlp=ep.MoE(DIM, HIDDEN, 4, expert=lambda: tp.ParallelMLP(DIM, HIDDEN, process_set=tp_set))),
        "not supported with sequence parallelism over a tensor-parallel size of 2", "MoE with SP and TP 2")
    check_pure_ep(key + "/after", 2, None)  # the set still works


_GRIDS: dict[tuple, ProcessGrid] = {}


def grid(dp: int | None = None, tp: int = 1, ep: int | None = None, pp: int = 1) -> ProcessGrid:
    n = hvd.size()
    shape = (dp or n, tp, ep or n, pp)
    if shape not in _GRIDS:
        _GRIDS[shape] = ProcessGrid(dp=shape[0], tp=tp, ep=shape[2], pp=pp)
    return _GRIDS[shape]


def main() -> None:
    hvd.init()
    grid()
    grid(dp=hvd.size() // 2, tp=2, ep=1)
    grid(dp=hvd.size() // 2, ep=1, pp=2)
    if hvd.size() == 4:
        grid(dp=4, ep=2)
        grid(dp=2, tp=2, ep=2)
    checks = _harness.Checks()
    for top_k in (1, 2):
        for capacity in (None, 1.0, 0.5):
            name = "dropless" if capacity is None else f"capacity{capacity:g}"
            checks.add(f"moe/top{top_k}/{name}", check_pure_ep, top_k, capacity)
    if hvd.size() == 4:
        checks.add("moe/ep2_dp4/expert_gradients_over_edp", check_ep_with_dp)
        checks.add("moe/ep2_tp2/tensor_parallel_experts", check_ep_with_tp)
    for microbatches in (1, 2, 4):
        for reduction in ("mean", "sum"):
            checks.add(f"moe/pp2/aux_loss/microbatches{microbatches}/{reduction}", check_pipeline_aux_loss,
                       microbatches, reduction)
    checks.add("errors/bad_layouts_and_inputs", check_errors)
    _harness.run(checks)
    hvd.shutdown()


if __name__ == "__main__":
    main()
