"""Parameter-server benchmark: push and pull bandwidth of ``psrt.ps.KVStore`` against raw
mpi4py point-to-point between the same ranks, and training throughput in sync PS mode
against allreduce data parallelism on the same worker ranks, same run.

Run under psrun with at least one server and one worker::

    psrun -np 3 --num-servers 1 python benchmarks/ps.py               # both parts, under 2 minutes
    psrun -np 3 --num-servers 1 python benchmarks/ps.py --bandwidth   # push/pull bandwidth only
    psrun -np 3 --num-servers 1 python benchmarks/ps.py --train       # training throughput only
    psrun -np 4 --num-servers 2 python benchmarks/ps.py               # 2 servers, 2 workers

Bandwidth part.  One float32 key per size (1, 4, 16 and 64 MiB; ``--sizes``) in one
KVStore with mode="async", reduce="sum" and no optimizer, so a server stores each pushed
value as it arrives (MXNet's KVStore without an updater): no arithmetic, the figure is
the protocol and the transport.  Every worker works at once, on the same keys:

  push  a window of ``--reps`` R ``kv.push(key, t)`` closed by one ``kv.pull(key, out=buf)``.
        A push returns once its data is sent; only the pull, answered after this worker's
        pushes are applied, says the server has them.  The closing pull moves the bytes
        back, so push GB/s = (R + 1) x bytes / window time;
  pull  one ``kv.pull(key, out=buf)`` into a preallocated tensor, timed per call.

The mpi4py baseline moves the same messages between the same ranks: psrt cuts a tensor
larger than ``PSRT_PS_CHUNK_BYTES`` (4 MiB) into chunks spread over the servers, and
the baseline sends each chunk (placed by psrt's own ``Placement``) to its server the
same way.  Push: per repetition the worker ``Isend``s every chunk and waits, while the
server has one ``Irecv`` posted per worker and chunk; the window closes with the server
sending every chunk back.  Pull: the server ``Isend``s its chunks to every worker at
once, the workers ``Irecv`` them.  No header, no request, no copy into a stored value:
the bound for psrt on this transport.  The workers' buffers are torch tensors in both
(a user pushes and pulls tensors; torch's allocator gives them no transparent huge
pages, which MPI's single-copy path moves about half as fast as numpy's; run with
``THP_MEM_ALLOC_ENABLE=1`` to give torch's large tensors huge pages too); the servers'
are numpy arrays for mpi4py and psrt's own (numpy-allocated) buffers.  Target
psrt/mpi4py >= 0.9 for push and pull at every size.  A second pull baseline,
``mpi4py_request``, adds what a pull on demand cannot do without: the worker sends a
request of 16 int64 per chunk (psrt's header) and the server sends each chunk as soon as
its request arrives; psrt/mpi4py_request is reported beside the target, to tell the
request round trip apart from psrt's own costs.

Server ranks serve inside ``psrt.init()`` and never return, so the baseline, which
needs them, runs first, all of it, on a duplicate of COMM_WORLD that is freed before
``psrt.init()``; it cannot take turns with psrt, which runs right after it.  Within
each, the sizes take turns for ``--rounds`` rounds (a push window, then R pulls of each
kind), after one untimed warm-up window per size that also checks the data.  Every timed
window or call starts after a barrier of the ranks taking part; its time is the slowest
worker's and the figure is the median.  Bandwidth is per worker (the servers together
move workers x that).

Training part.  MLP 784-1024-1024-10 (1.86 M parameters, as in train_dp.py), SGD with
lr 1e-3 and momentum 0.9, batch 64 of synthetic data per worker (different on each),
one torch thread per rank (servers included), for

  no_comm    every worker trains its own copy without communicating: the ceiling on this
             machine, with the server ranks idle in their loop;
  ps_sync    ``psrt.ps.DistributedOptimizer(..., mode="sync")``: each gradient is pushed from
             its backward hook, the servers average the step's gradients and run the SGD,
             ``step()`` pulls the new values;
  allreduce  ``psrt.torch.DistributedOptimizer`` over the same workers (the allreduce world
             is the workers only; the servers idle).

They take turns: each round gives every one 2 untimed steps and then a timed window of
``--steps`` steps, started after a barrier, whose time is the slowest worker's; the figure
is the median over ``--rounds`` rounds.  After timing, the parameters of ps_sync and
allreduce are compared across workers (``in_sync``): both must be bit-identical.

Worker 0 prints a table per part and one JSON line ``{"benchmark": "ps", ...}`` with every
figure.  Figures and targets are reported, never asserted.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import psrt
import psrt.ps
import psrt.torch as hvd
from psrt.comm.header import HEADER_WORDS
from psrt.config import config_from_env
from psrt.ps.placement import Chunk, Placement
from psrt.ps.roles import Roles, assign_roles

from _sizes import MiB, fmt_size, parse_size  # noqa: E402
from mpi4py import MPI  # after psrt: psrt's import initialises MPI  # noqa: E402

DEFAULT_SIZES = [1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB]
TARGET = 0.9                  # psrt / mpi4py, push and pull, every size
SERVER_FILL = 0.5             # what the baseline's server sends back
REQUEST_TAG = 20_000          # + chunk id: the baseline's pull requests (data travels on the chunk id)
REQUEST_LEN = HEADER_WORDS     # int64, as psrt's request header
BATCH, LR, MOMENTUM = 64, 1e-3, 0.9
TRAIN_IMPLS = ("no_comm", "ps_sync", "allreduce")

world = MPI.COMM_WORLD
workers_comm = MPI.COMM_NULL  # the workers only (before and after psrt.init()); set in main()
lead = False                  # whether this rank is worker 0, the one that prints


def say(*args: object) -> None:
    if lead:
        print(*args, flush=True)


def job_roles(num_servers: int) -> Roles:
    """The roles ``psrt.init()`` will assign (runtime._parameter_server_roles, on mpi4py):
    the hosts are told apart by the lowest job rank sharing each rank's memory."""
    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
    host_leader = local.allgather(world.rank)[0]
    local.Free()
    return assign_roles(world.allgather(host_leader), num_servers)


