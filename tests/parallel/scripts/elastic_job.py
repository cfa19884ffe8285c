"""An elastic training job for tests/parallel/test_elastic.py, written against hvd.elastic.

``--mode dp|zero2|ps`` trains a small MLP on fixed synthetic data with an ElasticSampler and
a global batch kept at every size (plain DistributedOptimizer with SGD + momentum, ZeRO-2
with Adam, or a synchronous parameter server with SGD + momentum); ``--mode tppp`` trains
the tiny GPT on a TP 2 x PP 2 grid (``--tp``, ``--pp``: another grid, the rest of the ranks
data-parallel; ``--no-grid``: as a plain data-parallel model with no grid at all;
``--dropout``: its dropout, drawn per TP rank in the attention; ``--float64``:
in double precision, where AdamW's steps of nearly-zero gradient entries no longer depend on
the summation order, so that layouts can be compared closely).  The losses are kept in the committed state, so the
last launch ends holding the whole run's losses; rank 0 saves them and the full model to
``--out``.  Run under plain ``python`` it is the one-process reference.

Faults: ``--kill-step S`` SIGKILLs rank ``--kill-rank`` right after step S on launch
``--kill-step-launch`` (the first by default); ``--kill-in-commit N`` SIGKILLs it inside
commit N on the first launch, after writing its own file and before the commit is published.  ``--step-sleep`` slows each step, so that a test
can change the hosts mid-run.  ``--keep-resumed DIR`` copies, on a relaunch,
the commit it resumed from to DIR (to run the uninterrupted reference from it).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time

import torch
import torch.nn.functional as F

import psrt.torch as hvd
from psrt.elastic import commits

import _listeners

STEPS_PER_EPOCH = 16


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("dp", "zero2", "ps", "tppp"), default="dp")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default=None)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--no-grid", action="store_true")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--float64", action="store_true")
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--commit-every", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=24)
    p.add_argument("--kill-step", type=int, default=None)
    p.add_argument("--kill-in-commit", type=int, default=None)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--kill-step-launch", type=int, default=1, help="the launch whose --kill-step kills")
    p.add_argument("--keep-resumed", default=None)
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step also takes (to act mid-run)")
    p.add_argument("--out", required=True)
    return p.parse_args()


def launch() -> int:
    return int(os.environ.get("PSRT_ELASTIC_LAUNCH", "1"))


def die_inside_commit(number: int, rank: int) -> None:
    """Make ``rank`` die in commit ``number`` once its own file is written."""
    original = commits.CommitStore.save

    def save(store, document, commit, name):
        written = original(store, document, commit, name)
        if commit == number and name == commits.rank_file(rank):
            os.kill(os.getpid(), signal.SIGKILL)
        return written

    commits.CommitStore.save = save


def mlp_job(args: argparse.Namespace):
    """The MLP, its optimizer and data; returns (state, step function, full-model function)."""
    torch.manual_seed(0)  # the same initial model on every rank (ZeRO insists)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(STEPS_PER_EPOCH * args.global_batch, 16, generator=generator)
    y = (x @ torch.randn(16, 4, generator=generator)).argmax(dim=1)
    dataset = torch.utils.data.TensorDataset(x, y)
    kind = args.optimizer or ("adam" if args.mode == "zero2" else "sgd")
    options = {"lr": 0.01} if kind == "adam" else {"lr": 0.05, "momentum": 0.9}
    cls = torch.optim.Adam if kind == "adam" else torch.optim.SGD
    if args.mode == "zero2" and hvd.size() > 1:
        from psrt.zero import ZeroOptimizer
        optimizer = ZeroOptimizer(model, cls, stage=2, **options)
    elif args.mode == "ps" and os.environ.get("PSRT_NUM_SERVERS"):
        from psrt import ps
        optimizer = ps.DistributedOptimizer(cls(model.parameters(), **options),
                                            named_parameters=model.named_parameters())
    else:
        optimizer = hvd.DistributedOptimizer(cls(model.parameters(), **options),
                                             named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=7)
    plan = hvd.elastic.plan_batch(args.global_batch, hvd.size())
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, step=0, losses=[])
    position = {"batch": 0}  # batches since the sampler's last reset

    def step() -> float:
        if state.step % STEPS_PER_EPOCH == 0 and sampler.epoch != state.step // STEPS_PER_EPOCH:
            sampler.set_epoch(state.step // STEPS_PER_EPOCH)
            position["batch"] = 0
        mine = sampler.get_indices(position["batch"], plan.rank_batch)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[mine]), y[mine])
        loss.backward()
        optimizer.step()
        sampler.record_batch(position["batch"], plan.rank_batch)
        position["batch"] += 1
        return loss.detach()

    return state, step, lambda: {k: v.clone() for k, v in model.state_dict().items()}


def gpt_job(args: argparse.Namespace):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples"))
    from tiny_gpt import GPTConfig, batch, build_trainer, corpus
    from psrt.full_state import full_state_dict
    from psrt.grid import ProcessGrid

    if args.float64:
        torch.set_default_dtype(torch.float64)
    data, alphabet = corpus()
    config = GPTConfig(vocab_size=len(alphabet), sequence_length=16, dim=32, heads=4, layers=4,
                       dropout=args.dropout)
    if args.no_grid:
        return plain_gpt_job(config, data)
    grid = ProcessGrid(dp=hvd.size() // (args.tp * args.pp), tp=args.tp, pp=args.pp)
    trainer = build_trainer(config, grid, microbatches=2)
    generator = torch.Generator().manual_seed(5)
    state = hvd.elastic.TorchState(trainer.stage, trainer.optimizers[0], grid=grid, step=0, losses=[],
                                   data=generator.get_state())

    def step() -> torch.Tensor:
        generator.set_state(state.data)
        inputs, targets = batch(data, 4, config.sequence_length, generator)
        state.data = generator.get_state()
        rows = slice(grid.coords.dp * 4 // grid.shape.dp, (grid.coords.dp + 1) * 4 // grid.shape.dp)
        loss = trainer.pipeline.step(inputs[rows] if grid.is_first_stage else None,
                                     targets[rows] if grid.is_last_stage else None)
        trainer.optimizers[0].step()
        trainer.optimizers[0].zero_grad()
        # the last stage's dp x tp ranks hold the loss: scaled so that the average over all ranks is its mean
        share = hvd.size() / (grid.shape.dp * grid.shape.tp)
        return loss.detach().double() * share if grid.is_last_stage else torch.zeros((), dtype=torch.float64)

    return state, step, lambda: full_state_dict(trainer.stage, grid)


def plain_gpt_job(config, data: torch.Tensor):
    """The tiny GPT as one model on every rank, data-parallel over the world, without a grid:
    what a TP x PP commit restores into as the single-process model."""
    from tiny_gpt import batch, build_blocks, loss_function

    model = torch.nn.Sequential(*build_blocks(config))
    optimizer = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3),
                                         named_parameters=model.named_parameters())
    loss_fn = loss_function(config, None)
    generator = torch.Generator().manual_seed(5)
    state = hvd.elastic.TorchState(model, optimizer, step=0, losses=[], data=generator.get_state())

    def step() -> torch.Tensor:
        generator.set_state(state.data)
        inputs, targets = batch(data, 4, config.sequence_length, generator)
        state.data = generator.get_state()
        rows = slice(hvd.rank() * 4 // hvd.size(), (hvd.rank() + 1) * 4 // hvd.size())
        loss = loss_fn(model(inputs[rows]), targets[rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach().double()

    return state, step, lambda: {key: value.clone() for key, value in model.state_dict().items()}


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)
    if args.kill_in_commit is not None and launch() == 1:
        die_inside_commit(args.kill_in_commit, args.kill_rank)
    state, step, full_model = (gpt_job if args.mode == "tppp" else mlp_job)(args)

    @hvd.elastic.run
    def train(state):
        horovods = [os.environ.get(f"HOROVOD_{name}") for name in ("RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE")]
        assert horovods == [str(n) for n in (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size())], \
            f"HOROVOD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE are {horovods} on rank {hvd.rank()} of {hvd.size()}"
        if hvd.rank() == 0:
            print(f"launch {os.environ.get('PSRT_ELASTIC_LAUNCH', '-')}: {hvd.size()} ranks from step {state.step} "
                  f"(resumed from commit {state.restored_from})", flush=True)
            if os.environ.get("PSRT_ELASTIC_LAUNCH") == "1":  # the launch psrun's note is about
                print(_listeners.snapshot_line(), flush=True)
            if args.keep_resumed and state.restored_from is not None:
                shutil.copytree(state._store.directory(state.restored_from),
                                os.path.join(args.keep_resumed, os.path.basename(
                                    state._store.directory(state.restored_from))), dirs_exist_ok=True)
                shutil.copy(os.path.join(state._store.root, commits.LATEST), args.keep_resumed)
        while state.step < args.steps:
            loss = step()
            time.sleep(args.step_sleep)
            state.losses.append(hvd.allreduce(loss.reshape(1), name="elastic_job.loss").item())
            state.step += 1
            if args.kill_step == state.step and hvd.rank() == args.kill_rank and launch() == args.kill_step_launch:
                os.kill(os.getpid(), signal.SIGKILL)
            if state.step % args.commit_every == 0:
                state.commit()

    train(state)
    model = full_model()
    if hvd.rank() == 0:
        torch.save({"losses": state.losses, "model": model, "size": hvd.size()}, args.out)
        print(f"done: {len(state.losses)} steps on {hvd.size()} ranks", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
