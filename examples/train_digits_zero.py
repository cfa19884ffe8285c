"""Training the digits MLP with ZeRO: sharded optimizer state, gradients and parameters.

Run with ``psrun -np 2 python examples/train_digits_zero.py`` (``make demo-zero``).  It is
``examples/train_digits.py`` with ``psrt.zero.ZeroOptimizer`` in place of
``hvd.DistributedOptimizer``, trained once per stage (``--stage all``, the default: 1, 2
and 3).  After training, each stage saves a sharded checkpoint, consolidates it into an
ordinary ``state_dict`` (what ``psrt zero-to-full`` does), and rank 0 scores a plain,
unwrapped copy of the model loaded from it, which must agree with the sharded model.
Rank 0 shows a progress bar per stage and ends each with a line such as
``stage 2: test accuracy 0.97 (consolidated copy 0.97), Adam state per rank 18.4 KB``.
"""
from __future__ import annotations

import argparse
import tempfile

import torch

import psrt.torch as hvd
from psrt.zero import ZeroOptimizer, consolidate
from train_digits import load_data, make_model, test_accuracy, train_epochs


def train(stage: int, args: argparse.Namespace, data: tuple[torch.Tensor, ...], directory: str) -> str:
    """Train and checkpoint one stage; rank 0 returns its report line."""
    x_train, x_test, y_train, y_test = data
    x_mine, y_mine = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]
    steps = len(x_train) // hvd.size() // args.batch_size
    # ZeRO refuses parameters that differ across ranks: every rank starts from the same seed
    # (or call hvd.broadcast_parameters before wrapping).  Shuffles then differ per rank.
    torch.manual_seed(args.seed)
    model = make_model()
    optimizer = ZeroOptimizer(model, torch.optim.Adam, stage=stage, lr=args.lr)
    torch.manual_seed(args.seed + 1 + hvd.rank())
    train_epochs(model, optimizer, x_mine, y_mine, steps, args, f"stage {stage}: training on {hvd.size()} rank(s)")
    accuracy = test_accuracy(model, x_test, y_test)
    state_bytes = optimizer.memory_report()["optimizer"]
    optimizer.save(f"{directory}/stage{stage}", extra={"epochs": args.epochs})
    if hvd.rank() != 0:
        return ""
    plain = make_model()
    plain.load_state_dict(consolidate(f"{directory}/stage{stage}")["model"])
    with torch.no_grad():
        plain_accuracy = (plain(x_test).argmax(dim=1) == y_test).float().mean().item()
    return (f"stage {stage}: test accuracy {accuracy:.2f} (consolidated copy {plain_accuracy:.2f}), "
            f"Adam state per rank {state_bytes / 1e3:.1f} KB")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", choices=("1", "2", "3", "all"), default="all")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default=None, help="where to save (default: a temporary directory)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)
    data = load_data(args.seed)
    stages = (1, 2, 3) if args.stage == "all" else (int(args.stage),)
    with tempfile.TemporaryDirectory() as scratch:
        # Every rank writes into the directory rank 0 names (across hosts it must be shared).
        directory = hvd.broadcast_object(args.checkpoint_dir or scratch, root_rank=0, name="checkpoint_dir")
        for stage in stages:
            line = train(stage, args, data, directory)
            if hvd.rank() == 0:
                print(line, flush=True)
        hvd.barrier()
    hvd.shutdown()


if __name__ == "__main__":
    main()
