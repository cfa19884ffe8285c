"""``psrt tune``: measure this machine's tuning table (which algorithm carries a host
allreduce or reduce-scatter of each size, see :mod:`psrt.comm.tuning.table`) with a psrun job
of the ranks given, write it where jobs of that layout find it, and print it.

    psrt tune                       # 2 ranks; writes ~/.cache/psrt/tuning/<key>.json
    psrt tune --np 4 --file tuning/four-ranks.json   # a file to commit; jobs use it with PSRT_TUNE_FILE

The job (``python -m psrt.tune_command`` under psrun) is an ordinary ``psrt.init()`` with
``PSRT_TUNE=measure``: the measurement is the one a job makes on first use.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from psrt import probe_job
from psrt.comm.tuning.table import TuningTable, default_path
from psrt.errors import PsrtError


def add_command(commands: argparse._SubParsersAction) -> None:
    """Add ``tune`` to ``psrt``'s subcommands."""
    tune = commands.add_parser(
        "tune", help="measure which allreduce algorithm (MPI's, psrt's ring, hierarchical) is fastest at each "
                     "size on this machine, and write the table jobs read",
        description="Measure MPI's allreduce and reduce-scatter against psrt's ring (and the hierarchical "
                    "allreduce over several hosts) at a few sizes with a psrun job, choose the faster per size "
                    "band, and write the table as JSON where jobs of this machine, MPI and number of ranks find it "
                    "(or --file, for jobs run with PSRT_TUNE_FILE).")
    tune.add_argument("--np", type=int, default=2, help="ranks of the measuring job (default 2): a table "
                      "serves jobs of this many ranks")
    tune.add_argument("--file", metavar="PATH", help="write the table here (default: the cache file of the job's "
                      "key, ~/.cache/psrt/tuning/<host>-<n>ranks-<hash>.json)")
    tune.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    if args.np < 1:
        raise PsrtError(f"--np must be at least 1, got {args.np}")
    env = {k: v for k, v in os.environ.items() if k not in ("PSRT_TUNE", "PSRT_RING_THRESHOLD")}
    env["PSRT_TUNE"] = "measure"
    if args.file:
        env["PSRT_TUNE_FILE"] = os.path.abspath(args.file)
    done = probe_job.run("psrt.tune_command", [], args.np, "psrt tune: measuring", env)
    report = next((json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"tuning_file"')), None)
    if report is None:
        raise PsrtError(f"the tuning job reported no table:\n{done.stdout[-2000:]}")
    with open(report["tuning_file"], encoding="utf-8") as handle:
        table = TuningTable.from_json(handle.read(), report["tuning_file"])
    print(f"psrt tune: wrote {report['tuning_file']}", file=sys.stderr)
    print(describe(table))


def describe(table: TuningTable) -> str:
    """The table as a few lines: the bands of each collective and the measurements."""
    lines = [f"tuning table for {table.key.ranks if table.key else '?'} ranks"
             + (f" on {', '.join(table.key.hosts)} ({table.key.cpu}), {table.key.mpi}" if table.key else "")
             + f"; measured {table.measured}"]
    for collective in ("allreduce", "reduce_scatter", "hierarchical_allreduce"):
        bands = getattr(table, collective)
        if bands:
            lines.append(f"  {collective}: " + ", ".join(f"from {_size(b.from_bytes)} {b.algorithm}" for b in bands))
    for collective, rows in table.measurements.items():
        lines.append(f"  {collective} measured (median us; ring_over_mpi: median of the per-repeat ratio; "
                     "ring_faster: in how many repeats the ring was faster):")
        lines += ["    " + "  ".join(f"{k} {_size(v) if k == 'bytes' else v}" for k, v in row.items()) for row in rows]
    return "\n".join(lines)


def _size(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def main() -> None:
    """The measuring job: init measures (PSRT_TUNE=measure, set by ``psrt tune``); rank 0 says where the
    table went."""
    import psrt
    import psrt.runtime

    psrt.init()
    table = psrt.tuning_table()
    if psrt.rank() == 0 and table.key is not None:
        path = default_path(table.key, psrt.runtime.current().config.tune_file)
        print(json.dumps({"tuning_file": str(path)}), flush=True)
    psrt.shutdown()


if __name__ == "__main__":
    main()
