"""The parameter server: one event loop per server rank, serving every worker at once.

The loop never blocks on one worker.  It keeps one header receive posted per worker and
one push receive per worker and chunk (:mod:`psrt.ps.pushes`), starts the receives and
sends each request needs, and in every turn applies the pushes and answers the pulls that
the consistency mode allows; between turns with nothing to do it spins, then naps
(:class:`psrt.comm.poll.Backoff`).  An error in one request is answered to the worker that
sent it (at once for requests with a reply; for a push, with the worker's next reply about
the same store, or printed here if the worker has left), never swallowed.  What the server
holds back (requests waiting for other workers, data still arriving) is published to the
watchdog once a second, which reports it, naming the workers waited for, after
``PSRT_STALL_CHECK_TIME`` and ends the job after ``PSRT_STALL_SHUTDOWN_TIME`` (see
:mod:`psrt.ps.stalls`).
"""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import ClassVar

import numpy as np
import torch

from psrt.comm.base import Communicator, Persistent, Request
from psrt.comm.buffers import host_buffer
from psrt.comm.header import HEADER_WORDS, Header
from psrt.comm.poll import Backoff
from psrt.comm.waits import Wait
from psrt.comm.watchdog import Watchdog, combined
from psrt.config import Config
from psrt.errors import InvalidArgumentError, ParameterServerError
from psrt.ps import checkpoint, protocol, stalls
from psrt.ps.protocol import Mode, Op, Status
from psrt.ps.pushes import PostedPushes
from psrt.ps.roles import Roles
from psrt.ps.shard import ChunkMeta, OptimizerSpec, Shard
from psrt.ps.store import InitAnswer, Store

_STALL_SCAN_S = 1.0
_OK = protocol.reply(Status.OK).encode()  # a send buffer every reply of a pull may share
# What a request can fail with and be answered: bad input, a failing optimizer, a bad path.
_REPORTABLE = (InvalidArgumentError, ParameterServerError, RuntimeError, TypeError, ValueError,
               KeyError, OSError)


