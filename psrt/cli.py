"""``psrt``: utilities that run in one process, outside any job.

    psrt zero-to-full CKPT_DIR OUT.pt   # a sharded ZeRO checkpoint as one ordinary file
"""
from __future__ import annotations

import argparse
import sys

from psrt import checkpoint_files
from psrt.errors import PsrtError


def _zero_to_full(args: argparse.Namespace) -> None:
    """Every shard is checked against the checkpoint's records and read with ``weights_only``;
    the output holds only tensors and plain data, so ``torch.load(OUT, weights_only=True)``
    reads it, and it is written whole or not at all."""
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
    zero = commands.add_parser("zero-to-full", help="consolidate a sharded ZeRO checkpoint into one file "
                               "holding {'model': state_dict, 'optimizer': optimizer state_dict, ...}")
    zero.add_argument("checkpoint", metavar="CKPT_DIR")
    zero.add_argument("output", metavar="OUT.pt")
    zero.set_defaults(run=_zero_to_full)
    from psrt.plan.cli import add_parser as add_plan
    add_plan(commands)
    from psrt.engine import timeline_summary  # psrt timeline-summary TRACE.json: its parser and report live there
    timeline_summary.add_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        args.run(args)
    except (PsrtError, OSError) as exc:
        print(f"psrt: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a truncated or corrupt file: say so without a traceback
        print(f"psrt: error: cannot read the checkpoint: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
