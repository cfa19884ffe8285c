"""``psrt plan``: the layout planner on the command line.

    psrt plan --layers 4 --hidden 64 --heads 4 --vocab 88 --seq 64 --batch 16 --ranks 2 --memory 1GiB
    psrt plan --params 7e9 --layers 32 --seq 4096 --batch 512 --ranks 64 --machine h100 --precision bf16
    psrt plan --measure                  # probe this machine (a psrun job), write psrt-machine.json
    psrt plan ... --machine psrt-machine.json

:func:`add_parser` registers the subcommand on ``psrt``'s parser.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from psrt import probe_job
from psrt.errors import InvalidArgumentError, PsrtError
from psrt.plan.layout import OPTIMIZER_STATE, PRECISIONS, RECOMPUTE
from psrt.plan import gpus
from psrt.plan.model import ParameterBlocks, Transformer
from psrt.plan.readers import from_hf_config
from psrt.plan.report import code, describe, header, table
from psrt.plan.search import make_query, search

DEFAULT_PROFILE = "psrt-machine.json"
_TRANSFORMER = ("hidden", "heads", "vocab", "seq")
_SHAPES_ONLY = ("hidden", "heads", "vocab", "ffn_hidden", "kv_heads", "mlp")


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Add ``plan`` to ``psrt``'s subcommands."""
    plan = commands.add_parser(
        "plan", help="list the layouts (dp x tp x pp, ZeRO, micro-batch, recomputation) that fit a model on a "
                     "number of ranks, fastest first",
        description="List the layouts (dp x tp x pp [x cp], ZeRO stage, micro-batch size and count, recomputation) "
                    "that fit a model on a number of ranks with a given memory each, fastest first by a modelled step "
                    "time, with each layout's bytes per rank.",
        epilog="Sizes take K, M, G, T (powers of 1024, also KiB, MiB, ...) or KB, MB, GB, TB (powers of 1000). "
               "Without --machine or --measure the step times come from a default profile, labelled as such.")
    model = plan.add_argument_group("model", "a transformer by its shapes, or any model by its parameter count")
    model.add_argument("--layers", type=int, help="transformer blocks (or blocks of --params)")
    model.add_argument("--hidden", type=int, help="model width")
    model.add_argument("--heads", type=int, help="attention heads")
    model.add_argument("--vocab", type=int, help="vocabulary size")
    model.add_argument("--seq", type=int, help="sequence length")
    model.add_argument("--mlp-ratio", type=float, default=4,
                       help="MLP width over the model width (default 4); not a whole number (Llama 3: 3.5): SwiGLU")
    model.add_argument("--ffn-hidden", type=int, help="MLP width; implies a SwiGLU MLP unless --mlp gelu")
    model.add_argument("--mlp", choices=("gelu", "swiglu"),
                       help="GELU MLP of 2 matrices (GPT's block) or SwiGLU of 3 (Llama's: RMSNorm, no biases, "
                            "rotary positions); default: SwiGLU with --ffn-hidden or a fractional --mlp-ratio")
    model.add_argument("--kv-heads", type=int, help="key/value heads of grouped-query attention (default: --heads)")
    model.add_argument("--dropout", action="store_true", help="the blocks use dropout (attention runs unfused)")
    model.add_argument("--tied-embeddings", action="store_true", help="the output projection is the embedding")
    model.add_argument("--hf-config", metavar="PATH", help="a transformers decoder's config.json (or its directory) "
                                                            "instead of the shapes; needs --seq")
    model.add_argument("--params", type=float, help="parameter count of a model known only by it (e.g. 7e9), with "
                                                    "--layers and --seq (tokens per sample, default 1); activations "
                                                    "are then not modelled")
    job = plan.add_argument_group("job")
    job.add_argument("--batch", type=int, help="global batch: sequences (rows) per step")
    job.add_argument("--ranks", type=int, help="number of ranks")
    job.add_argument("--memory", help="memory per rank, e.g. 80GiB (default: the --machine profile's)")
    job.add_argument("--precision", choices=sorted(PRECISIONS), default="fp32",
                     help="fp32 (psrt's default) or 16-bit compute with fp32 masters (ZeroOptimizer(compute_dtype=))")
    job.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATE), default="adam")
    pins = plan.add_argument_group("pinned choices", "fix part of the layout; the rest is searched")
    for axis in ("dp", "tp", "pp"):
        pins.add_argument(f"--{axis}", type=int)
    pins.add_argument("--cp", default="1", help="context-parallel size, or 'any' to search it (default 1)")
    pins.add_argument("--zero", type=int, choices=(0, 1, 2, 3))
    pins.add_argument("--micro-batch", type=int, help="sequences per micro-batch")
    pins.add_argument("--recompute", choices=RECOMPUTE)
    pins.add_argument("--no-sequence-parallel", action="store_true", help="TP layouts without sequence parallelism")
    machine = plan.add_argument_group("machine")
    machine.add_argument("--machine", metavar="NAME|FILE",
                         help=f"a GPU node built from published figures ({', '.join(gpus.names())}: 8 GPUs per node, "
                              "NVLink inside, InfiniBand across), or a profile written by --measure")
    machine.add_argument("--measure", action="store_true",
                         help="probe this machine first (a short psrun job) and write its profile")
    machine.add_argument("--profile-out", metavar="FILE", default=DEFAULT_PROFILE,
                         help=f"where --measure writes the profile (default {DEFAULT_PROFILE})")
    machine.add_argument("--probe-ranks", type=int, default=2, help="ranks of the probe job (default 2)")
    machine.add_argument("--probe-threads", type=int, help="torch threads per probe rank (default: torch's)")
    machine.add_argument("--quick", action="store_true", help="a shorter, rougher probe")
    output = plan.add_argument_group("output")
    output.add_argument("--top", type=int, default=10, help="rows of the table (default 10; 0: all)")
    output.add_argument("--json", action="store_true", help="every fitting layout as JSON instead of a table")
    plan.set_defaults(run=run)


