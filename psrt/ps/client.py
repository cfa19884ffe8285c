"""The worker's key-value store: ``init``, ``push``, ``pull``, ``push_pull`` and their
asynchronous forms, in the spirit of MXNet's KVStore.

Keys are parameter names.  Every worker creates its stores, and inits their
keys, in the same order (placement is computed locally from that order); the
stored value of a key is worker 0's.  A request goes to each server holding a
chunk of the key at once, so pushes and pulls of different keys and servers
are all in flight together; tensors travel straight from and into their own
memory.  Errors a server reports arrive as :class:`~psrt.errors.ParameterServerError`
from ``wait()`` (for a push, from the worker's next request with a reply).

This module decides what to ask the servers; how a request travels and is kept until
settled is :mod:`psrt.ps.store_requests`', and the checks of a call's key and tensor are
:mod:`psrt.ps.keys`'.
"""
from __future__ import annotations

import json
import uuid

import torch

from psrt.comm.base import Request
from psrt.errors import InvalidArgumentError, ParameterServerError
from psrt.ps import checkpoint, protocol
from psrt.ps.handles import Handle, Reply
from psrt.ps.keys import KeyRecord, check_init, known_key, on_host
from psrt.ps.placement import Chunk, Placement
from psrt.ps.protocol import HEADER_TAG, Mode, RequestKind
from psrt.ps.service import WorkerLink
from psrt.ps.shard import optimizer_spec
from psrt.ps.store_requests import StoreRequests
from psrt.runtime import Runtime, given

_MODES = {"sync": Mode.SYNC, "async": Mode.ASYNC, "bounded": Mode.BOUNDED}
_REDUCTIONS = {"mean": 0, "sum": 1}


def link(current: Runtime) -> WorkerLink:
    """This worker's link to the servers in ``current``; a clear error outside
    parameter-server mode."""
    ps = current.ps
    if ps is None:
        raise InvalidArgumentError("no parameter servers in this job: launch with "
                                   "`psrun --num-servers S ...` (or set PSRT_NUM_SERVERS=S)")
    return ps


