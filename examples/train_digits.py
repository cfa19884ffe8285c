"""Data-parallel training of a small MLP on scikit-learn's handwritten digits, the Horovod way.

Run with ``psrun -np 2 python examples/train_digits.py`` (or ``make demo``); a
plain ``python examples/train_digits.py`` trains on one process.  The script is
written as a Horovod user writes one: only the import names psrt.  The 8x8
digits ship inside scikit-learn, so nothing is downloaded.  Rank 0 shows a
progress bar and ends with a line ``test accuracy 0.97``.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from tqdm import tqdm

import psrt.torch as hvd


def load_data(seed: int) -> tuple[torch.Tensor, ...]:
    """The same train/test split on every rank: the seed fixes it, so no rank needs to send data."""
    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)   # pixels are 0..16
    y = torch.tensor(digits.target, dtype=torch.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed,
                                                        stratify=y)
    return x_train, x_test, y_train, y_test


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


def train_epoch(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                steps: int, batch_size: int) -> float:
    """One pass over this rank's shard in ``steps`` batches; returns the mean loss over ranks.

    Every rank must take the same number of steps, since each ``optimizer.step()``
    pairs up with the other ranks' allreduces.
    """
    model.train()
    order = torch.randperm(len(x))
    total = 0.0
    for step in range(steps):
        batch = order[step * batch_size:(step + 1) * batch_size]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[batch]), y[batch])
        loss.backward()
        optimizer.step()
        total += loss.item()
    return hvd.allreduce(torch.tensor(total / steps), name="train_loss").item()


def train_epochs(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                 steps: int, args: argparse.Namespace, description: str) -> None:
    """``args.epochs`` epochs, with a progress bar showing the loss on rank 0."""
    with tqdm(range(args.epochs), desc=description, unit="epoch", disable=hvd.rank() != 0) as epochs:
        for _ in epochs:
            loss = train_epoch(model, optimizer, x, y, steps, args.batch_size)
            epochs.set_postfix(loss=f"{loss:.4f}")


@torch.no_grad()
def test_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Accuracy over the whole test set: each rank scores its shard, the counts are summed."""
    model.eval()
    shard = slice(hvd.rank(), None, hvd.size())
    correct = (model(x[shard]).argmax(dim=1) == y[shard]).sum()
    counts = hvd.allreduce(torch.stack([correct, torch.tensor(len(y[shard]))]), op=hvd.Sum,
                           name="test_counts")
    return counts[0].item() / counts[1].item()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.02, help="learning rate of one rank; scaled by size")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)   # one core per rank: more threads only contend with the other ranks
    # Different initial weights and shuffles on each rank; broadcast_parameters below makes the
    # weights agree, which is what it is for.
    torch.manual_seed(args.seed + hvd.rank())

    x_train, x_test, y_train, y_test = load_data(args.seed)
    x_mine, y_mine = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]
    # The smallest shard sets the step count, so every rank takes the same number of steps.
    steps = len(x_train) // hvd.size() // args.batch_size
    if steps == 0:
        raise SystemExit(f"batch size {args.batch_size} x {hvd.size()} ranks is more than the "
                         f"{len(x_train)} training samples; pass a smaller --batch-size")

    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    train_epochs(model, optimizer, x_mine, y_mine, steps, args, f"training on {hvd.size()} rank(s)")

    accuracy = test_accuracy(model, x_test, y_test)
    if hvd.rank() == 0:
        print(f"test accuracy {accuracy:.4f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