def _model(args: argparse.Namespace) -> Transformer | ParameterBlocks:
    given = [name for name in _TRANSFORMER if getattr(args, name) is not None]
    if args.hf_config is not None:
        if args.seq is None or args.params is not None or len(given) > 1 or args.layers is not None:
            raise InvalidArgumentError("--hf-config describes the model: give it with --seq only")
        return from_hf_config(args.hf_config, args.seq)
    if args.params is not None:
        shapes = [name for name in _SHAPES_ONLY if getattr(args, name) is not None]
        if shapes:
            flags = ", --".join(name.replace("_", "-") for name in shapes)
            raise InvalidArgumentError(f"give either --params (with --layers and --seq) or the transformer's shapes, "
                                       f"not both (got --params and --{flags})")
        return ParameterBlocks.uniform(int(args.params), args.layers or 1, args.seq or 1)
    missing = [name for name in ("layers",) + _TRANSFORMER if getattr(args, name) is None]
    if missing:
        raise InvalidArgumentError(f"describe the model: a transformer needs --layers, --hidden, --heads, --vocab and --seq "
                        f"(missing --{', --'.join(missing)}), or give --params (and --layers)")
    ratio = int(args.mlp_ratio) if args.mlp_ratio == int(args.mlp_ratio) else args.mlp_ratio
    return Transformer(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab,
                       sequence_length=args.seq, mlp_ratio=ratio, dropout=args.dropout,
                       tied_embeddings=args.tied_embeddings, kv_heads=args.kv_heads, ffn_hidden=args.ffn_hidden,
                       swiglu=None if args.mlp is None else args.mlp == "swiglu")


def measure(path: str, ranks: int, threads: int | None, quick: bool) -> None:
    """Run the probe (:mod:`psrt.plan.probe`) as a psrun job on this machine, writing ``path``."""
    probe_job.run("psrt.plan.probe", ["--out", path] + (["--quick"] if quick else [])
                  + ([f"--threads={threads}"] if threads else []), ranks, "psrt plan: probing this machine")
    if not os.path.exists(path):
        raise PsrtError(f"the probe job ended without writing {path}")
    print(f"psrt plan: wrote the machine profile {path}", file=sys.stderr)


def run(args: argparse.Namespace) -> None:
    if args.measure:
        if args.machine:
            raise InvalidArgumentError("give --measure or --machine, not both")
        measure(args.profile_out, args.probe_ranks, args.probe_threads, args.quick)
        if args.batch is None and args.ranks is None and args.layers is None and args.params is None:
            return  # only the profile was asked for
        args.machine = args.profile_out
    machine = gpus.resolve(args.machine) if args.machine else None  # an unknown name is the first thing to say
    missing = [flag for flag, value in (("--batch", args.batch), ("--ranks", args.ranks)) if value is None]
    if args.memory is None and not (args.machine in gpus.names()):
        missing.append("--memory")
    if missing:
        raise InvalidArgumentError(f"psrt plan needs {', '.join(missing)} (or only --measure to write a machine profile)")
    query = make_query(_model(args), global_batch=args.batch, ranks=args.ranks, memory_per_rank=args.memory,
                       machine=machine, precision=args.precision,
                       optimizer=args.optimizer, sequence_parallel=not args.no_sequence_parallel,
                       dp=args.dp, tp=args.tp, pp=args.pp, cp=None if args.cp == "any" else _int(args.cp, "--cp"),
                       zero=args.zero, micro_batch=args.micro_batch, recompute=args.recompute)
    fitting, considered = search(query)
    if args.json:
        print(json.dumps([dict(dataclasses.asdict(plan), total_bytes=plan.memory.total, step_s=plan.time.total)
                          for plan in fitting], indent=1))
        return
    print(header(query, considered, len(fitting)))
    print()
    print(table(fitting, top=args.top or None))
    print()
    print(describe(fitting[0]))
    print()
    print(code(fitting[0]))


def _int(text: str, flag: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise InvalidArgumentError(f"{flag} takes an int or 'any', got {text!r}") from None