# -- bandwidth: the keys and the two implementations ------------------------------------
@dataclass(frozen=True)
class Key:
    name: str
    nbytes: int
    chunks: tuple[Chunk, ...]

    @property
    def numel(self) -> int:
        return self.nbytes // 4


def place_keys(sizes: list[int], num_servers: int, chunk_bytes: int) -> list[Key]:
    """The keys, chunked and placed as psrt places them when a store inits them in this order."""
    placement = Placement(num_servers, chunk_bytes)
    keys = []
    for nbytes in sizes:
        name = f"bw.{fmt_size(nbytes)}"
        keys.append(Key(name, nbytes, placement.add(name, nbytes // 4, 4)))
    return keys


class Transfer(Protocol):
    """One key's push window and its kinds of pull, run by every rank taking part."""

    pulls: dict[str, Callable[[], None]]

    def push(self, reps: int) -> None: ...

    def check(self) -> bool: ...


class RawTransfer:
    """The baseline for one key: one mpi4py message per chunk, between the ranks psrt uses."""

    def __init__(self, comm: MPI.Comm, roles: Roles, key: Key) -> None:
        self.comm = comm
        me = comm.rank
        self.server = roles.is_server(me)
        if self.server:
            index = roles.server_index(me)
            mine = [c for c in key.chunks if c.server == index]
            self.value = {c.chunk_id: np.full(c.numel, SERVER_FILL, dtype=np.float32) for c in mine}
            self.inbox = [(rank, c.chunk_id, np.zeros(c.numel, dtype=np.float32))
                          for rank in roles.workers for c in mine]
            self.outbox = [(rank, c.chunk_id, self.value[c.chunk_id]) for rank in roles.workers for c in mine]
            self.fills = {rank: roles.worker_index(rank) + 1.0 for rank in roles.workers}
            self.requests = [np.zeros(REQUEST_LEN, dtype=np.int64) for _ in self.outbox]
        else:
            # torch-allocated memory, like the tensors psrt's workers push and pull
            self.data = torch.full((key.numel,), roles.worker_index(me) + 1.0).numpy()
            self.out = torch.zeros(key.numel).numpy()
            where = [(roles.servers[c.server], c.chunk_id, slice(c.offset, c.offset + c.numel))
                     for c in key.chunks]
            self.sends = [(rank, tag, self.data[span]) for rank, tag, span in where]
            self.receives = [(rank, tag, self.out[span]) for rank, tag, span in where]
            self.request = np.zeros(REQUEST_LEN, dtype=np.int64)
        self.pulls = {"pull": self.pull, "pull_request": self.pull_on_request}

    def push(self, reps: int) -> None:
        comm = self.comm
        if self.server:
            for _ in range(reps):
                MPI.Request.Waitall([comm.Irecv(buf, source=rank, tag=tag) for rank, tag, buf in self.inbox])
        else:
            for _ in range(reps):
                MPI.Request.Waitall([comm.Isend(buf, dest=rank, tag=tag) for rank, tag, buf in self.sends])
        self.pull()

    def pull(self) -> None:
        comm = self.comm
        if self.server:
            MPI.Request.Waitall([comm.Isend(buf, dest=rank, tag=tag) for rank, tag, buf in self.outbox])
        else:
            MPI.Request.Waitall([comm.Irecv(buf, source=rank, tag=tag) for rank, tag, buf in self.receives])

    def pull_on_request(self) -> None:
        """A request per chunk, each answered with the chunk as soon as it arrives."""
        comm = self.comm
        if self.server:
            asked = [comm.Irecv(request, source=rank, tag=REQUEST_TAG + tag)
                     for request, (rank, tag, _) in zip(self.requests, self.outbox)]
            replies = []
            for _ in asked:
                rank, tag, buf = self.outbox[MPI.Request.Waitany(asked)]
                replies.append(comm.Isend(buf, dest=rank, tag=tag))
            MPI.Request.Waitall(replies)
        else:
            receives = [comm.Irecv(buf, source=rank, tag=tag) for rank, tag, buf in self.receives]
            requests = [comm.Isend(self.request, dest=rank, tag=REQUEST_TAG + tag) for rank, tag, _ in self.receives]
            MPI.Request.Waitall(receives + requests)

    def check(self) -> bool:
        if self.server:
            return all(bool((buf == self.fills[rank]).all()) for rank, _, buf in self.inbox)
        return bool((self.out == SERVER_FILL).all())


class PsrtTransfer:
    """psrt's KVStore on one key (worker ranks only)."""

    def __init__(self, kv: psrt.ps.KVStore, key: Key) -> None:
        self.kv, self.name = kv, key.name
        self.data = torch.full((key.numel,), float(psrt.rank() + 1))
        self.out = torch.zeros(key.numel)
        self.pulls = {"pull": self.pull}
        kv.init(key.name, self.data)

    def push(self, reps: int) -> None:
        for _ in range(reps):
            self.kv.push(self.name, self.data)
        self.kv.pull(self.name, out=self.out)

    def pull(self) -> None:
        self.kv.pull(self.name, out=self.out)

    def check(self) -> bool:
        """The stored value is, chunk by chunk, the last push of some worker: 1 .. workers."""
        return bool(((self.out >= 1) & (self.out <= psrt.size()) & (self.out == self.out.round())).all())


def measure(transfers: dict[int, Transfer], reps: int, rounds: int, barrier: Callable[[], None],
            what: str) -> dict[int, dict[str, list[float]]]:
    """This rank's seconds per push window and per pull of each kind, by size; the sizes take turns."""
    for nbytes, transfer in transfers.items():  # one untimed, checked window per size
        barrier()
        transfer.push(reps)
        if not transfer.check():
            raise RuntimeError(f"{what}: wrong data after pushing and pulling {fmt_size(nbytes)} "
                               f"on job rank {world.rank}")
    times = {n: {kind: [] for kind in ("push", *t.pulls)} for n, t in transfers.items()}
    for _ in range(rounds):
        for nbytes, transfer in transfers.items():
            barrier()
            start = time.perf_counter()
            transfer.push(reps)
            times[nbytes]["push"].append(time.perf_counter() - start)
            for kind, pull in transfer.pulls.items():
                for _ in range(reps):
                    barrier()
                    start = time.perf_counter()
                    pull()
                    times[nbytes][kind].append(time.perf_counter() - start)
    return times


def slowest_medians(times: dict[int, dict[str, list[float]]]) -> dict[int, dict[str, float]]:
    """Per size and kind: the median over windows or calls of the slowest worker's seconds."""
    result: dict[int, dict[str, float]] = {}
    for nbytes, kinds in times.items():
        result[nbytes] = {}
        for kind, samples in kinds.items():
            samples_np = np.array(samples)
            workers_comm.Allreduce(MPI.IN_PLACE, samples_np, op=MPI.MAX)
            result[nbytes][kind] = float(np.median(samples_np))
    return result


def raw_baseline(roles: Roles, keys: list[Key], args: argparse.Namespace) -> dict[int, dict[str, float]] | None:
    """The mpi4py figures, before psrt.init(), on every rank (servers included); None on servers."""
    comm = world.Dup()
    transfers = {key.nbytes: RawTransfer(comm, roles, key) for key in keys}
    times = measure(transfers, args.reps, args.rounds, comm.Barrier, "mpi4py baseline")
    del transfers
    comm.Free()
    return None if roles.is_server(world.rank) else slowest_medians(times)


def psrt_bandwidth(keys: list[Key], args: argparse.Namespace) -> dict[int, dict[str, float]]:
    kv = psrt.ps.KVStore("async", reduce="sum")  # no optimizer: a push stores its value
    transfers = {key.nbytes: PsrtTransfer(kv, key) for key in keys}
    return slowest_medians(measure(transfers, args.reps, args.rounds, workers_comm.Barrier, "psrt"))


def bandwidth_record(keys: list[Key], raw: dict[int, dict[str, float]], ps: dict[int, dict[str, float]],
                     args: argparse.Namespace, num_servers: int) -> dict:
    rows = []
    for key in keys:
        moved = {"push": (args.reps + 1) * key.nbytes, "pull": key.nbytes}
        row: dict = {"bytes": key.nbytes, "chunks": len(key.chunks),
                     "servers_used": len({c.server for c in key.chunks})}
        for kind in ("push", "pull"):
            seconds = {"psrt": ps[key.nbytes][kind], "mpi4py": raw[key.nbytes][kind]}
            gbps = {impl: moved[kind] / s / 1e9 for impl, s in seconds.items()}
            if kind == "pull":
                seconds["mpi4py_request"] = raw[key.nbytes]["pull_request"]
                gbps["mpi4py_request"] = key.nbytes / seconds["mpi4py_request"] / 1e9
            row[kind] = {**{f"{impl}_ms": round(s * 1e3, 3) for impl, s in seconds.items()},
                         **{f"{impl}_GBps": round(v, 3) for impl, v in gbps.items()},
                         **{f"psrt_over_{impl}": round(gbps["psrt"] / v, 3) for impl, v in gbps.items()
                            if impl != "psrt"}}
        rows.append(row)
    targets = [{"target": f"{kind} psrt/mpi4py >= {TARGET} at {fmt_size(r['bytes'])}",
                "value": r[kind]["psrt_over_mpi4py"], "met": r[kind]["psrt_over_mpi4py"] >= TARGET}
               for r in rows for kind in ("push", "pull")]
    return {"servers": num_servers, "reps": args.reps, "rounds": args.rounds,
            "chunk_bytes": config_from_env().ps_chunk_bytes, "sizes": rows, "targets": targets,
            "all_targets_met": all(t["met"] for t in targets)}


def bandwidth_table(record: dict, workers: int) -> str:
    lines = [f"\n## push / pull bandwidth per worker: {workers} worker(s) at once, {record['servers']} "
             f"server(s), float32, GB/s; push = {record['reps']} pushes + 1 pull per window, "
             f"median of {record['rounds']} windows; pull = median of {record['rounds'] * record['reps']} calls; "
             "ratio = psrt / the mpi4py figure left of it",
             f"{'size':>6} {'chunks':>6} | {'push psrt':>9} {'mpi4py':>7} {'ratio':>6} | "
             f"{'pull psrt':>9} {'mpi4py':>7} {'ratio':>6} {'+request':>8} {'ratio':>6} | "
             f"{'pull ms':>8} {'mpi4py':>7} {'+request':>8}"]
    for r in record["sizes"]:
        push, pull = r["push"], r["pull"]
        lines.append(f"{fmt_size(r['bytes']):>6} {r['chunks']:>6} | {push['psrt_GBps']:>9.2f} "
                     f"{push['mpi4py_GBps']:>7.2f} {push['psrt_over_mpi4py']:>6.2f} | {pull['psrt_GBps']:>9.2f} "
                     f"{pull['mpi4py_GBps']:>7.2f} {pull['psrt_over_mpi4py']:>6.2f} "
                     f"{pull['mpi4py_request_GBps']:>8.2f} {pull['psrt_over_mpi4py_request']:>6.2f} | "
                     f"{pull['psrt_ms']:>8.2f} {pull['mpi4py_ms']:>7.2f} {pull['mpi4py_request_ms']:>8.2f}")
    met = sum(t["met"] for t in record["targets"])
    lines.append(f"targets psrt/mpi4py >= {TARGET}: {met}/{len(record['targets'])} met" + "".join(
        f"\n  MISSED {t['target']}: {t['value']:.2f}" for t in record["targets"] if not t["met"]))
    return "\n".join(lines)


# -- training ----------------------------------------------------------------------------
def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 10))


def plain_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor) -> Callable[[], None]:
    """The user's loop; the implementations differ only in the optimizer."""
    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return step


