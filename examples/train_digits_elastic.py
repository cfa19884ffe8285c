"""Elastic data-parallel training of the digits MLP, written against Horovod's elastic API.

``make demo-elastic`` runs it on three one-slot groups of this machine with
``psrun --hostfile F --min-np 2 --max-np 3 --restarts 1`` and kills rank 1 in epoch 5,
as if its host were lost: psrun drops that slot group, relaunches the job on the two
left, and training continues from the last ``state.commit()``.  The global batch stays
the same at every size (``--keep rank`` keeps each rank's batch and scales the learning
rate instead), and the ``ElasticSampler`` resumes the epoch with the samples not yet
seen, so the run follows the same course whatever happens to its ranks.  Rank 0 ends with
``test accuracy 0.97``-like output.
"""
from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.nn.functional as F
from tqdm import tqdm

import psrt.torch as hvd
from train_digits import load_data, make_model, test_accuracy


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--global-batch", type=int, default=96, help="samples per step over all ranks")
    p.add_argument("--keep", choices=("global", "rank"), default="global",
                   help="on a new rank count keep the global batch (default) or each rank's batch")
    p.add_argument("--base-size", type=int, default=3, help="the rank count --global-batch is meant for "
                                                            "(with --keep rank)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--commit-every", type=int, default=4, help="steps between commits")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill-rank", type=int, default=None, help="demo: this rank dies (SIGKILL) on the first launch")
    p.add_argument("--kill-at-epoch", type=int, default=5)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    x_train, x_test, y_train, y_test = load_data(args.seed)
    dataset = torch.utils.data.TensorDataset(x_train, y_train)
    model = make_model()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
                                         named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=args.seed)
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, losses=[])
    first_launch = os.environ.get("PSRT_ELASTIC_LAUNCH", "1") == "1"

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        plan = hvd.elastic.plan_batch(args.global_batch, hvd.size(), keep=args.keep, base_size=args.base_size)
        for group in optimizer.param_groups:
            group["lr"] = args.lr * plan.lr_scale
        if hvd.rank() == 0 and state.restored_from is not None:
            print(f"resumed from commit {state.restored_from} in epoch {state.epoch} on {hvd.size()} ranks, "
                  f"{plan.rank_batch} samples per rank per step", flush=True)
        with tqdm(total=args.epochs, initial=state.epoch, desc=f"training on {hvd.size()} ranks", unit="epoch",
                  disable=hvd.rank() != 0) as bar:
            for state.epoch in range(state.epoch, args.epochs):
                if sampler.epoch != state.epoch:
                    sampler.set_epoch(state.epoch)
                loader = torch.utils.data.DataLoader(dataset, batch_size=plan.rank_batch, sampler=sampler)
                for batch_idx, (x, y) in enumerate(loader):
                    optimizer.zero_grad()
                    loss = F.cross_entropy(model(x), y)
                    loss.backward()
                    optimizer.step()
                    sampler.record_batch(batch_idx, plan.rank_batch)
                    state.losses.append(loss.item())
                    if first_launch and hvd.rank() == args.kill_rank and state.epoch == args.kill_at_epoch:
                        os.kill(os.getpid(), signal.SIGKILL)  # the demo's lost host
                    if (batch_idx + 1) % args.commit_every == 0:
                        state.commit()
                bar.update(1)
                bar.set_postfix(loss=f"{sum(state.losses[-10:]) / max(len(state.losses[-10:]), 1):.4f}")

    train(state)
    accuracy = test_accuracy(model, x_test, y_test)
    if hvd.rank() == 0:
        print(f"test accuracy {accuracy:.4f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
