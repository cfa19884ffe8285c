"""``psrt``: utilities that run in one process, outside any job.

    psrt zero-to-full CKPT_DIR OUT      # a sharded ZeRO checkpoint as one safetensors file
    psrt plan --params 7e9 ...          # which layouts fit a model, fastest first (psrt.plan)
    psrt timeline-summary TRACE.json    # where each step's time went, from hvd.start_timeline's file
    psrt tune [--np N] [--file PATH]    # which allreduce algorithm to use at each size here (psrt.tune_command)
"""
from __future__ import annotations

import argparse
import sys

from psrt import timeline_summary, tune_command
from psrt.checkpoint import files as checkpoint_files
from psrt.errors import PsrtError
from psrt.plan import cli as plan_cli


def _zero_to_full(args: argparse.Namespace) -> None:
    """Every shard is checked against the checkpoint's records before it is read.  The output
    is one safetensors file written as every psrt checkpoint file is (whole or not at all);
    its tensors are named by their place in the document (``model.<name>``,
    ``optimizer.state.<index>.<key>``), and :func:`psrt.checkpoint.load_document` gives back
    ``{"model": state_dict, "optimizer": ..., ...}``."""
    from psrt.zero.checkpoint import consolidate
    full = consolidate(args.checkpoint)
    record = checkpoint_files.save_tensors(full, args.output)
    print(f"psrt: wrote {len(full['model'])} model entries and the optimizer state of "
          f"{len(full['optimizer']['state'])} parameters ({full['world_size']} shards, stage "
          f"{full['stage']}) to {args.output} (sha256 {record.sha256})")


def make_parser() -> argparse.ArgumentParser:
    """The command line of ``psrt``; the documentation's reference page is generated from it."""
    parser = argparse.ArgumentParser(prog="psrt", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    zero = commands.add_parser("zero-to-full", help="consolidate a sharded ZeRO checkpoint into one safetensors "
                               "file holding {'model': state_dict, 'optimizer': optimizer state_dict, ...} "
                               "(read it with psrt.checkpoint.load_document)")
    zero.add_argument("checkpoint", metavar="CKPT_DIR", help="the directory opt.save() / psrt.zero.save wrote")
    zero.add_argument("output", metavar="OUT", help="the file to write (replaced whole, or left untouched)")
    zero.set_defaults(run=_zero_to_full)
    plan_cli.add_parser(commands)
    timeline_summary.add_command(commands)
    tune_command.add_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        args.run(args)
    except (PsrtError, OSError) as exc:
        print(f"psrt: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a truncated or corrupt input file, most often: no traceback, the cause named
        print(f"psrt {args.command}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
