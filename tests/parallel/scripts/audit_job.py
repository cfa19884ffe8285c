"""A short tour of psrt's main paths, for the unwatched-wait audit (``tests/parallel/test_unwatched.py``).

``main`` (2 ranks): the engine's collectives, blocking (the slow path, then the express path,
also when the other rank brings news of its own), asynchronous, of objects, on a process set
and after a join; ``DistributedOptimizer``; ZeRO-3 with a collective save and load; the tiny
GPT on TP 2, PP 2, CP 2 and DP 2 × EP 2 grids (ZeRO-1 on one); the plan probe's
point-to-point messages; and, on purpose, one unmarked wait (:func:`control`).  ``ps`` (1
server, 2 workers): a parameter-server ``DistributedOptimizer`` with a save and a load.
Each ends with psrt's exit-time shutdown.  Rank 0 prints ``AUDIT DONE`` once every part has
run; the checker writes its summary at exit.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

import psrt.torch as hvd

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "examples"))


def engine() -> None:
    rank = hvd.rank()
    ones = torch.ones(4)
    for _ in range(2):  # the first call negotiates the name, the second takes the express path
        assert torch.equal(hvd.allreduce(ones, name="audit.x"), ones)
    # An express call whose round meets the other rank's news (a new name): its slow path.
    if rank == 1:
        news = hvd.allreduce_async(ones, name="audit.news")
    hvd.allreduce(ones, name="audit.x")
    if rank == 1:
        hvd.synchronize(news)
    else:
        hvd.allreduce(ones, name="audit.news")
    handles = [hvd.allreduce_async(torch.full((3,), float(i)), name=f"audit.async.{i}") for i in range(3)]
    assert [hvd.synchronize(h).tolist() for h in handles] == [[float(i)] * 3 for i in range(3)]
    assert hvd.allgather(torch.tensor([rank]), name="audit.gather").tolist() == [0, 1]
    assert hvd.broadcast(torch.tensor([rank]), root_rank=1, name="audit.broadcast").tolist() == [1]
    hvd.alltoall(torch.arange(2), name="audit.alltoall")
    hvd.reducescatter(torch.ones(4), name="audit.reducescatter")
    assert hvd.broadcast_object({"from": rank}, root_rank=0) == {"from": 0}
    assert hvd.allgather_object(rank) == [0, 1]
    hvd.barrier()
    both = hvd.add_process_set([0, 1])
    hvd.allreduce(ones, name="audit.set", process_set=both)
    hvd.remove_process_set(both)
    for _ in range(1 + rank):  # uneven: rank 0 joins first and contributes zeros
        hvd.allreduce(ones, name="audit.uneven")
    hvd.join()


def data_parallel() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                         named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()


def zero(directory: str) -> None:
    from psrt.zero import ZeroOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    optimizer = ZeroOptimizer(model, torch.optim.Adam, stage=3, lr=0.01)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
    optimizer.save(directory)
    optimizer.load(directory)


def grids() -> None:
    from tiny_gpt import GPTConfig, batch, build_trainer, corpus, train_step

    from psrt.grid import ProcessGrid

    data, alphabet = corpus()
    dense = GPTConfig(vocab_size=len(alphabet), sequence_length=8, dim=16, heads=2, layers=2)
    layouts = [({"tp": 2}, dense, {}), ({"pp": 2}, dense, {"zero": True}), ({"cp": 2}, dense, {}),
               ({"dp": 2, "ep": 2}, GPTConfig(**{**dense.__dict__, "experts": 2}), {})]
    for shape, config, options in layouts:
        trainer = build_trainer(config, ProcessGrid(**shape), microbatches=2, **options)
        inputs, targets = batch(data, 4, config.sequence_length, torch.Generator().manual_seed(1))
        train_step(trainer, inputs, targets)


def probe() -> None:
    from psrt.plan import probe

    probe.point_to_point((4 << 10, 1 << 20), repeats=1)


def control() -> None:
    """A wait on the other rank that psrt never makes unmarked, made so here on purpose: the
    checker must list it on every rank (the test expects it, and nothing else)."""
    from psrt import runtime
    from psrt.comm import bootstrap

    hosts = bootstrap.host_groups(runtime.current().topology.world)
    hosts.local.free()
    hosts.cross.free()


def parameter_server(directory: str) -> None:
    from psrt import ps

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = ps.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        named_parameters=model.named_parameters())
    for _ in range(2):
        optimizer.zero_grad()
        F.mse_loss(model(torch.randn(4, 8)), torch.zeros(4, 2)).backward()
        optimizer.step()
    path = os.path.join(directory, "ps")
    optimizer.save(path)
    optimizer.load(path)


def main(part: str, directory: str) -> None:
    hvd.init()
    torch.set_num_threads(1)
    if part == "main":
        engine()
        data_parallel()
        zero(os.path.join(directory, "zero"))
        grids()
        probe()
        control()
    else:
        parameter_server(directory)
    if hvd.rank() == 0:
        print("AUDIT DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])  # main|ps, a directory every rank sees
