"""``init()`` failing on one rank, or on all, must end the job naming the reason
(``python init_failures.py MODE``); ``test_init_failures.py`` checks what psrun says.

``config_on_one_rank``       rank 1 alone has PSRT_CYCLE_TIME=inf; rank 0 starts normally and
                             would wait for rank 1 in init's first collective.
``process_set_on_one_rank``  rank 1 alone asks for a process set outside the world; rank 0 asks
                             for a valid one and waits in the comparison of the sets.
``plain``                    every rank calls ``init()`` as usual (the test sets the environment).
"""
from __future__ import annotations

import os
import sys

import psrt.torch as hvd

if __name__ == "__main__":
    mode = sys.argv[1]
    one = os.environ.get("OMPI_COMM_WORLD_RANK") == "1"
    if mode == "config_on_one_rank" and one:
        os.environ["PSRT_CYCLE_TIME"] = "inf"
    sets = [[0, 7]] if mode == "process_set_on_one_rank" and one else [[0, 1]]
    hvd.init(process_sets=sets if mode == "process_set_on_one_rank" else None)
    print("RESULT init returned", flush=True)
    hvd.shutdown()
