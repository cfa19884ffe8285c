"""A rank that starts late: ``python late_import.py RANK SECONDS`` makes rank RANK sleep
SECONDS before importing psrt (which starts MPI), so that the other ranks wait in MPI's
start-up; each rank then meets the others and prints ``rank R started``."""
from __future__ import annotations

import os
import sys
import time

if os.environ.get("OMPI_COMM_WORLD_RANK") == sys.argv[1]:
    time.sleep(float(sys.argv[2]))

import psrt.torch as hvd  # noqa: E402

hvd.init()
print(f"rank {hvd.rank()} started", flush=True)
