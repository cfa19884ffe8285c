"""The small decoder-only GPT of ``benchmarks/peers.py``, in plain torch (``nn.Linear``,
``nn.LayerNorm``, ``scaled_dot_product_attention``), so that psrt and the PyTorch peers run
the same computation and nothing of psrt sits in the peers' path.

It is a list of blocks, [embedding, transformer block x layers, head], as
``examples/tiny_gpt.py`` is: ``nn.Sequential(*blocks)`` is the whole model, and a pipeline
cuts the list.  (tiny_gpt itself is built from psrt's tensor-parallel layers, whose
region functions copy activations even without a TP set.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 128
    sequence_length: int = 128
    dim: int = 256
    heads: int = 8
    layers: int = 4


class Embedding(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab_size, config.dim)
        self.positions = nn.Embedding(config.sequence_length, config.dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # through the module, not ``self.positions.weight``: ZeRO-3 gathers a module's
        # parameters around that module's own forward only
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))


class Block(nn.Module):
    """Pre-norm: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``; causal attention."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.ln1, self.ln2 = nn.LayerNorm(config.dim), nn.LayerNorm(config.dim)
        self.qkv, self.out = nn.Linear(config.dim, 3 * config.dim), nn.Linear(config.dim, config.dim)
        self.fc1, self.fc2 = nn.Linear(config.dim, 4 * config.dim), nn.Linear(4 * config.dim, config.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, sequence, dim = x.shape
        q, k, v = (t.view(batch, sequence, self.heads, dim // self.heads).transpose(1, 2)
                   for t in self.qkv(self.ln1(x)).chunk(3, dim=-1))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, sequence, dim))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Head(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(config.dim)
        self.out = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def build_blocks(config: GPTConfig, seed: int = 0) -> list[nn.Module]:
    """The model as a list of blocks; the same seed gives the same weights on every rank."""
    torch.manual_seed(seed)
    return [Embedding(config), *(Block(config) for _ in range(config.layers)), Head(config)]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def synthetic_batch(config: GPTConfig, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` random sequences and the same shifted by one (targets)."""
    ids = torch.randint(0, config.vocab_size, (rows, config.sequence_length + 1),
                        generator=torch.Generator().manual_seed(seed))
    return ids[:, :-1], ids[:, 1:]