def build_training() -> tuple[dict[str, Callable[[], None]], dict[str, nn.Module], int]:
    """A step per implementation, each on its own copy of one initial model."""
    torch.manual_seed(0)  # the same initial weights on every worker
    base = mlp()
    gen = torch.Generator().manual_seed(1000 + psrt.rank())
    x, y = torch.randn(BATCH, 1, 28, 28, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen)
    models = {impl: copy.deepcopy(base) for impl in TRAIN_IMPLS}
    sgd = {impl: torch.optim.SGD(models[impl].parameters(), lr=LR, momentum=MOMENTUM) for impl in TRAIN_IMPLS}
    optimizers = {
        "no_comm": sgd["no_comm"],
        "ps_sync": psrt.ps.DistributedOptimizer(sgd["ps_sync"], named_parameters=models["ps_sync"].named_parameters(),
                                                mode="sync"),
        "allreduce": hvd.DistributedOptimizer(sgd["allreduce"],
                                              named_parameters=models["allreduce"].named_parameters()),
    }
    steps = {impl: plain_step(models[impl], optimizers[impl], x, y) for impl in TRAIN_IMPLS}
    return steps, models, sum(p.numel() for p in base.parameters())


def timed_window(step: Callable[[], None], steps: int, warmup: int) -> float:
    """Seconds of the slowest worker for ``steps`` steps after ``warmup`` untimed ones."""
    workers_comm.Barrier()
    for _ in range(warmup):
        step()
    workers_comm.Barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return workers_comm.allreduce(time.perf_counter() - start, op=MPI.MAX)


