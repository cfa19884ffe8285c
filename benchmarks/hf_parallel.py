"""A Hugging Face Llama at TP 2 x PP 2: psrt's tp.parallelize + pp.split against torch's own
stack, and its checkpoint read by slices against every rank reading all of it.

Why: tp.parallelize, pp.split and load_pretrained let a model psrt did not write train and
load split without being rewritten. This measures that path against what a PyTorch user
would write instead, on the same model, batch and micro-batches in the same job (torch over
gloo), and what loading the checkpoint costs each rank. Run with 4 ranks (make bench-hf)::

    psrun -np 4 python benchmarks/hf_parallel.py            # ~2.5 min on 2 idle cores
    psrun -np 4 python benchmarks/hf_parallel.py --rounds 1 --load-rounds 1       # quicker, noisier

The model: LlamaConfig(hidden 512, 8 layers, 8 heads, 4 key/value heads, MLP 1376, vocabulary
32000), 56.0 M parameters in float32, built from the config with one seed on every rank.
Training, AdamW, 1F1B with --microbatches micro-batches, the same batch every step:
  psrt        ProcessGrid(dp=1, tp=2, pp=2), tp.parallelize (plan "auto"), pp.split,
              pp.Pipeline, hvd.DistributedOptimizer over the DP set (as hf_check.py);
  psrt_adamw  the same with a plain AdamW (the DP set has one rank);
  torch       parallelize_module on the "tp" dimension of init_device_mesh("cpu", (2, 2),
              ("pp", "tp")), the split psrt's plan makes: RowwiseParallel(input_layouts=
              Replicate()) on embed_tokens, ColwiseParallel on q/k/v/gate/up and, gathering
              the logits, on lm_head, RowwiseParallel on o/down, norms replicated; each pp
              rank's layers, cut where psrt's split cuts them, in a PipelineStage (rotary
              tables from rotary_emb, attention_mask=None: SDPA runs causal); Schedule1F1B.
Checkpoint load, in a forked child per rank and variant (save_pretrained, 50 MB shards):
  psrt   a model on the meta device, tp.parallelize + pp.split, load_pretrained(stage, dir);
  whole  LlamaForCausalLM.from_pretrained(dir) on every rank;
each then reads every weight once (from_pretrained maps the files and reads lazily).
benchmarks/README.md says how each figure is taken. Rank 0 prints tables and one JSON line.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import psrt.torch as hvd
from psrt import pp, tp
from psrt.grid import ProcessGrid
from psrt.pretrained import load_pretrained

# isort: off
from _gloo import init_gloo
from _timing import timed_window
from mpi4py import MPI  # after hvd: psrt's bootstrap initialises MPI
# isort: on

LR = 1e-3
comm = MPI.COMM_WORLD.Dup()  # our barriers and gathers never interleave with psrt's messages


def say(*args: object) -> None:
    if comm.rank == 0:
        print(*args, flush=True)


def llama_config(tiny: bool = False) -> LlamaConfig:
    size = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "vocab_size": 64} if tiny else \
        {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 8, "vocab_size": 32000}
    return LlamaConfig(**size, num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                       attn_implementation="sdpa", bos_token_id=0, eos_token_id=0)


def build(config: LlamaConfig) -> LlamaForCausalLM:
    torch.manual_seed(0)  # the same full weights on every rank and in every implementation
    return LlamaForCausalLM(config)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# -- training -------------------------------------------------------------------------------
def psrt_setup(config, grid: ProcessGrid, m: int, x, y, distributed: bool):
    stage = pp.split(tp.parallelize(build(config), grid.tp_set), grid.pp_set)
    pipeline = pp.Pipeline(stage, loss_fn, microbatches=m, schedule="1f1b")
    named = list(stage.named_parameters())
    optimizer = torch.optim.AdamW([p for _, p in named], lr=LR)
    if distributed:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=named, process_set=grid.dp_set,
                                             backward_passes_per_step=m)

    def step() -> float:
        loss = pipeline.step(x if grid.is_first_stage else None, y if grid.is_last_stage else None)
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()
    return step, stage, pipeline


class TorchStage(nn.Module):
    """One pp rank's layers for torch.distributed.pipelining (HF's forward cannot run with
    layers removed), called as psrt's Llama layout calls them."""

    def __init__(self, model: LlamaForCausalLM, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.embed_tokens = model.model.embed_tokens if first else None
        self.layers = nn.ModuleList(model.model.layers[i] for i in layers)
        self.rotary_emb = model.model.rotary_emb
        self.norm, self.lm_head = (model.model.norm, model.lm_head) if last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = x if self.embed_tokens is None else self.embed_tokens(x)
        positions = torch.arange(hidden.shape[1]).unsqueeze(0)
        rotary = self.rotary_emb(hidden, positions)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rotary)
        return hidden if self.lm_head is None else self.lm_head(self.norm(hidden))


