"""The MoE layer's routing in one process, against computations written out by hand (the
parallel checks compare the sharded layer with this one)."""
from __future__ import annotations

import pytest
import torch

from psrt import ep
from psrt.errors import InvalidArgumentError


def by_hand(layer: ep.MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its top-k experts, weighted by its router probabilities (renormalised
    over the k when k > 1, as Mixtral does; top-1 keeps the probability, as Switch does)."""
    probabilities = torch.softmax(layer.router(x), -1)
    gate, chosen = probabilities.topk(layer.top_k, -1)
    if layer.top_k > 1:
        gate = gate / gate.sum(-1, keepdim=True)
    rows = []
    for t in range(x.shape[0]):
        rows.append(sum(gate[t, j] * layer.experts[str(int(chosen[t, j]))](x[t:t + 1])[0]
                        for j in range(layer.top_k)))
    return torch.stack(rows)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_dropless_routing_is_the_weighted_sum_of_the_chosen_experts(top_k):
    torch.manual_seed(0)
    layer = ep.MoE(6, 10, 4, top_k=top_k).double()
    x = torch.randn(9, 6, dtype=torch.float64)
    torch.testing.assert_close(layer(x), by_hand(layer, x))
    assert layer.dropped == 0


def test_capacity_serves_the_first_tokens_and_counts_the_rest_as_dropped():
    torch.manual_seed(0)
    layer = ep.MoE(4, 8, 4, top_k=1, capacity_factor=1.0).double()
    with torch.no_grad():  # every token prefers expert 2
        layer.router.weight.zero_()
        layer.router.weight[2, 0] = 10.0
    x = torch.randn(8, 4, dtype=torch.float64)
    x[:, 0] = 1.0
    out = layer(x)
    capacity = 2  # ceil(1.0 * 8 tokens * top-1 / 4 experts)
    torch.testing.assert_close(out[:capacity], by_hand(layer, x[:capacity]))
    assert torch.equal(out[capacity:], torch.zeros(8 - capacity, 4, dtype=torch.float64))
    assert layer.dropped == 8 - capacity


def test_load_balancing_loss_is_switch_transformer_s():
    torch.manual_seed(1)
    layer = ep.MoE(5, 7, 3, top_k=2).double()
    x = torch.randn(11, 5, dtype=torch.float64)
    layer(x)
    probabilities = torch.softmax(layer.router(x), -1)
    chosen = probabilities.topk(2, -1).indices
    share = torch.stack([(chosen == e).sum() for e in range(3)]).double() / (11 * 2)
    torch.testing.assert_close(layer.aux_loss, 3 * (share * probabilities.mean(0)).sum())


def test_the_aux_loss_coefficient_adds_its_gradient_as_if_added_to_the_loss():
    torch.manual_seed(2)
    attached = ep.MoE(5, 7, 3, top_k=2, aux_loss_coef=0.5).double()
    plain = ep.MoE(5, 7, 3, top_k=2).double()
    plain.load_state_dict(attached.state_dict())
    x = torch.randn(6, 5, dtype=torch.float64)
    attached(x).sum().backward()
    (plain(x).sum() + 0.5 * plain.aux_loss).backward()
    torch.testing.assert_close(attached.router.weight.grad, plain.router.weight.grad)


def test_bad_configurations_are_refused():
    with pytest.raises(InvalidArgumentError, match="capacity_factor must be positive"):
        ep.MoE(4, 4, 2, capacity_factor=0.0)
    with pytest.raises(InvalidArgumentError, match="num_experts must be a positive int"):
        ep.MoE(4, 4, 0)
