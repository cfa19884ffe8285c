"""Where each key's bytes live: chunks of keys assigned to servers, as a plain value.

A key larger than the chunk size is cut into nearly equal contiguous chunks
of at most that size; every chunk, and every smaller key whole, goes to the
server holding the fewest bytes so far (lowest index on ties).  Greedy
assignment to the least-loaded server keeps the most loaded server within one
chunk of the mean.  Every worker adds the same keys in the same order and so
computes the same placement without talking to anyone; the servers check the
chunks they are sent against it.
"""
from __future__ import annotations

from dataclasses import dataclass

from psrt.errors import InvalidArgumentError


@dataclass(frozen=True)
class Chunk:
    """Elements ``[offset, offset + numel)`` of the flattened key, held by one server."""

    chunk_id: int
    key: str
    server: int
    offset: int
    numel: int


class Placement:
    """Chunks of every key added so far, and the bytes each server holds."""

    def __init__(self, num_servers: int, chunk_bytes: int) -> None:
        if num_servers < 1:
            raise InvalidArgumentError(f"a placement needs at least one server, got {num_servers}")
        if chunk_bytes < 1:
            raise InvalidArgumentError(f"chunk size must be positive, got {chunk_bytes} bytes")
        self.num_servers, self.chunk_bytes = num_servers, chunk_bytes
        self.loads = [0] * num_servers  # bytes per server
        self.chunks: list[Chunk] = []
        self.keys: dict[str, tuple[Chunk, ...]] = {}

    def add(self, key: str, numel: int, element_size: int) -> tuple[Chunk, ...]:
        """Place a new key of ``numel`` elements; returns its chunks in offset order."""
        if key in self.keys:
            raise InvalidArgumentError(f"key {key!r} is already placed")
        per_chunk = max(1, self.chunk_bytes // element_size)
        pieces = max(1, -(-numel // per_chunk))
        base, extra = divmod(numel, pieces)
        chunks, offset = [], 0
        for index in range(pieces):
            length = base + (index < extra)
            server = min(range(self.num_servers), key=lambda s: (self.loads[s], s))
            chunk = Chunk(chunk_id=len(self.chunks), key=key, server=server, offset=offset,
                          numel=length)
            self.loads[server] += length * element_size
            self.chunks.append(chunk)
            chunks.append(chunk)
            offset += length
        self.keys[key] = tuple(chunks)
        return self.keys[key]