def in_sync(model: nn.Module) -> bool:
    """Whether every worker holds bit-identical parameters."""
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    root = mine.copy()
    workers_comm.Bcast(root, root=0)
    return bool(workers_comm.allreduce(int(np.array_equal(mine, root)), op=MPI.MIN))


def bench_training(args: argparse.Namespace) -> dict:
    steps, models, nparams = build_training()
    windows: dict[str, list[float]] = {impl: [] for impl in TRAIN_IMPLS}
    for _ in range(args.rounds):
        for impl in TRAIN_IMPLS:
            windows[impl].append(timed_window(steps[impl], args.steps, warmup=2))
    workers = psrt.size()
    record: dict = {"params": nparams, "batch_per_worker": BATCH, "steps_per_window": args.steps,
                    "windows": args.rounds}
    for impl in TRAIN_IMPLS:
        seconds = statistics.median(windows[impl])
        record[impl] = {"samples_per_s": round(BATCH * workers * args.steps / seconds, 1),
                        "step_ms": round(seconds / args.steps * 1e3, 3)}
    for impl in ("ps_sync", "allreduce"):
        record[impl]["in_sync"] = in_sync(models[impl])
    samples = {impl: record[impl]["samples_per_s"] for impl in TRAIN_IMPLS}
    record["ps_over_allreduce"] = round(samples["ps_sync"] / samples["allreduce"], 3)
    record["ps_over_no_comm"] = round(samples["ps_sync"] / samples["no_comm"], 3)
    record["allreduce_over_no_comm"] = round(samples["allreduce"] / samples["no_comm"], 3)
    return record


