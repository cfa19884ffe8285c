"""One KVStore as a server holds it: its settings, optimizer and chunks, and the rules
for creating chunks from the workers' inits — plain state, no messaging."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from psrt.errors import ParameterServerError
from psrt.ps.protocol import Mode
from psrt.ps.shard import ChunkMeta, Consistency, OptimizerSpec, Shard

#: (worker, tag, error text or None): the answer owed to one init request
InitAnswer = tuple[int, int, "str | None"]


@dataclass
class Store:
    """One KVStore's shards on this server and the settings its workers created it with."""

    settings: tuple[int, int, int]  # mode, max staleness, reduce (0 mean, 1 sum)
    consistency: Consistency
    optimizer: OptimizerSpec | None = None
    shards: dict[int, Shard] = field(default_factory=dict)
    # chunk: (worker, tag, meta, since) of inits that came before worker 0's
    init_waiting: dict[int, list[tuple[int, int, ChunkMeta, float]]] = field(default_factory=dict)

    @classmethod
    def create(cls, settings: tuple[int, int, int], num_workers: int) -> Store:
        scale = 1.0 / num_workers if settings[2] == 0 else 1.0
        return cls(settings, Consistency(Mode(settings[0]), settings[1], scale))

    def check_settings(self, worker: int, store_id: int, settings: tuple[int, int, int]) -> None:
        if settings != self.settings:
            raise ParameterServerError(
                f"worker {worker} created KVStore {store_id} with {describe_settings(settings)}, "
                f"an earlier worker with {describe_settings(self.settings)}")

    def shard(self, store_id: int, chunk_id: int, worker: int) -> Shard:
        """The chunk a request names; raises if it was never initialised or has failed."""
        shard = self.shards.get(chunk_id)
        if shard is None:
            raise ParameterServerError(f"chunk {chunk_id} of KVStore {store_id} was never "
                                       f"initialised (worker {worker} used it before init)")
        if shard.failed is not None:
            raise ParameterServerError(shard.failed)
        return shard

    def register(self, worker: int, chunk_id: int, tag: int, meta: ChunkMeta, data: torch.Tensor | None,
                 num_workers: int, worker_0_gone: bool) -> tuple[Shard | None, list[InitAnswer]]:
        """Worker 0's init (the one with data) creates the chunk; the others' are checked
        against it, waiting for it if they come first.  Returns the chunk if this init
        created it, and the answers now owed."""
        shard = self.shards.get(chunk_id)
        if shard is None and data is None:
            if worker_0_gone:
                raise ParameterServerError(f"worker {worker}'s init of key {meta.key!r} can never complete: "
                                           "worker 0, whose value it waits for, has shut down")
            self.init_waiting.setdefault(chunk_id, []).append((worker, tag, meta, time.monotonic()))
            return None, []
        created = None
        if shard is None:
            shard = created = self.shards[chunk_id] = Shard(meta, num_workers, self.consistency)
            shard.set_value(data)
            shard.set_optimizer(self.optimizer)
        answers = []
        for who, their_tag, their_meta, _ in [*self.init_waiting.pop(chunk_id, []), (worker, tag, meta, 0.0)]:
            error = None if their_meta == shard.meta else (
                f"worker {who} initialised key {their_meta.key!r} as {describe_meta(their_meta)}, but "
                f"chunk {chunk_id} holds key {shard.meta.key!r} as {describe_meta(shard.meta)} "
                "(every worker must init the same keys, with the same shapes, in the same order)")
            answers.append((who, their_tag, error))
        return created, answers

    def refuse_waiting_inits(self) -> list[InitAnswer]:
        """Worker 0 has shut down: the inits waiting for its value get an error."""
        answers = [(who, tag, f"worker {who}'s init of key {meta.key!r} can never complete: "
                               "worker 0, whose value it waits for, has shut down")
                   for waiting in self.init_waiting.values() for who, tag, meta, _ in waiting]
        self.init_waiting.clear()
        return answers

    def set_optimizer(self, spec: OptimizerSpec) -> None:
        spec.build(torch.nn.Parameter(torch.zeros(1)))  # fails here, with the reason, if invalid
        if spec != self.optimizer:
            self.optimizer = spec
            for shard in self.shards.values():
                shard.set_optimizer(spec)

    def set_lr(self, lr: float) -> None:
        if self.optimizer is None:
            raise ParameterServerError("set_learning_rate() before set_optimizer()")
        self.optimizer = OptimizerSpec(self.optimizer.name, {**self.optimizer.hyperparameters, "lr": lr})
        for shard in self.shards.values():
            shard.set_lr(lr)

    def stats(self) -> dict:
        """Per key and chunk the pushes applied and updates made, and the pulls answered at
        each staleness."""
        staleness: dict[int, int] = {}
        keys: dict[str, dict] = {}
        for chunk_id, shard in sorted(self.shards.items()):
            for lead, count in shard.staleness.items():
                staleness[lead] = staleness.get(lead, 0) + count
            keys.setdefault(shard.meta.key, {})[str(chunk_id)] = {"pushes_applied": shard.pushes_applied,
                                                                   "updates": shard.updates}
        return {"keys": keys, "staleness": staleness}


def describe_meta(meta: ChunkMeta) -> str:
    return f"shape {list(meta.shape)} {meta.dtype} (elements {meta.offset}..{meta.offset + meta.numel})"


def describe_settings(settings: tuple[int, int, int]) -> str:
    mode, staleness, reduce = settings
    bound = f", max_staleness={staleness}" if Mode(mode) == Mode.BOUNDED else ""
    return f"mode={Mode(mode).name.lower()!r}{bound}, reduce={'mean' if reduce == 0 else 'sum'!r}"
