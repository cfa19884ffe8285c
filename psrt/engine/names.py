"""How psrt names the collectives a caller did not name: one convention, one place.

Ranks match collectives by name, so a name made up by psrt must come out the same
on every rank of the set.  Both kinds below come from counters that advance in
program order, which ranks running the same program share:

- an unnamed call is ``<collective>.noname.<n>``, Horovod's name, from one counter
  per runtime;
- an object that issues collectives of its own (``DistributedOptimizer``,
  ``ZeroOptimizer``) is ``<kind>.set<process set id>.<n>``, from one counter per kind
  and process set: every rank of the set must create such objects in the same order,
  and ranks outside the set need not create them at all.

The counters belong to the runtime, so a new ``init()`` starts them afresh on every
rank together.
"""
from __future__ import annotations

import itertools
import threading
from collections import defaultdict


class Names:
    """The counters behind psrt's made-up names, for one runtime; thread-safe."""

    def __init__(self) -> None:
        self._unnamed = itertools.count()
        self._instances: defaultdict[tuple[str, int], itertools.count] = defaultdict(itertools.count)
        self._lock = threading.Lock()

    def unnamed(self, collective: str) -> str:
        """The name of an unnamed ``collective`` call (Horovod's ``allreduce.noname.3``)."""
        with self._lock:
            return f"{collective}.noname.{next(self._unnamed)}"

    def instance(self, kind: str, process_set_id: int) -> str:
        """The name of a new object of ``kind`` over process set ``process_set_id``, under
        which it names its collectives (``zero.set0.1``)."""
        with self._lock:
            return f"{kind}.set{process_set_id}.{next(self._instances[kind, process_set_id])}"
