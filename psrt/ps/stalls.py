"""What a parameter server is waiting for, and which waits have become stalls.

:func:`waits` describes every request a server holds back (a pull waiting
for pushes, an init waiting for worker 0's, a save or load waiting for the
other workers) from the server's state alone; :class:`StallWatch` turns
them into reports once they wait longer than ``PSRT_STALL_CHECK_TIME``, each
once, and into the reason to end the job after ``PSRT_STALL_SHUTDOWN_TIME``.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence

if TYPE_CHECKING:
    from psrt.ps.protocol import Op
    from psrt.ps.store import Store

#: (identity, since (monotonic seconds), description with a ``{waited}`` field)
Wait = tuple[object, float, str]


def names(workers: Iterable[int]) -> str:
    return ", ".join(map(str, workers))


def _workers(missing: Sequence[int]) -> str:
    return f"worker{'s' if len(missing) > 1 else ''} {names(missing)}"


def waits(stores: dict[int, Store], gathering: dict[Op, dict[int, tuple[int, dict, float]]],
          active: Sequence[int]) -> Iterator[Wait]:
    """Every request the server is holding back, and since when."""
    for store in stores.values():
        for shard in store.shards.values():
            for pull in shard.pulls:
                missing = shard.missing_for(pull, active)
                because = f"it needs pushes from {_workers(missing)}" if missing else \
                    "its own pushes have not arrived"
                yield (id(pull), pull.since, f"worker {pull.worker}'s pull of {shard.meta.describe()} has "
                                             f"waited {{waited}} for step {pull.target}: {because}")
        for chunk_id, inits in store.init_waiting.items():
            for who, _, meta, since in inits:
                yield (("init", id(store), chunk_id, who), since,
                       f"worker {who}'s init of key {meta.key!r} has waited {{waited}} for worker 0's")
    for op, requests in gathering.items():
        if requests:
            missing = [w for w in active if w not in requests]
            because = (f"{_workers(missing)} did not ask (every worker must call it at the same point)"
                       if missing else "pushes are still being applied")
            since = min(t for _, _, t in requests.values())
            yield ((op, since), since, f"{op.name.lower()} asked for by workers {names(sorted(requests))} "
                                       f"has waited {{waited}}: {because}")


class StallWatch:
    """Which waits were reported already, so each is reported once."""

    def __init__(self, check_s: float, shutdown_s: float) -> None:
        self.check_s, self.shutdown_s = check_s, shutdown_s
        self._reported: set[object] = set()

    def scan(self, current: Iterable[Wait], now: float | None = None) -> tuple[list[str], str | None]:
        """(new stall reports, the stall that should end the job or None)."""
        now = time.monotonic() if now is None else now
        reports, fatal, seen = [], None, set()
        for key, since, text in current:
            seen.add(key)
            waited = now - since
            overdue = self.shutdown_s > 0 and waited >= self.shutdown_s
            if waited < self.check_s or (key in self._reported and not overdue):
                continue
            text = text.format(waited=f"{waited:.0f} s")
            if overdue and fatal is None:
                fatal = text
            reports.append(text)
            self._reported.add(key)
        self._reported &= seen
        return reports, fatal
