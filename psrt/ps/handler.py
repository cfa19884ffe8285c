"""What a parameter server does with each request, and the progress requests make possible:
the server's stores, which pushes are applied and which pulls, saves and loads may be
answered now.

The server's loop (:class:`psrt.ps.server.Server`) takes each request's header in and hands
it to :meth:`RequestHandler.dispatch`; a request that carries a JSON document or data waits
for it to arrive (:mod:`psrt.ps.replies` runs what follows).  A turn of the loop then calls
:meth:`RequestHandler.advance`, which looks only at the shards a request or an arrived push
has touched, so a model with many keys costs nothing while idle.  Kept apart from the loop,
which decides when to look, and from the replies, which say how an answer travels: this
module says what the answer is.
"""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import ClassVar

import torch

from psrt.comm.buffers import host_buffer
from psrt.comm.header import Header
from psrt.errors import InvalidArgumentError, ParameterServerError
from psrt.ps import checkpoint, protocol, stalls
from psrt.ps.protocol import Mode, RequestKind
from psrt.ps.pushes import PostedPushes
from psrt.ps.replies import Replies
from psrt.ps.shard import ChunkMeta, OptimizerSpec, Shard
from psrt.ps.store import InitAnswer, Store

# What a request can fail with and be answered: bad input, a failing optimizer, a bad path.
_REPORTABLE = (InvalidArgumentError, ParameterServerError, RuntimeError, TypeError, ValueError,
               KeyError, OSError)