def torch_setup(config, mesh, cut: dict[int, range], m: int, x, y):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    model = build(config)
    plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(config.num_hidden_layers):
        block = f"model.layers.{i}"
        plan.update({f"{block}.self_attn.{n}_proj": ColwiseParallel() for n in "qkv"})
        plan.update({f"{block}.mlp.gate_proj": ColwiseParallel(), f"{block}.mlp.up_proj": ColwiseParallel(),
                     f"{block}.self_attn.o_proj": RowwiseParallel(), f"{block}.mlp.down_proj": RowwiseParallel()})
    parallelize_module(model, mesh["tp"], plan)
    rank, stages = mesh.get_local_rank("pp"), mesh.size(0)
    part = TorchStage(model, cut[rank], rank == 0, rank == stages - 1)
    stage = PipelineStage(part, rank, stages, torch.device("cpu"), group=mesh.get_group("pp"))
    schedule = Schedule1F1B(stage, m, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(part.parameters(), lr=LR)

    def step() -> float | None:
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
        optimizer.step()
        optimizer.zero_grad()
        return torch.stack(losses).mean().item() if losses else None
    return step


def train(args, grid: ProcessGrid, mesh) -> dict:
    config = llama_config()
    ids = torch.randint(0, config.vocab_size, (args.rows, args.seq + 1), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    psrt_step, stage, pipeline = psrt_setup(config, grid, args.microbatches, x, y, True)
    cut = {pp_rank: range(r[0], r[-1] + 1) for pp_rank, r in comm.allgather((grid.coords.pp, stage.chunk_ranges[0]))}
    steps = {"psrt": psrt_step, "psrt_adamw": psrt_setup(config, grid, args.microbatches, x, y, False)[0],
             "torch": torch_setup(config, mesh, cut, args.microbatches, x, y)}
    losses = {name: comm.bcast([step() for _ in range(args.check_steps)], root=comm.size - 1)  # a last-stage rank
              for name, step in steps.items()}
    for name, seen in losses.items():
        if not (abs(seen[0] - losses["torch"][0]) <= 1e-3 and all(math.isfinite(v) and v < seen[0] for v in seen[1:])):
            raise SystemExit(f"{name} does not train like the others, nothing timed: losses {losses}")
    windows: dict[str, list[float]] = {name: [] for name in steps}
    profiles = []
    for round_ in range(args.rounds):
        names = list(steps)[round_ % 3:] + list(steps)[:round_ % 3]
        for name in names:
            tp.stats().reset()
            windows[name].append(timed_window(comm, steps[name], args.steps, args.warmup))
            if name == "psrt":  # the last step's schedule on this rank; TP collectives per step
                tp_s = tp.stats().seconds / (args.steps + args.warmup)
                profiles.append((pipeline.profile.compute / pipeline.profile.wall, tp_s / windows[name][-1]))
    compute, tp_share = (statistics.median(v) for v in zip(*profiles))
    record = {name: {"step_s": statistics.median(w), "tokens_per_s": args.rows * args.seq / statistics.median(w),
                     "windows_s": w, "losses": losses[name]} for name, w in windows.items()}
    for name in ("psrt", "psrt_adamw"):
        record[name]["vs_torch"] = record[name]["step_s"] / record["torch"]["step_s"]
        record[name]["vs_torch_per_round"] = [a / b for a, b in zip(windows[name], windows["torch"])]
        record[name]["first_loss_delta"] = abs(losses[name][0] - losses["torch"][0])
    record["cut"] = {k: [v.start, v.stop] for k, v in cut.items()}
    record["psrt_ranks"] = comm.gather({"rank": comm.rank, "pp": grid.coords.pp, "tp": grid.coords.tp,
                                        "compute_share": compute, "tp_share": tp_share})
    return record


# -- checkpoint load --------------------------------------------------------------------------
def memory_mib() -> dict[str, float]:
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return {key: int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}


def in_child(work) -> dict:
    """``work()``'s dict, run in a forked child, with its seconds and memory growth (MiB)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # never returns: no MPI, no psrt shutdown, no atexit handler in the child
        os.close(read)
        try:
            gc.collect()
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")  # VmHWM := VmRSS
            before, start = memory_mib(), time.perf_counter()
            result, _loaded = work()  # alive until measured
            seconds, after = time.perf_counter() - start, memory_mib()
            result.update(seconds=seconds, peak_mib=after["VmHWM"] - before["VmRSS"],
                          anon_mib=after["RssAnon"] - before["RssAnon"], file_mib=after["RssFile"] - before["RssFile"])
        except Exception as exc:  # noqa: BLE001 - any failure is raised again by the parent
            result = {"error": f"{type(exc).__name__}: {exc}"}
        os.write(write, json.dumps(result).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        result = json.loads(pipe.read())
    os.waitpid(pid, 0)
    if "error" in result:
        raise RuntimeError(f"rank {comm.rank}'s child: {result['error']}")
    return result


def touch(module: nn.Module) -> None:
    """Read every weight once, as the first forward does."""
    with torch.no_grad():
        for tensor in module.state_dict().values():
            tensor.sum()


def load_psrt(directory: str, config: LlamaConfig, grid: ProcessGrid):
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    stage = pp.split(tp.parallelize(model, grid.tp_set), grid.pp_set)
    report = load_pretrained(stage, directory)
    touch(stage)
    return {"bytes_read": report.bytes_read, "load_pretrained_s": report.seconds}, stage


def load_whole(directory: str):
    model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
    touch(model)
    return {"bytes_read": sum(t.numel() * t.element_size() for t in model.state_dict().values())}, model


def load(args, grid: ProcessGrid) -> dict:
    directory = comm.bcast(tempfile.mkdtemp(prefix="psrt-hf-bench-") if comm.rank == 0 else None)
    full, tiny = os.path.join(directory, "full"), os.path.join(directory, "tiny")
    try:
        if comm.rank == 0:  # in a child too: the parent holds no model
            in_child(lambda: ({}, [build(llama_config(tiny=True)).save_pretrained(tiny),
                                   build(llama_config()).save_pretrained(full, max_shard_size="50MB")]))
        comm.Barrier()
        load_psrt(tiny, llama_config(tiny=True), grid)  # lazy imports, in the parent
        load_whole(tiny)
        variants = {"psrt": lambda: load_psrt(full, llama_config(), grid), "whole": lambda: load_whole(full)}
        runs: dict[str, list[dict]] = {name: [] for name in variants}
        for round_ in range(args.load_rounds):
            for name in (list(variants) if round_ % 2 == 0 else list(variants)[::-1]):
                comm.Barrier()
                runs[name].append(in_child(variants[name]))
        mine = {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for name, rs in runs.items()}
        files = [f for f in os.listdir(full) if f.endswith(".safetensors")]
        return {"ranks": comm.gather({"rank": comm.rank, **mine}), "files": len(files),
                "file_bytes": sum(os.path.getsize(os.path.join(full, f)) for f in files)}
    finally:
        comm.Barrier()
        if comm.rank == 0:
            shutil.rmtree(directory, ignore_errors=True)


# -- report -----------------------------------------------------------------------------------
def print_train(r: dict, args) -> None:
    say(f"\n## Training, TP 2 x PP 2: {args.rows} x {args.seq} tokens per step, {args.microbatches} micro-batches, "
        f"1F1B; layers per stage {r['cut']}; median of {args.rounds} rounds of {args.steps} steps")
    say("| implementation | step ms | tokens/s | vs torch (per round) | first loss - torch's | check-step losses |")
    say("| --- | ---: | ---: | --- | ---: | --- |")
    for name in ("psrt", "psrt_adamw", "torch"):
        q, losses = r[name], ", ".join(f"{v:.5f}" for v in r[name]["losses"])
        versus = "1" if name == "torch" else \
            f"{q['vs_torch']:.3f} ({min(q['vs_torch_per_round']):.2f}-{max(q['vs_torch_per_round']):.2f})"
        delta = "-" if name == "torch" else f"{q['first_loss_delta']:.1e}"
        say(f"| {name} | {q['step_s'] * 1e3:.0f} | {q['tokens_per_s']:.0f} | {versus} | {delta} | {losses} |")
    say("\n| psrt rank | pp | tp | compute share of its step | TP collectives share of the step |")
    say("| --- | --- | --- | ---: | ---: |")
    for q in r["psrt_ranks"] or ():
        say(f"| {q['rank']} | {q['pp']} | {q['tp']} | {q['compute_share']:.0%} | {q['tp_share']:.0%} |")


def print_load(r: dict) -> None:
    say(f"\n## Checkpoint load: {r['files']} files, {r['file_bytes'] / 2**20:.1f} MiB; medians per rank")
    say("| rank | variant | seconds | peak MiB | resident MiB: anonymous + mapped file | MiB read |")
    say("| --- | --- | ---: | ---: | --- | ---: |")
    for q in r["ranks"] or ():
        for name in ("psrt", "whole"):
            a = q[name]
            say(f"| {q['rank']} | {name} | {a['seconds']:.2f} | {a['peak_mib']:.0f} | {a['anon_mib']:.0f} + "
                f"{a['file_mib']:.0f} | {a['bytes_read'] / 2**20:.1f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="timed windows per implementation")
    p.add_argument("--steps", type=int, default=5, help="timed steps per window")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before each window")
    p.add_argument("--check-steps", type=int, default=3, help="steps whose losses are compared before timing")
    p.add_argument("--rows", type=int, default=8, help="sequences per step")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--load-rounds", type=int, default=3, help="loads per variant and rank")
    p.add_argument("--parts", nargs="+", choices=("train", "load"), default=["train", "load"])
    args = p.parse_args()
    hvd.init()
    if comm.size != 4:
        sys.exit("run with 4 ranks (TP 2 x PP 2): psrun -np 4 python benchmarks/hf_parallel.py")
    torch.set_num_threads(1)
    psrt_hook = sys.excepthook
    init_gloo(comm)
    sys.excepthook = psrt_hook  # as in peers.py: psrt reports an uncaught error
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    grid = ProcessGrid(dp=1, tp=2, pp=2)
    assert (grid.coords.pp, grid.coords.tp) == (mesh.get_local_rank("pp"), mesh.get_local_rank("tp"))
    with torch.device("meta"):
        params = sum(p.numel() for p in LlamaForCausalLM(llama_config()).parameters())
    load_average = [os.getloadavg()[0]]
    say(f"# Llama {params / 1e6:.1f} M parameters, TP 2 x PP 2 on 4 ranks, torch {torch.__version__}, 1 thread per "
        f"rank; 1-minute load average at the start {load_average[0]:.2f}")
    loaded = load(args, grid) if "load" in args.parts else None  # first: the parent holds no model yet
    trained = train(args, grid, mesh) if "train" in args.parts else None
    load_average.append(os.getloadavg()[0])
    if trained:
        print_train(trained, args)
    if loaded:
        print_load(loaded)
    say(f"\n1-minute load average at the end {load_average[1]:.2f} (this job alone adds 4)")
    say(json.dumps({"benchmark": "hf_parallel", "ranks": comm.size, "torch": torch.__version__, "params": params,
                    "args": vars(args), "train": trained, "load": loaded, "load_average": load_average}))
    dist.destroy_process_group()
    hvd.shutdown()


if __name__ == "__main__":
    main()
