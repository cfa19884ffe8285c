"""The messages between workers and servers, over the transport's point-to-point calls.

Every request starts with a fixed header of eight int64 (:data:`HEADER_TAG`),
so a server keeps exactly one receive posted per worker and reads that
worker's requests in the order they were sent.  What follows a header
(metadata, tensor data) travels on the request's own tag ``t``, and the
server's answer comes back on ``t`` (a status of four int64), ``t + 1`` (the
payload: tensor data or UTF-8 JSON) and ``t + 2`` (an error text, for a pull
whose data receive is already posted).  Tensor data is never pickled: it goes
from and to the tensors' memory.
"""
from __future__ import annotations

import enum
import json

import numpy as np
import torch

HEADER_TAG = 1
HEADER_LEN = 8
STATUS_LEN = 4
_FIRST_TAG = 10


class Op(enum.IntEnum):
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


DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
          torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPES.index(dtype)


def request_tag(counter: int, max_tag: int) -> int:
    """The first of the three tags of a worker's ``counter``-th request.  Tags wrap after
    (max_tag - 10) / 3 requests (about 700 million with Open MPI, 10 thousand with the
    smallest MPI allows): a request must complete before that many later ones."""
    return _FIRST_TAG + 3 * (counter % ((max_tag - _FIRST_TAG) // 3))


def header(op: Op, store: int = 0, chunk: int = 0, tag: int = 0, *args: int) -> torch.Tensor:
    fields = np.zeros(HEADER_LEN, dtype=np.int64)
    fields[:4 + len(args)] = (op, store, chunk, tag, *args)
    return torch.from_numpy(fields)


def status(code: Status, payload_len: int = 0) -> torch.Tensor:
    return torch.tensor([int(code), payload_len, 0, 0], dtype=torch.int64)


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