class RequestHandler:
    """The requests of ``num_workers`` workers against the stores of server ``index`` (of
    ``num_servers``), called ``name`` in errors; answered through ``replies``, with pushes
    arriving into ``pushes``; ``max_tag`` is the communicator's largest tag, and ``abort``
    ends the job (a request this psrt cannot read)."""

    def __init__(self, replies: Replies, pushes: PostedPushes, *, name: str, index: int, num_servers: int,
                 num_workers: int, max_tag: int, abort: Callable[[str], None]) -> None:
        self._replies, self._pushes, self.name, self._abort = replies, pushes, name, abort
        self._index, self._num_servers, self.num_workers, self._max_tag = index, num_servers, num_workers, max_tag
        self.stores: dict[int, Store] = {}
        self.departed: set[int] = set()
        self.active = list(range(num_workers))  # workers that have not shut down
        self._store_of: dict[Shard, int] = {}
        self._push_tag: dict[Shard, int] = {}
        # save and load requests so far, by worker: (tag, document, since)
        self.gathering: dict[RequestKind, dict[int, tuple[int, dict, float]]] = {RequestKind.SAVE: {},
                                                                                  RequestKind.LOAD: {}}
        # Shards whose pushes or pulls may have become ready: only these are looked at
        # in a turn of the loop, so a model with many keys costs nothing while idle.
        self.touched: set[Shard] = set()

    def waiting(self) -> bool:
        """Whether anything may have become ready since the last :meth:`advance`."""
        return bool(self.touched or self.gathering[RequestKind.SAVE] or self.gathering[RequestKind.LOAD])

    def holds_pulls(self) -> bool:
        return any(shard.pulls for store in self.stores.values() for shard in store.shards.values())

    def dispatch(self, worker: int, header: Header) -> None:
        """Run ``worker``'s request; an error it raises is answered to that worker."""
        handler = self._HANDLERS.get(header.kind)
        if handler is None:
            self._abort(f"{self.name}: worker {worker} sent an unknown request {header.words()}: "
                        "are all ranks running the same psrt?")
            return
        try:
            handler(self, worker, header)
        except _REPORTABLE as e:
            self._fail(RequestKind(header.kind), worker, header.args[0], header.ident, str(e))

    def _fail(self, kind: RequestKind, worker: int, store_id: int, tag: int, text: str) -> None:
        """Report a failed request to the worker that made it."""
        if kind == RequestKind.PULL:
            self._replies.refuse_pull(worker, tag, text)
        elif kind in (RequestKind.PUSH, RequestKind.SET_LR):
            self._replies.defer(worker, store_id, text)
        else:
            self._replies.ack_error(worker, tag, text)

    def _with_meta(self, worker: int, header: Header, then: Callable[[dict], None]) -> None:
        """Receive the JSON document following a header, then run ``then`` on it (errors
        go back to the worker like those of the header itself)."""
        store_id, _, length, _ = header.args
        data = torch.empty(length, dtype=torch.uint8)

        def received() -> None:
            try:
                then(protocol.decode(data))
            except _REPORTABLE as e:
                self._fail(RequestKind(header.kind), worker, store_id, header.ident, str(e))
        self._replies.receive(worker, data, header.ident, received)

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
            self._replies.ack(worker, header.ident)
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
                return self._replies.ack_error(worker, tag, str(e))
            if created is not None:
                self._store_of[created] = store_id
                self._push_tag[created] = protocol.push_tag(len(self._push_tag), self._max_tag)
            self._answer_inits(store_id, store.shards.get(chunk_id), answers)
        self._with_meta(worker, header, lambda doc: (documents.append(doc), part_done()))
        if data is not None:
            self._replies.receive(worker, data, tag + 1, part_done)

    def _answer_inits(self, store_id: int, shard: Shard | None, answers: list[InitAnswer]) -> None:
        """Answer inits; each that succeeded gets the chunk's push tag, on which this server
        now has the receive of that worker's first push posted."""
        for who, tag, error in answers:
            if error is None and shard is not None:
                self._pushes.open(who, shard, self._push_tag[shard])
                self._replies.ack(who, tag, {"push_tag": self._push_tag[shard]}, store_id=store_id)
            else:
                self._replies.ack_error(who, tag, error or "the chunk was never created")

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
        self.touched.add(shard)

    def _set_optimizer(self, worker: int, header: Header) -> None:
        store_id = header.args[0]

        def apply(doc: dict) -> None:
            self._store(store_id).set_optimizer(OptimizerSpec(doc["name"], doc["hyperparameters"]))
            self._replies.ack(worker, header.ident, store_id=store_id)
        self._with_meta(worker, header, apply)

    def _set_lr(self, worker: int, header: Header) -> None:
        store_id = header.args[0]
        self._with_meta(worker, header, lambda doc: self._store(store_id).set_lr(doc["lr"]))

    def _gather(self, worker: int, header: Header) -> None:
        store_id, kind = header.args[0], RequestKind(header.kind)

        def arrived(doc: dict) -> None:
            self._store(store_id)
            self.gathering[kind][worker] = (header.ident, doc, time.monotonic())
        self._with_meta(worker, header, arrived)

    def _stats(self, worker: int, header: Header) -> None:
        store_id = header.args[0]
        self._replies.ack(worker, header.ident, self._store(store_id).stats(), store_id=store_id)

    def _bye(self, worker: int, _header: Header) -> None:
        self.departed.add(worker)
        self.active = [w for w in range(self.num_workers) if w not in self.departed]
        self._pushes.close(worker)
        if worker == 0:
            for store_id, store in self.stores.items():
                self._answer_inits(store_id, None, store.refuse_waiting_inits())
        for text in self._replies.take_unheard(worker):  # nobody is left to hear them: at least say them here
            print(f"psrt: {self.name}: worker {worker} shut down before hearing: {text}", file=sys.stderr,
                  flush=True)
        self._touch_all()  # the departed no longer hold anyone back, or make steps impossible

    def _touch_all(self) -> None:
        self.touched.update(shard for store in self.stores.values() for shard in store.shards.values())

    _HANDLERS: ClassVar[dict[int, Callable]] = {
        RequestKind.CONFIGURE: _configure, RequestKind.INIT: _init, RequestKind.PUSH: _push,
        RequestKind.PULL: _pull, RequestKind.SET_OPTIMIZER: _set_optimizer, RequestKind.SET_LR: _set_lr,
        RequestKind.STATS: _stats, RequestKind.BYE: _bye, RequestKind.SAVE: _gather, RequestKind.LOAD: _gather,
    }

    # -- progress ---------------------------------------------------------------------------------
    def advance(self) -> bool:
        """Apply what may be applied, answer what may be answered."""
        progressed = False
        active = self.active
        touched = list(self.touched)
        self.touched.clear()
        for shard in touched:
            progressed |= self._apply(shard, active)
            for pull in shard.ready_pulls(active):
                self._answer_pull(pull.worker, pull.tag, shard)
                progressed = True
            if self.departed and shard.pulls and shard.consistency.mode == Mode.SYNC:
                self._refuse_impossible_pulls(shard)
        for kind in (RequestKind.SAVE, RequestKind.LOAD):
            progressed |= self._run_gathered(kind, active)
        return progressed

    def _answer_pull(self, worker: int, tag: int, shard: Shard) -> None:
        """Send a ready pull its value; once it has left, pushes held back while it was read
        may be applied."""
        def sent() -> None:
            if not shard.sending and shard.pushes_in_flight():  # updates held back while it was read
                self.touched.add(shard)
        self._replies.answer_pull(worker, tag, shard, self._store_of[shard], sent)

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
                self._replies.refuse_pull(pull.worker, pull.tag, shard.failed)
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
                self._replies.refuse_pull(pull.worker, pull.tag,
                                          f"step {pull.target} of {shard.meta.describe()} can never complete: "
                                          f"worker{'s' if len(gone) > 1 else ''} {stalls.names(gone)} shut down "
                                          "without pushing it")

    def _run_gathered(self, kind: RequestKind, active: list[int]) -> bool:
        """Save or load once every active worker asked for it and no push is in flight."""
        requests = self.gathering[kind]
        if not requests or any(w not in requests for w in active):
            return False
        if any(shard.failed is None and (shard.pushes_in_flight() or shard.sending)
               for store in self.stores.values() for shard in store.shards.values()):
            return False
        self.gathering[kind] = {}
        documents = {json.dumps(doc, sort_keys=True) for _, doc, _ in requests.values()}
        try:
            if len(documents) != 1:
                raise ParameterServerError(f"workers asked for different {kind.name.lower()}s: {sorted(documents)}")
            doc = json.loads(documents.pop())
            where = (doc["path"], self._index, self._num_servers)
            if kind == RequestKind.SAVE:  # the reply carries the file's record to worker 0, for the manifest
                reply = {"files": checkpoint.save_server(*where, self.stores, doc["save_id"])}
            else:
                reply = checkpoint.load_server(*where, self.stores, doc["save_id"], restore=not doc["check"],
                                               files=doc["files"])
                self._touch_all()
        except _REPORTABLE as e:
            for worker, (tag, _, _) in requests.items():
                self._replies.ack_error(worker, tag, f"{kind.name.lower()} failed: {e}")
            return True
        for worker, (tag, _, _) in requests.items():
            self._replies.ack(worker, tag, reply)
        return True

    def report_unfinished_steps(self) -> None:
        """Say which workers' pushes were never applied (at the end, once every worker left)."""
        for store in self.stores.values():
            for shard in store.shards.values():
                if shard.failed is None and shard.pushes_in_flight():
                    print(f"psrt: {self.name}: warning: pushes to {shard.meta.describe()} from workers "
                          f"{[w for w in range(self.num_workers) if shard.received[w] > shard.applied[w]]} "
                          "were never applied: the other workers shut down without pushing that step",
                          file=sys.stderr, flush=True)