class KVStore:
    """Keys (parameter names) held by the parameter servers.

    In ``"sync"`` mode each step makes one update from all workers' pushes, and a pull after a
    push returns the updated value; ``"async"`` applies every push on arrival; ``"bounded"``
    lets a worker run at most ``max_staleness`` steps ahead of the slowest (it waits in pull).
    Only in parameter-server mode (``psrun --num-servers S``), on worker ranks.

    Collective: every worker constructs the same stores, with the same settings, in the same
    order.

    :param mode: ``"sync"`` (the default), ``"async"`` or ``"bounded"``.
    :param max_staleness: τ, the steps a worker may run ahead of the slowest: an int >= 0,
        required with ``mode="bounded"`` and refused otherwise; default None.
    :param reduce: ``"mean"`` (the default) scales each pushed gradient by 1/num_workers (keys
        must then be floating point), ``"sum"`` does not.  Keyword only.
    :param runtime: the psrt runtime whose servers hold the keys; default None: the current one.
        Keyword only.
    """

    def __init__(self, mode: str = "sync", *, max_staleness: int | None = None,
                 reduce: str = "mean", runtime: Runtime | None = None) -> None:
        self.runtime = given(runtime)
        if mode not in _MODES:
            raise InvalidArgumentError(f"mode must be one of {sorted(_MODES)}, got {mode!r}")
        if (mode == "bounded") != (max_staleness is not None):
            raise InvalidArgumentError("max_staleness is required with mode='bounded' and only there")
        if max_staleness is not None and (isinstance(max_staleness, bool) or not isinstance(max_staleness, int)
                                          or max_staleness < 0):
            raise InvalidArgumentError(f"max_staleness must be an int >= 0, got {max_staleness!r}")
        if reduce not in _REDUCTIONS:
            raise InvalidArgumentError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
        self._link = link(self.runtime)
        self._workers = self.runtime.channel()  # the workers' world: where they agree on saves and loads
        self.mode, self.max_staleness, self.reduce = mode, max_staleness, reduce
        self.store_id = self._link.register_store(self)
        self._placement = Placement(self._link.num_servers, self._link.config.ps_chunk_bytes)
        self._keys: dict[str, KeyRecord] = {}
        self._requests = StoreRequests(self._link, self.store_id)
        settings = {"mode": int(_MODES[mode]), "max_staleness": max_staleness or 0, "reduce": _REDUCTIONS[reduce]}
        self._requests.everywhere(RequestKind.CONFIGURE, document=settings).wait()

    # -- the key-value API --------------------------------------------------------------------
    def init(self, key: str, tensor: torch.Tensor) -> None:
        """Create ``key`` with worker 0's ``tensor`` as its value; returns once the value is on the
        servers.  Initialising a key again with the same shape and dtype does nothing.

        Collective: every worker calls it, for the same keys in the same order.

        :param key: the key's name (a str), e.g. the parameter's name.
        :param tensor: the initial value (worker 0's is kept): a tensor of a dtype psrt carries,
            floating point unless the store was made with ``reduce="sum"``; the same shape and dtype
            on every worker.
        """
        check_init(key, tensor, self.reduce)
        known = self._keys.get(key)
        if known is not None:
            if (known.shape, known.dtype) != (tensor.shape, tensor.dtype):
                raise InvalidArgumentError(f"key {key!r} was already initialised with {known.describe()}; "
                                           f"init again with shape {list(tensor.shape)} {tensor.dtype}")
            return
        chunks = self._placement.add(key, tensor.numel(), tensor.element_size())
        flat = on_host(tensor).view(-1)
        owner = self._link.worker == 0
        handles = []
        for chunk in chunks:
            meta = protocol.encode({"key": key, "shape": list(tensor.shape), "offset": chunk.offset})
            data = flat[chunk.offset:chunk.offset + chunk.numel] if owner else None
            handles.append(self._requests.request(chunk.server, RequestKind.INIT, chunk, dtype=tensor.dtype, meta=meta,
                                                  data=data, what=f"init of key {key!r}"))
        pushes = self._push_tags(key, chunks, handles, tensor.dtype)
        self._keys[key] = KeyRecord(tensor.shape, tensor.dtype, chunks, pushes, tuple(sorted({p[0] for p in pushes})))

    def _push_tags(self, key: str, chunks: tuple[Chunk, ...], inits: list[Handle],
                   dtype: torch.dtype) -> tuple[tuple[int, int, torch.Tensor], ...]:
        """Wait for every chunk's init; note each push tag a server gave (its receive for this
        worker's pushes is posted, even when another chunk's init failed), then raise what failed."""
        errors, pushes = [], []
        for chunk, handle in zip(chunks, inits):
            try:
                handle.wait()
            except ParameterServerError as e:
                errors.append(str(e))
                continue
            tag = self._link.push_tag(chunk.server, handle.payloads[0]["push_tag"])
            header = protocol.request(RequestKind.PUSH, self.store_id, chunk.chunk_id, dtype=dtype, numel=chunk.numel)
            pushes.append((self._link.server_rank(chunk.server), tag, header.encode()))
        if errors:
            raise ParameterServerError("; ".join(dict.fromkeys(errors)))
        return tuple(pushes)

    def push_async(self, key: str, tensor: torch.Tensor) -> Handle:
        """Send ``tensor`` (a gradient, or a value without optimizer) to the servers of ``key``
        and return at once; errors a server reports arrive with this worker's next request that
        has a reply.

        Collective in ``"sync"`` mode: every worker pushes each key once per step, in the same order
        of steps (a pull waits for every worker's push of its step); in ``"async"`` and
        ``"bounded"`` modes each worker calls it on its own.

        :param key: a key created by :meth:`init` on this store.
        :param tensor: the value to push (a gradient, or a value without optimizer): the key's
            shape and dtype, on any device; do not modify it until the push is done.
        :returns: a :class:`Handle`; its ``wait()`` returns None once the data has left.
        """
        info = known_key(self._keys, key, tensor, "push")
        self._requests.ensure_open()
        data = on_host(tensor)
        link = self._link
        sends = []
        with link.lock:
            if len(info.chunks) == 1:  # the common case, kept short: a push is on the step's critical path
                rank, tag, header = info.pushes[0]
                sends += [link.comm.isend(header, rank, HEADER_TAG), link.comm.isend(data, rank, tag)]
            else:
                flat = data.view(-1)
                for chunk, (rank, tag, header) in zip(info.chunks, info.pushes):
                    part = flat[chunk.offset:chunk.offset + chunk.numel]
                    sends += [link.comm.isend(header, rank, HEADER_TAG), link.comm.isend(part, rank, tag)]
        return self._requests.track(Handle(sends, [], link=link, servers=info.servers,
                                           what=f"push of key {key!r}"))

    def pull_async(self, key: str, out: torch.Tensor | None = None) -> Handle:
        """Fetch ``key``'s value once the consistency mode allows: after this worker's earlier
        pushes of it are applied, and in sync mode after every worker's push of the same step.

        Collective in ``"sync"`` mode: every worker pushes each key once per step, in the same order
        of steps (a pull waits for every worker's push of its step); in ``"async"`` and
        ``"bounded"`` modes each worker calls it on its own.

        :param key: a key created by :meth:`init` on this store.
        :param out: where the value goes: a tensor of the key's shape and dtype; default None: a
            new CPU tensor.
        :returns: a :class:`Handle`; its ``wait()`` returns the value.
        """
        info = known_key(self._keys, key, out, "pull")
        if out is None:
            out = torch.empty(info.shape, dtype=info.dtype)
        direct = out.device.type == "cpu" and out.is_contiguous()
        target = out if direct else torch.empty(info.shape, dtype=info.dtype)
        sends: list[Request] = []
        replies: list[Reply] = []
        if len(info.chunks) == 1:  # the common case, kept short: a pull is on the step's critical path
            self._requests.post(sends, replies, info.chunks[0].server, RequestKind.PULL, info.chunks[0],
                                dtype=info.dtype, receive_into=target)
        else:
            flat = target.view(-1)
            for c in info.chunks:
                self._requests.post(sends, replies, c.server, RequestKind.PULL, c, dtype=info.dtype,
                                    receive_into=flat[c.offset:c.offset + c.numel])
        return self._requests.track(Handle(sends, replies, out, None if direct else (lambda: out.copy_(target)),
                                           link=self._link, servers=info.servers, what=f"pull of key {key!r}"))

    def push_pull_async(self, key: str, tensor: torch.Tensor, out: torch.Tensor | None = None) -> Handle:
        """Push ``tensor``, then pull the value that includes it.

        Collective in ``"sync"`` mode: every worker pushes each key once per step, in the same order
        of steps (a pull waits for every worker's push of its step); in ``"async"`` and
        ``"bounded"`` modes each worker calls it on its own.

        :param key: a key created by :meth:`init` on this store.
        :param tensor: the value to push (a gradient, or a value without optimizer): the key's
            shape and dtype, on any device; do not modify it until the push is done.
        :param out: where the value goes: a tensor of the key's shape and dtype; default None: a
            new CPU tensor.
        :returns: a :class:`Handle`; its ``wait()`` returns the pulled value.
        """
        push = self.push_async(key, tensor)
        pull = self.pull_async(key, out)
        return Handle.joined([push, pull], pull._result, what=f"push and pull of key {key!r}")

    def push(self, key: str, tensor: torch.Tensor) -> None:
        """:meth:`push_async`, waited for.

        Collective in ``"sync"`` mode: every worker pushes each key once per step, in the same order
        of steps (a pull waits for every worker's push of its step); in ``"async"`` and
        ``"bounded"`` modes each worker calls it on its own.

        :param key: a key created by :meth:`init` on this store.
        :param tensor: the value to push (a gradient, or a value without optimizer): the key's
            shape and dtype, on any device; do not modify it until the push is done.
        """
        self.push_async(key, tensor).wait()

    def pull(self, key: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`pull_async`, waited for: returns the value.

        Collective in ``"sync"`` mode: every worker pushes each key once per step, in the same order
        of steps (a pull waits for every worker's push of its step); in ``"async"`` and
        ``"bounded"`` modes each worker calls it on its own.

        :param key: a key created by :meth:`init` on this store.
        :param out: where the value goes: a tensor of the key's shape and dtype; default None: a
            new CPU tensor.
        :returns: the key's value (``out`` when given).
        """
        return self.pull_async(key, out).wait()

    def push_pull(self, key: str, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`push_pull_async`, waited for: returns the value that includes the push.

        Collective in ``"sync"`` mode: every worker pushes each key once per step, in the same order
        of steps (a pull waits for every worker's push of its step); in ``"async"`` and
        ``"bounded"`` modes each worker calls it on its own.

        :param key: a key created by :meth:`init` on this store.
        :param tensor: the value to push (a gradient, or a value without optimizer): the key's
            shape and dtype, on any device; do not modify it until the push is done.
        :param out: where the value goes: a tensor of the key's shape and dtype; default None: a
            new CPU tensor.
        :returns: the key's value after the push (``out`` when given).
        """
        return self.push_pull_async(key, tensor, out).wait()

    def keys(self) -> list[str]:
        """The keys this worker has initialised, in order (no communication)."""
        return list(self._keys)

    # -- the servers' optimizer -----------------------------------------------------------------
    def set_optimizer(self, optimizer: str | type, **hyperparameters: object) -> None:
        """Have the servers apply pushes with ``optimizer`` and these hyperparameters, instead of
        storing pushed values.  A request to the servers that no other worker has to match.

        :param optimizer: a ``torch.optim`` optimizer class or its name, e.g. ``"SGD"``, ``"Adam"``.
        :param hyperparameters: its options (numbers, bools, strings, tuples), e.g. ``lr=0.1``;
            checked here by building the optimizer once.
        """
        spec = optimizer_spec(optimizer, hyperparameters)
        self._requests.everywhere(RequestKind.SET_OPTIMIZER, document={"name": spec.name,
                                                     "hyperparameters": spec.hyperparameters}).wait()

    def set_learning_rate(self, lr: float) -> None:
        """Change the servers' learning rate, from this worker's next push on.  A message to the
        servers that no other worker has to match.

        :param lr: the learning rate, a number >= 0.
        """
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or lr < 0:
            raise InvalidArgumentError(f"learning rate must be a number >= 0, got {lr!r}")
        self._requests.everywhere(RequestKind.SET_LR, document={"lr": float(lr)}, reply=False)

    # -- checkpoints and statistics ----------------------------------------------------------------
    def save(self, path: str, extra: dict | None = None) -> None:
        """Every server writes its shards, optimizer state and clocks (of every store) under
        ``path``, and worker 0 the manifest that makes it a checkpoint; if that fails, every
        worker raises.

        Collective: every worker calls it, in the same order, at the same point of its loop.

        :param path: the checkpoint's directory, the same on every worker and reachable by every
            server.
        :param extra: anything JSON can hold (e.g. the epoch), kept in the manifest and returned
            by :meth:`restore`; default None.
        """
        path = str(path)
        json.dumps(extra)  # fail before any server writes, on the calling worker
        save_id = self._workers.broadcast_object(uuid.uuid4().hex if self._link.worker == 0 else None, 0,
                                                 name=f"psrt.ps.save.{self.store_id}")
        handle = self._requests.everywhere(RequestKind.SAVE, document={"path": path, "save_id": save_id})
        handle.wait()
        failure = None
        if self._link.worker == 0:  # every server has saved: now it is a checkpoint
            files = {name: record for payload in handle.payloads for name, record in payload["files"].items()}
            try:
                checkpoint.write_manifest(path, save_id, self._link.num_servers, files, extra)
            except OSError as e:  # every worker raises it, none is left waiting
                failure = f"the servers saved to {path!r}, but writing its {checkpoint.MANIFEST} failed: {e}"
        failure = self._workers.broadcast_object(failure, 0, name=f"psrt.ps.saved.{self.store_id}")
        if failure is not None:
            raise ParameterServerError(failure)

    def load(self, path: str) -> int:
        """Restore what :meth:`save` wrote (every store on the servers; after the same inits and
        set_optimizer calls).  Every server's file is checked (against the size and sha256 the
        manifest records, then read as safetensors, or an earlier psrt's ``torch.save`` file with
        ``weights_only``) before any is restored; a refused load raises on every worker and
        leaves the servers as they were.

        Collective: every worker calls it, in the same order.

        :param path: the checkpoint's directory, as given to :meth:`save`, the same on every worker.
        :returns: the number of steps this store had taken.
        """
        return self.restore(path)[0]

    def restore(self, path: str) -> tuple[int, dict | None]:
        """:meth:`load`, returning the steps this store had taken and the ``extra`` saved with
        the checkpoint.

        Collective: every worker calls it, in the same order.
        """
        path = str(path)
        manifest = self._workers.broadcast_object(checkpoint.read_manifest(path) if self._link.worker == 0 else None,
                                                  0, name=f"psrt.ps.load.{self.store_id}")
        if isinstance(manifest, str):
            raise ParameterServerError(manifest)
        document = {"path": path, "save_id": manifest["save_id"], "files": manifest.get("files")}
        self._requests.everywhere(RequestKind.LOAD, document={**document, "check": True}).wait()
        handle = self._requests.everywhere(RequestKind.LOAD, document={**document, "check": False})
        handle.wait()
        steps = [p["steps"][str(self.store_id)] for p in handle.payloads]
        return min(s for s in steps if s is not None), manifest.get("extra")

    def stats(self) -> dict:
        """What the servers counted: per key and chunk the pushes applied and updates made,
        and how often a pull was answered at each staleness (steps ahead of the slowest).  A
        request to the servers that no other worker has to match.
        """
        handle = self._requests.everywhere(RequestKind.STATS)
        handle.wait()
        keys: dict[str, dict] = {}
        staleness: dict[int, int] = {}
        for payload in handle.payloads:
            for key, chunks in payload["keys"].items():
                keys.setdefault(key, {}).update({int(c): v for c, v in chunks.items()})
            for lead, count in payload["staleness"].items():
                staleness[int(lead)] = staleness.get(int(lead), 0) + count
        ordered = {key: [chunks[c] for c in sorted(chunks)] for key, chunks in keys.items()}
        return {"pushes_applied": {k: [c["pushes_applied"] for c in v] for k, v in ordered.items()},
                "updates": {k: [c["updates"] for c in v] for k, v in ordered.items()},
                "staleness": dict(sorted(staleness.items())),
                "max_staleness": max(staleness, default=0)}

    def close(self) -> None:
        """Finish this worker's outstanding requests (run by ``psrt.shutdown()``)."""
        self._requests.finish()
