"""The messages between workers and servers: direct-layer headers and tensor data.

Every request is a :class:`~psrt.comm.header.Header` on :data:`HEADER_TAG`, so a server
keeps exactly one receive posted per worker and reads that worker's requests in the order
they were sent.  Its kind is the :class:`RequestKind`, its id the request's tag ``t``, its
dtype and shape those of the chunk data the request carries or asks for, and its four ints
are the store id, the chunk id, the length of a UTF-8 JSON document following on ``t``, and a
flag (an init with data).  An init's data follows on ``t + 1``.  The server's answer comes back
on ``t`` (a header: the :class:`Status` as its kind, the length of the payload as its
shape), ``t + 1`` (the payload: tensor data or a JSON document) and ``t + 2`` (an error
text, for a pull whose data receive is already posted).

Pushes are not answered, and their data does not wait for the server to read the header:
each travels on its chunk's own push tag (the server names it in its answer to the
worker's init) into a receive the server posted before the push was made, one per worker
and chunk, posted again as each push arrives.  The push's header only tells the server
which receive to watch.  Tensor data is never pickled: it goes from and to the tensors'
memory.
"""
from __future__ import annotations

import enum
import json

import torch

from psrt.comm.header import Header

HEADER_TAG = 1
_FIRST_TAG = 10


class RequestKind(enum.IntEnum):
    """What a worker asks a server: the kind of a request's header."""

    CONFIGURE = 1     # create a store: mode, max staleness, reduction
    INIT = 2          # register a chunk (and, from worker 0, its first value)
    PUSH = 3          # a gradient (or value) for a chunk
    PULL = 4          # ask for a chunk's value once the consistency mode allows
    SET_OPTIMIZER = 5
    SET_LR = 6
    SAVE = 7
    LOAD = 8
    STATS = 9
    BYE = 10          # this worker has shut down


class Mode(enum.IntEnum):
    SYNC = 0
    ASYNC = 1
    BOUNDED = 2


class Status(enum.IntEnum):
    OK = 0
    ERROR = 1


def push_tags_from(max_tag: int) -> int:
    """The first push tag: request tags stay below it, push tags start at it."""
    return max_tag // 2 + 1


def request_tag(counter: int, max_tag: int) -> int:
    """The first of the three tags of a worker's ``counter``-th request.  Tags wrap after
    (max_tag / 2 - 10) / 3 requests (about 360 million with Open MPI, 5 thousand with the
    smallest MPI allows): a request must complete before that many later ones."""
    return _FIRST_TAG + 3 * (counter % ((push_tags_from(max_tag) - _FIRST_TAG) // 3))


def push_tag(slot: int, max_tag: int) -> int:
    """The tag of the pushes of a server's ``slot``-th chunk (its chunks in creation order)."""
    tag = push_tags_from(max_tag) + slot
    if tag > max_tag:
        raise ValueError(f"a server holds at most {max_tag - push_tags_from(max_tag) + 1} chunks with this MPI "
                         "(its largest tag); use a larger PSRT_PS_CHUNK_BYTES or more servers")
    return tag


def request(kind: RequestKind, store: int = 0, chunk: int = 0, tag: int = 0, *, dtype: torch.dtype | None = None,
            numel: int = 0, meta: torch.Tensor | None = None, flag: int = 0) -> Header:
    """The header of a request about ``numel`` elements of ``dtype`` of a chunk, followed by
    ``meta`` (a JSON document, see :func:`encode`) if given."""
    shape = () if dtype is None else (numel,)
    return Header(kind, tag, dtype, shape, (store, chunk, 0 if meta is None else meta.numel(), flag))


def reply(code: Status, tag: int = 0, payload_len: int = 0) -> Header:
    return Header(code, tag, torch.uint8, (payload_len,))


def encode(document: object) -> torch.Tensor:
    """UTF-8 JSON bytes of a small metadata document, as a uint8 tensor."""
    return text_bytes(json.dumps(document))


def text_bytes(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8) if text \
        else torch.empty(0, dtype=torch.uint8)


def decode_text(data: torch.Tensor) -> str:
    return data.numpy().tobytes().decode()


def decode(data: torch.Tensor) -> object:
    return json.loads(decode_text(data))
