"""Training a small MLP on scikit-learn's handwritten digits against parameter servers.

Run with ``psrun -np 3 --num-servers 1 python examples/train_digits_ps.py``: one
rank becomes a parameter server, which holds the model and runs the optimizer,
and the other two are workers, which push gradients and pull parameters.  It is
``examples/train_digits.py`` with ``psrt.ps.DistributedOptimizer`` in place of
``hvd.DistributedOptimizer``, trained once per consistency mode (``--mode all``,
the default): sync (one update per step from every worker's gradient), async
(each gradient applied on arrival) and bounded (async, but no worker more than
``--max-staleness`` steps ahead of the slowest).  The 8x8 digits ship inside
scikit-learn, so nothing is downloaded.  Worker 0 shows a progress bar per mode
and ends each with a line ``mode sync: test accuracy 0.97``.
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

import psrt.ps
import psrt.torch as hvd
# The data, the model and an epoch's loop are the allreduce example's: only the optimizer differs.
from train_digits import load_data, make_model, train_epochs

MODES = ("sync", "async", "bounded")


@torch.no_grad()
def test_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """Accuracy over the whole test set, averaged over workers.

    Each worker scores the whole set with its own copy of the parameters: in sync
    mode the copies are identical, in async and bounded mode a worker's last pull
    may miss the other workers' last gradients, so the copies differ slightly.
    """
    model.eval()
    accuracy = (model(x).argmax(dim=1) == y).float().mean()
    return hvd.allreduce(accuracy, name="test_accuracy").item()   # the mean over workers


def train(mode: str, args: argparse.Namespace, data: tuple[torch.Tensor, ...]) -> float:
    """Train a freshly initialised model in ``mode``; returns its test accuracy."""
    x_train, x_test, y_train, y_test = data
    x_mine, y_mine = x_train[hvd.rank()::hvd.size()], y_train[hvd.rank()::hvd.size()]
    # The smallest shard sets the step count, so every worker takes the same number of steps.
    steps = len(x_train) // hvd.size() // args.batch_size
    # Different initial weights and shuffles on each worker; the servers take worker 0's
    # weights and every worker starts from them, so no broadcast_parameters is needed.
    torch.manual_seed(args.seed + hvd.rank())
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # Each wrapper creates its own KVStore on the servers; every worker creates them in the
    # same order.  With reduce="mean" (the default) a gradient counts 1/size in every mode,
    # so the same learning rate suits all three.
    optimizer = psrt.ps.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), mode=mode,
                                             max_staleness=args.max_staleness if mode == "bounded" else None)

    train_epochs(model, optimizer, x_mine, y_mine, steps, args, f"{mode}: training on {hvd.size()} worker(s)")
    return test_accuracy(model, x_test, y_test)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=(*MODES, "all"), default="all",
                   help="consistency mode of the parameter servers; all trains once in each (default)")
    p.add_argument("--max-staleness", type=int, default=1,
                   help="bounded mode: how many steps a worker may run ahead of the slowest")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32, help="samples per worker per step")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate of the servers' SGD")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    hvd.init()   # on a server rank this serves until the workers shut down, then exits
    if psrt.ps.num_servers() == 0:
        raise SystemExit("no parameter servers in this job: launch with "
                         "`psrun -np 3 --num-servers 1 python examples/train_digits_ps.py`")
    torch.set_num_threads(1)   # one core per rank: more threads only contend with the other ranks

    data = load_data(args.seed)
    if len(data[0]) // hvd.size() // args.batch_size == 0:
        raise SystemExit(f"batch size {args.batch_size} x {hvd.size()} workers is more than the "
                         f"{len(data[0])} training samples; pass a smaller --batch-size")
    for mode in MODES if args.mode == "all" else (args.mode,):
        accuracy = train(mode, args, data)
        if hvd.rank() == 0:
            print(f"mode {mode}: test accuracy {accuracy:.4f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