def training_table(record: dict, workers: int, num_servers: int) -> str:
    lines = [f"\n## training: MLP {record['params'] / 1e6:.2f} M parameters, SGD momentum {MOMENTUM}, batch "
             f"{BATCH} per worker, {workers} worker(s), {num_servers} server(s); median of {record['windows']} "
             f"windows of {record['steps_per_window']} steps",
             f"{'impl':<10} {'samples/s':>10} {'step ms':>8} {'in sync':>7}"]
    for impl in TRAIN_IMPLS:
        r = record[impl]
        sync = str(r["in_sync"]).lower() if "in_sync" in r else "-"
        lines.append(f"{impl:<10} {r['samples_per_s']:>10.1f} {r['step_ms']:>8.2f} {sync:>7}")
    lines.append(f"ps_sync/allreduce {record['ps_over_allreduce']:.2f}   ps_sync/no_comm "
                 f"{record['ps_over_no_comm']:.2f}   allreduce/no_comm {record['allreduce_over_no_comm']:.2f}")
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    part = p.add_mutually_exclusive_group()
    part.add_argument("--bandwidth", action="store_true", help="only the push/pull bandwidth part")
    part.add_argument("--train", action="store_true", help="only the training throughput part")
    p.add_argument("--sizes", type=lambda s: [parse_size(x) for x in s.split(",")], default=DEFAULT_SIZES,
                   help="comma-separated tensor sizes in bytes, e.g. 1M,4M,16M,64M (the default)")
    p.add_argument("--reps", type=int, default=8, help="pushes per push window, and pulls per round")
    p.add_argument("--rounds", type=int, default=5, help="rounds of the bandwidth part; training windows "
                   "per implementation")
    p.add_argument("--steps", type=int, default=20, help="training steps per timed window")
    args = p.parse_args()
    bad = [s for s in args.sizes if s <= 0 or s % 4]
    if bad:
        p.error(f"sizes {bad} are not positive multiples of 4 bytes (float32)")
    if min(args.reps, args.rounds, args.steps) < 1:
        p.error("--reps, --rounds and --steps must be at least 1")
    return args


