"""What a parameter server is holding back, described for the watchdog.

:func:`waits` describes every request a server holds (a pull waiting for
pushes, an init waiting for worker 0's, a save or load waiting for the other
workers, a request's data still arriving) from the server's state alone, each
with the workers it waits on.  The server publishes them to the runtime's
watchdog (:mod:`psrt.comm.watchdog`), which probes those workers once a wait
passes ``PSRT_STALL_CHECK_TIME`` (so a report can tell a frozen worker from one
that simply never asked) and ends the job after ``PSRT_STALL_SHUTDOWN_TIME``.

:func:`holds` gives the same requests as a table, by the worker and tag that made
each one, for deadlock detection (:mod:`psrt.comm.deadlock`): a worker blocked in
a request needs exactly the workers its server holds that request for.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Iterator, Sequence

from psrt.comm.waits import Wait

if TYPE_CHECKING:
    from psrt.ps.protocol import RequestKind
    from psrt.ps.store import Store

KIND = "a request held by a parameter server"
#: Of the requests a server holds for other workers, its probe answers list this many.
MAX_HOLDS = 256


def names(workers: Iterable[int]) -> str:
    return ", ".join(map(str, workers))


def _workers(missing: Sequence[int]) -> str:
    return f"worker{'s' if len(missing) > 1 else ''} {names(missing)}"


def waits(stores: dict[int, Store], gathering: dict[RequestKind, dict[int, tuple[int, dict, float]]],
          active: Sequence[int], job_rank: Sequence[int]) -> Iterator[Wait]:
    """Every request the server is holding back; ``job_rank[w]`` is worker w's rank in the job."""
    for store in stores.values():
        for shard in store.shards.values():
            for pull in shard.pulls:
                missing = shard.missing_for(pull, active)
                because = f"it needs pushes from {_workers(missing)}" if missing else \
                    "the pushes it needs are still arriving"
                yield Wait(KIND, f"worker {pull.worker}'s pull of {shard.meta.describe()} for step {pull.target} "
                                 f"({because})", [job_rank[w] for w in (missing or [pull.worker])], pull.since)
        for chunk_id, inits in store.init_waiting.items():
            for who, _, meta, since in inits:
                yield Wait(KIND, f"worker {who}'s init of key {meta.key!r} (waiting for worker 0's)",
                           [job_rank[0]], since)
    for kind, requests in gathering.items():
        if requests:
            missing = [w for w in active if w not in requests]
            because = (f"{_workers(missing)} did not ask (every worker must call it at the same point)"
                       if missing else "pushes are still being applied")
            since = min(t for _, _, t in requests.values())
            yield Wait(KIND, f"{kind.name.lower()} asked for by workers {names(sorted(requests))} ({because})",
                       [job_rank[w] for w in missing], since)


def holds(stores: dict[int, Store], gathering: dict[RequestKind, dict[int, tuple[int, dict, float]]],
          active: Sequence[int], job_rank: Sequence[int]) -> list[list]:
    """``[worker's job rank, request tag, [job ranks of the workers it waits for]]`` for the
    requests the server holds for other workers: a pull, the workers yet to push what it
    needs; an init, worker 0; a save or load, the workers that have not asked.  A request
    held for no other worker (its data still arriving, pushes still being applied) is left
    out, as deadlock detection reads a missing request.  The oldest :data:`MAX_HOLDS` only,
    so that a probe answer stays small whatever the model: a worker blocks in its oldest
    requests first, and one left out only makes a deadlock go unfound (a stall instead)."""
    held: list[tuple[float, int, int, list[int]]] = []
    for store in stores.values():
        for shard in store.shards.values():
            held += [(pull.since, pull.worker, pull.tag, shard.missing_for(pull, active)) for pull in shard.pulls]
        held += [(since, who, tag, [0]) for inits in store.init_waiting.values() for who, tag, _, since in inits]
    for requests in gathering.values():
        missing = [w for w in active if w not in requests]
        held += [(since, w, tag, missing) for w, (tag, _, since) in requests.items()]
    held = sorted((entry for entry in held if set(entry[3]) - {entry[1]}), key=lambda entry: entry[0])
    return [[job_rank[w], tag, [job_rank[q] for q in needs]] for _, w, tag, needs in held[:MAX_HOLDS]]