class Server:
    """Serves the workers of ``roles`` over ``comm`` until all of them have shut down."""

    def __init__(self, comm: Communicator, roles: Roles, config: Config, watchdog: Watchdog,
                 abort: Callable[[str], None]) -> None:
        self.comm, self.roles, self.config, self._abort = comm, roles, config, abort
        self._watchdog = watchdog
        self.index = roles.server_index(comm.rank)
        self.num_workers = len(roles.workers)
        self.stores: dict[int, Store] = {}
        self.departed: set[int] = set()
        self._active = list(range(self.num_workers))  # workers that have not shut down
        # per worker still connected: the words its next header arrives in (a numpy view, read
        # faster), the persistent receive into them, and its current start
        self._headers: dict[int, tuple[np.ndarray, Persistent, Request]] = {}
        self._pushes = PostedPushes(comm, roles.workers)
        # messages under way: (request, what to run once done, since, the worker, "receive"/"send")
        self._inflight: list[tuple[Request, Callable[[], None] | None, float, int, str]] = []
        # (worker, store): errors of requests without a reply (pushes, learning rates), given
        # with the worker's next reply about that store
        self._deferred: dict[tuple[int, int], list[str]] = {}
        self._store_of: dict[Shard, int] = {}
        self._push_tag: dict[Shard, int] = {}
        # save and load requests so far, by worker: (tag, document, since)
        self._gathering: dict[Op, dict[int, tuple[int, dict, float]]] = {Op.SAVE: {}, Op.LOAD: {}}
        # Shards whose pushes or pulls may have become ready: only these are looked at
        # in a turn of the loop, so a model with many keys costs nothing while idle.
        self._touched: set[Shard] = set()
        self._next_stall_scan = time.monotonic() + _STALL_SCAN_S

    @property
    def name(self) -> str:
        return f"parameter server {self.index} (rank {self.comm.rank})"

    def serve(self) -> None:
        self._listen()
        backoff = Backoff()
        while not self._finished():
            if self._turn():
                backoff.busy()
            else:
                backoff.idle()
            if time.monotonic() >= self._next_stall_scan:
                self._scan_for_stalls()
        self._watchdog.publish("parameter server", ())
        self._report_unfinished_steps()

    def _listen(self) -> None:
        """Post the receive of every worker's first header."""
        for worker in range(self.num_workers):
            words = torch.empty(HEADER_WORDS, dtype=torch.int64)
            receive = self.comm.persistent_recv(words, self._rank(worker), protocol.HEADER_TAG)
            self._headers[worker] = (words.numpy(), receive, receive.start())

    def _turn(self) -> bool:
        """One turn of the loop: take in what arrived, answer what may be answered; whether
        anything happened.  Only what may have changed is looked at: an idle turn is cheap."""
        progressed = self._poll_headers()
        if self._pushes.watching:
            touched = self._pushes.poll()
            self._touched.update(touched)
            progressed |= bool(touched)
        if self._inflight:
            progressed |= self._poll_inflight()
        if self._touched or self._gathering[Op.SAVE] or self._gathering[Op.LOAD]:
            progressed |= self._advance()
        return progressed

    def _finished(self) -> bool:
        return len(self.departed) == self.num_workers and not self._inflight and not self._pushes.open_slots \
            and not any(shard.pulls for store in self.stores.values() for shard in store.shards.values())

    # -- messaging ------------------------------------------------------------------------
    def _rank(self, worker: int) -> int:
        return self.roles.workers[worker]

    def _receive(self, worker: int, tensor: torch.Tensor, tag: int,
                 then: Callable[[], None] | None = None) -> None:
        self._inflight.append((self.comm.irecv(tensor, self._rank(worker), tag), then, time.monotonic(), worker,
                               "receive"))

    def _send(self, worker: int, tensor: torch.Tensor, tag: int,
              then: Callable[[], None] | None = None) -> None:
        request = self.comm.isend(tensor, self._rank(worker), tag)
        if then is None and request.test():  # a small reply usually leaves at once
            return
        self._inflight.append((request, then, time.monotonic(), worker, "send"))

    def _poll_headers(self) -> bool:
        """Dispatch every header that has arrived (a worker's in the order it sent them),
        starting the receive of each worker's next one into the same buffer (a persistent
        receive: a start costs a microsecond or two, posting a receive several times that)."""
        progressed = False
        for worker, (view, receive, request) in list(self._headers.items()):
            while request.test():
                header = Header.decode(view.tolist())
                if header.kind == Op.BYE:
                    del self._headers[worker]
                    receive.free()
                else:
                    request = receive.start()
                    self._headers[worker] = (view, receive, request)
                self._dispatch(worker, header)
                progressed = True
                if header.kind == Op.BYE:
                    break
        return progressed

    def _poll_inflight(self) -> bool:
        done = [(r, then) for r, then, *_ in self._inflight if r.test()]
        if not done:
            return False
        finished = {id(r) for r, _ in done}
        self._inflight = [entry for entry in self._inflight if id(entry[0]) not in finished]
        for _, then in done:
            if then is not None:
                then()
        return True

    # -- replies ----------------------------------------------------------------------------
    def _take_deferred(self, worker: int, store_id: int | None) -> str | None:
        errors = None if store_id is None else self._deferred.pop((worker, store_id), None)
        return "; ".join(errors) if errors else None

    def _ack(self, worker: int, tag: int, payload: object = None, store_id: int | None = None) -> None:
        """Answer a request; with ``store_id``, an earlier push's error about that store
        is given instead."""
        error = self._take_deferred(worker, store_id)
        if error is not None:
            return self._ack_error(worker, tag, error)
        body = protocol.encode(payload) if payload is not None else None
        self._send(worker, protocol.reply(Status.OK, tag, 0 if body is None else body.numel()).encode(), tag)
        if body is not None:
            self._send(worker, body, tag + 1)

    def _ack_error(self, worker: int, tag: int, text: str) -> None:
        body = protocol.text_bytes(f"{self.name}: {text}")
        self._send(worker, protocol.reply(Status.ERROR, tag, body.numel()).encode(), tag)
        self._send(worker, body, tag + 1)

    def _answer_pull(self, worker: int, tag: int, shard: Shard) -> None:
        error = self._take_deferred(worker, self._store_of[shard])
        if error is not None:
            return self._refuse_pull(worker, tag, error)
        self._send(worker, _OK, tag)
        shard.sending += 1

        def sent() -> None:
            shard.sending -= 1
            if not shard.sending and shard.pushes_in_flight():  # updates held back while it was read
                self._touched.add(shard)
        self._send(worker, shard.value, tag + 1, sent)

    def _refuse_pull(self, worker: int, tag: int, text: str) -> None:
        body = protocol.text_bytes(f"{self.name}: {text}")
        self._send(worker, protocol.reply(Status.ERROR, tag, body.numel()).encode(), tag)
        self._send(worker, torch.empty(0, dtype=torch.uint8), tag + 1)  # completes the posted data receive
        self._send(worker, body, tag + 2)

    def _defer(self, worker: int, store_id: int, text: str) -> None:
        self._deferred.setdefault((worker, store_id), []).append(text)

    # -- requests -----------------------------------------------------------------------------
    def _dispatch(self, worker: int, header: Header) -> None:
        handler = self._HANDLERS.get(header.kind)
        if handler is None:
            self._abort(f"{self.name}: worker {worker} sent an unknown request {header.words()}: "
                        "are all ranks running the same psrt?")
            return
        try:
            handler(self, worker, header)
        except _REPORTABLE as e:
            self._fail(Op(header.kind), worker, header.args[0], header.ident, str(e))

    def _fail(self, op: Op, worker: int, store_id: int, tag: int, text: str) -> None:
        """Report a failed request to the worker that made it."""
        if op == Op.PULL:
            self._refuse_pull(worker, tag, text)
        elif op in (Op.PUSH, Op.SET_LR):
            self._defer(worker, store_id, text)
        else:
            self._ack_error(worker, tag, text)

    def _with_meta(self, worker: int, header: Header, then: Callable[[dict], None]) -> None:
        """Receive the JSON document following a header, then run ``then`` on it (errors
        go back to the worker like those of the header itself)."""
        store_id, _, length, _ = header.args
        data = torch.empty(length, dtype=torch.uint8)

        def received() -> None:
            try:
                then(protocol.decode(data))
            except _REPORTABLE as e:
                self._fail(Op(header.kind), worker, store_id, header.ident, str(e))
        self._receive(worker, data, header.ident, received)

    def _store(self, store_id: int) -> Store:
        store = self.stores.get(store_id)
        if store is None:
            raise ParameterServerError(f"KVStore {store_id} was never created on this server")
        return store

    def _shard(self, store_id: int, chunk_id: int, worker: int) -> Shard:
        return self._store(store_id).shard(store_id, chunk_id, worker)

    def _configure(self, worker: int, header: Header) -> None:
        store_id = header.args[0]

        def configure(doc: dict) -> None:
            settings = (doc["mode"], doc["max_staleness"], doc["reduce"])
            store = self.stores.get(store_id)
            if store is None:
                self.stores[store_id] = Store.create(settings, self.num_workers)
            else:
                store.check_settings(worker, store_id, settings)
            self._ack(worker, header.ident)
        self._with_meta(worker, header, configure)

    def _init(self, worker: int, header: Header) -> None:
        store_id, chunk_id, _, has_data = header.args
        numel, dtype, tag = header.numel, header.dtype, header.ident
        store = self._store(store_id)  # fails at once for a store never created
        data = host_buffer(numel, dtype) if has_data else None
        pending = [2 if has_data else 1]
        documents: list[dict] = []

        def part_done() -> None:
            pending[0] -= 1
            if pending[0]:
                return
            doc = documents[0]
            meta = ChunkMeta(key=doc["key"], shape=tuple(doc["shape"]), dtype=dtype, offset=doc["offset"],
                             numel=numel)
            try:
                created, answers = store.register(worker, chunk_id, tag, meta, data, self.num_workers,
                                                  worker_0_gone=0 in self.departed)
            except _REPORTABLE as e:
                return self._ack_error(worker, tag, str(e))
            if created is not None:
                self._store_of[created] = store_id
                self._push_tag[created] = protocol.push_tag(len(self._push_tag), self.comm.max_tag)
            self._answer_inits(store_id, store.shards.get(chunk_id), answers)
        self._with_meta(worker, header, lambda doc: (documents.append(doc), part_done()))
        if data is not None:
            self._receive(worker, data, tag + 1, part_done)

    def _answer_inits(self, store_id: int, shard: Shard | None, answers: list[InitAnswer]) -> None:
        """Answer inits; each that succeeded gets the chunk's push tag, on which this server
        now has the receive of that worker's first push posted."""
        for who, tag, error in answers:
            if error is None and shard is not None:
                self._pushes.open(who, shard, self._push_tag[shard])
                self._ack(who, tag, {"push_tag": self._push_tag[shard]}, store_id=store_id)
            else:
                self._ack_error(who, tag, error or "the chunk was never created")

    def _push(self, worker: int, header: Header) -> None:
        """A push's data is on its way into the receive posted for it: watch that receive,
        dropping what arrives if the push is refused (the error goes with the next reply)."""
        store_id, chunk_id, _, _ = header.args
        shard = self._store(store_id).shards.get(chunk_id)
        if shard is None or not self._pushes.has(worker, shard):
            raise ParameterServerError(f"chunk {chunk_id} of KVStore {store_id} was never initialised "
                                       f"(worker {worker} used it before init)")
        problem = shard.failed
        if (header.numel, header.dtype) != (shard.meta.numel, shard.meta.dtype):
            problem = (f"worker {worker} pushed {header.numel} elements of {header.dtype} to "
                       f"{shard.meta.describe()}, which holds {shard.meta.numel} of {shard.meta.dtype}")
        self._pushes.announce(worker, shard, accepted=problem is None)
        if problem is not None:
            raise ParameterServerError(problem)

    def _pull(self, worker: int, header: Header) -> None:
        store_id, chunk_id, _, _ = header.args
        shard = self._shard(store_id, chunk_id, worker)
        if (header.numel, header.dtype) != (shard.meta.numel, shard.meta.dtype):
            raise ParameterServerError(f"worker {worker} pulled {header.numel} elements of {header.dtype} from "
                                       f"{shard.meta.describe()}, which holds {shard.meta.numel} of "
                                       f"{shard.meta.dtype}")
        shard.add_pull(worker, header.ident)
        self._touched.add(shard)

    def _set_optimizer(self, worker: int, header: Header) -> None:
        store_id = header.args[0]

        def apply(doc: dict) -> None:
            self._store(store_id).set_optimizer(OptimizerSpec(doc["name"], doc["hyperparameters"]))
            self._ack(worker, header.ident, store_id=store_id)
        self._with_meta(worker, header, apply)

    def _set_lr(self, worker: int, header: Header) -> None:
        store_id = header.args[0]
        self._with_meta(worker, header, lambda doc: self._store(store_id).set_lr(doc["lr"]))

    def _gather(self, worker: int, header: Header) -> None:
        store_id, op = header.args[0], Op(header.kind)

        def arrived(doc: dict) -> None:
            self._store(store_id)
            self._gathering[op][worker] = (header.ident, doc, time.monotonic())
        self._with_meta(worker, header, arrived)

    def _stats(self, worker: int, header: Header) -> None:
        store_id = header.args[0]
        self._ack(worker, header.ident, self._store(store_id).stats(), store_id=store_id)

    def _bye(self, worker: int, _header: Header) -> None:
        self.departed.add(worker)
        self._active = [w for w in range(self.num_workers) if w not in self.departed]
        self._pushes.close(worker)
        if worker == 0:
            for store_id, store in self.stores.items():
                self._answer_inits(store_id, None, store.refuse_waiting_inits())
        for (who, store_id), errors in list(self._deferred.items()):
            if who == worker:  # nobody is left to hear them: at least say them here
                del self._deferred[(who, store_id)]
                for text in errors:
                    print(f"psrt: {self.name}: worker {worker} shut down before hearing: {text}",
                          file=sys.stderr, flush=True)
        self._touch_all()  # the departed no longer hold anyone back, or make steps impossible

    def _touch_all(self) -> None:
        self._touched.update(shard for store in self.stores.values() for shard in store.shards.values())

    _HANDLERS: ClassVar[dict[int, Callable]] = {
        Op.CONFIGURE: _configure, Op.INIT: _init, Op.PUSH: _push, Op.PULL: _pull,
        Op.SET_OPTIMIZER: _set_optimizer, Op.SET_LR: _set_lr, Op.STATS: _stats, Op.BYE: _bye,
        Op.SAVE: _gather, Op.LOAD: _gather,
    }

    # -- progress ---------------------------------------------------------------------------------
    def _advance(self) -> bool:
        """Apply what may be applied, answer what may be answered."""
        progressed = False
        active = self._active
        touched = list(self._touched)
        self._touched.clear()
        for shard in touched:
            progressed |= self._apply(shard, active)
            for pull in shard.ready_pulls(active):
                self._answer_pull(pull.worker, pull.tag, shard)
                progressed = True
            if self.departed and shard.pulls and shard.consistency.mode == Mode.SYNC:
                self._refuse_impossible_pulls(shard)
        for op in (Op.SAVE, Op.LOAD):
            progressed |= self._run_gathered(op, active)
        return progressed

    def _apply(self, shard: Shard, active: list[int]) -> bool:
        """Apply ready pushes; an update that fails (say, an optimizer that cannot handle
        the dtype) fails the chunk and every request on it, not the server."""
        if shard.failed is not None:
            return False
        try:
            return shard.apply_ready(active) > 0
        except _REPORTABLE as e:
            shard.failed = f"updating {shard.meta.describe()} failed: {type(e).__name__}: {e}"
            for pull in shard.pulls:
                self._refuse_pull(pull.worker, pull.tag, shard.failed)
            shard.pulls = []
            return True

    def _refuse_impossible_pulls(self, shard: Shard) -> None:
        """Sync mode: a step that needs a departed worker's push can never complete."""
        for pull in list(shard.pulls):
            # a departed worker's pushes announced before it left still arrive
            gone = [w for w in shard.missing_for(pull, range(self.num_workers))
                    if w in self.departed and shard.received[w] < pull.target]
            if gone:
                shard.pulls.remove(pull)
                self._refuse_pull(pull.worker, pull.tag,
                                  f"step {pull.target} of {shard.meta.describe()} can never complete: "
                                  f"worker{'s' if len(gone) > 1 else ''} {stalls.names(gone)} shut down "
                                  "without pushing it")

    def _run_gathered(self, op: Op, active: list[int]) -> bool:
        """Save or load once every active worker asked for it and no push is in flight."""
        requests = self._gathering[op]
        if not requests or any(w not in requests for w in active):
            return False
        if any(shard.failed is None and (shard.pushes_in_flight() or shard.sending)
               for store in self.stores.values() for shard in store.shards.values()):
            return False
        self._gathering[op] = {}
        documents = {json.dumps(doc, sort_keys=True) for _, doc, _ in requests.values()}
        try:
            if len(documents) != 1:
                raise ParameterServerError(f"workers asked for different {op.name.lower()}s: {sorted(documents)}")
            doc = json.loads(documents.pop())
            where = (doc["path"], self.index, len(self.roles.servers))
            if op == Op.SAVE:  # the reply carries the file's record to worker 0, for the manifest
                reply = {"files": checkpoint.save_server(*where, self.stores, doc["save_id"])}
            else:
                reply = checkpoint.load_server(*where, self.stores, doc["save_id"], restore=not doc["check"],
                                               files=doc["files"])
                self._touch_all()
        except _REPORTABLE as e:
            for worker, (tag, _, _) in requests.items():
                self._ack_error(worker, tag, f"{op.name.lower()} failed: {e}")
            return True
        for worker, (tag, _, _) in requests.items():
            self._ack(worker, tag, reply)
        return True

    # -- stalls --------------------------------------------------------------------------------
    def _scan_for_stalls(self) -> None:
        """Tell the watchdog what is held back, and what is still under way, now."""
        now = time.monotonic()
        self._next_stall_scan = now + _STALL_SCAN_S
        workers = self.roles.workers
        held = list(stalls.waits(self.stores, self._gathering, self._active, workers))
        under_way = [(worker, since, direction) for _, _, since, worker, direction in self._inflight]
        under_way += [(worker, since, "receive") for worker, since in self._pushes.waiting()]
        held += [Wait(stalls.KIND, f"a {direction} of a message with worker {worker}", [workers[worker]], since)
                 for worker, since, direction in under_way if now - since >= self.config.stall_check_time_s / 2]
        self._watchdog.publish("parameter server", combined(stalls.KIND, held, key="parameter server",
                                                            prefix=f"{self.name} holds "))

    def _report_unfinished_steps(self) -> None:
        for store in self.stores.values():
            for shard in store.shards.values():
                if shard.failed is None and shard.pushes_in_flight():
                    print(f"psrt: {self.name}: warning: pushes to {shard.meta.describe()} from workers "
                          f"{[w for w in range(self.num_workers) if shard.received[w] > shard.applied[w]]} "
                          "were never applied: the other workers shut down without pushing that step",
                          file=sys.stderr, flush=True)