def main() -> None:
    global workers_comm, lead
    args = parse_args()
    num_servers = config_from_env().num_servers
    if num_servers == 0 or world.size < 2:
        sys.exit("no parameter servers in this job: run this under psrun with servers, e.g. "
                 "psrun -np 3 --num-servers 1 python benchmarks/ps.py")
    torch.set_num_threads(1)      # before init: the servers' optimizer runs on one thread too
    torch.set_flush_denormal(True)
    try:  # before psrt.init() there is no abort hook: a failing rank must not leave the others blocked
        roles = job_roles(num_servers)
        worker = not roles.is_server(world.rank)
        # Kept across psrt.init() on the workers (the servers get COMM_NULL): barriers and the
        # slowest worker's times, apart from psrt's own messages.
        workers_comm = world.Split(0 if worker else MPI.UNDEFINED, key=world.rank)
        lead = worker and roles.worker_index(world.rank) == 0
        keys = place_keys(args.sizes, num_servers, config_from_env().ps_chunk_bytes)
        raw = raw_baseline(roles, keys, args) if not args.train else None
    except Exception as e:
        print(f"benchmarks/ps.py: job rank {world.rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        world.Abort(1)
    psrt.init()  # a server serves here until the workers shut down, then exits
    workers = psrt.size()
    summary: dict = {"benchmark": "ps", "ranks": world.size, "servers": num_servers, "workers": workers}
    say(f"# psrt parameter-server benchmark: {workers} worker(s), {num_servers} server(s) "
        f"(job ranks {list(roles.servers)}), torch {torch.__version__}, 1 thread per rank")
    if not args.train:
        ps = psrt_bandwidth(keys, args)
        summary["bandwidth"] = bandwidth_record(keys, raw, ps, args, num_servers)
        say(bandwidth_table(summary["bandwidth"], workers))
    if not args.bandwidth:
        summary["train"] = bench_training(args)
        say(training_table(summary["train"], workers, num_servers))
    say(json.dumps(summary))
    workers_comm.Free()
    workers_comm = MPI.COMM_NULL
    psrt.shutdown()


if __name__ == "__main__":
    main()
