"""Calls agreed on once: each (collective, dtype, shape, op) the members of a direct group
have agreed on gets a communicator of its own, and later calls of it run there unchecked.

Checking every call (:mod:`psrt.comm.agreement`) costs one small all-reduce before each
collective.  It cannot simply be skipped for calls seen before: a rank whose call is new
would run the check while the others, whose call is known, run their data collective,
and MPI would pair the two (or two known calls of different sizes) into a hang or a
wrong result.  No rank can tell, from what it alone knows, that another rank's call
differs from its own, so in this mode a mismatch is allowed to take different paths, and
is made safe where the paths run:

* The **channel** of a call is the communicator its collectives run on: key ``k``'s own
  communicator for a call whose key the members agreed on before (path ``k``, numbered
  in the order they were agreed), the group's host communicator for any other (path
  :data:`CHECK`: the agreement check, then, once agreed, its new channel).
* **Every member holds the same table** of keys and channels.  By induction over the
  group's collectives: the table starts empty on every member; a key is added only right
  after an agreement check that every member passed together (one collective over all of
  them, which compares the keys themselves), by a communicator split that every member
  then makes, so every member adds the same key at the same point, and nothing else
  changes it.
* **Equal calls take equal paths.**  A call's path is a function of its key and the table
  alone (and of what every member's equal call shares: device, emptiness), so members
  making the same call take the same path: all run the check, or all run the data on the
  same channel.  The decision to check is never one member's alone.
* **Unequal calls never meet.**  On key ``k``'s channel only calls of key ``k`` ever run
  (the same size, dtype and op on every member), and the host communicator carries the
  agreement, which compares the calls themselves.  So a collective that completes had
  members making the same call; a check can never be paired with a data collective, nor
  data with data of another size.  Members whose calls differ take different paths that
  cannot complete at all: every member blocks, on its own path, at the same collective
  of the group (all previous ones completed on every member), and no buffer is paired
  with another member's, so there is no wrong result.
* Such a block is a deadlock by :mod:`psrt.comm.deadlock`'s rule (each call's identity
  names its path), which the watchdog finds within seconds; :mod:`psrt.comm.breaker` then
  ends it: each member's blocked call is marked failed with one message naming the ranks,
  their calls and call sites, and each member joins the other paths' collectives with
  buffers of their keys, so every member leaves its call and raises the same
  :class:`~psrt.errors.CollectiveMismatchError`.  The channels are left as consistent as
  before (each ran one whole collective), so the group stays usable.

Calls that take the checked path every time: a device's tensors (whatever
:func:`psrt.comm.streams.api` covers: a communicator per key is far too costly for NCCL,
and a blocked stream cannot be joined from the host), empty tensors
(the transport skips them, so a mismatch would not block) and, decided by the group, calls
off the main thread (deadlock detection watches main threads).  Past
:data:`MAX_CHANNELS` keys, a new key is checked on every call and its data runs on the
host communicator (path :data:`CHECKED`; never part of a mismatch: every member passed the
check together).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from psrt.comm import streams
from psrt.comm.agreement import Agreement
from psrt.comm.base import Communicator, ElementwiseOp
from psrt.comm.deadlock import DIRECT
from psrt.comm.header import OP_NAMES, Header, Kind
from psrt.comm.ranks import rank_ranges
from psrt.comm.waits import Wait
from psrt.errors import CollectiveMismatchError

#: The ``check`` setting of a direct group's collectives that checks each key once
ONCE = "once"
#: The path of a call being checked (its key is new, or its tensor is on a GPU or empty)
CHECK = -1
#: The path of a call's data after its check, when no channel was left for its key
CHECKED = -2
MAX_CHANNELS = 16  # per group (two MPI communicators each): a model makes a few keys, not one per layer
_OPS = tuple(ElementwiseOp)
assert tuple(op.value for op in _OPS) == OP_NAMES  # a header names an op by its place here
#: The header args naming a reduction's op (a key must say it: MPI pairs only equal ops)
OP_ARGS = {op: (i,) for i, op in enumerate(_OPS)}


class KnownCalls:
    """The keys one direct group's members agreed on, each with its channel; see the
    module docstring.  ``host`` is the group's communicator, ``agreement`` its check,
    ``ident`` the group as every member names it, ``name()`` what it is in errors."""

    def __init__(self, host: Communicator, agreement: Agreement, ident: str, name: Callable[[], str],
                 capacity: int = MAX_CHANNELS) -> None:
        self._host, self._agreement, self.ident, self._name = host, agreement, ident, name
        self._capacity = capacity
        self._paths: dict[tuple, int] = {}
        self.keys: list[tuple] = []
        self.channels: list[Communicator] = []
        self.label = ""  # who checks calls here ("tensor-parallel"), for errors
        # set by the breaker while a mismatch is ended: (message, the event set once this
        # member has joined the other paths)
        self.broken: tuple[str, threading.Event] | None = None
        self.consumed: Callable[[], None] = lambda: None  # told once a broken call raised

    def route(self, kind: Kind, tensor: torch.Tensor, label: str, args: tuple[int, ...],
              mark: Wait) -> Communicator | None:
        """The communicator that carries this call's data (None: the group's transport for
        the tensor's device), after checking the call where its key is new (collective over
        the members; inside ``mark``, whose identity this sets to the call's path)."""
        key = (kind, tensor.dtype, tensor.shape, args)
        n = mark.ident[2]
        path = self._paths.get(key)
        # (a channel is never given to an empty shape, nor to a device's tensor; that check
        # keeps a CUDA tensor off a host call's channel)
        if path is not None and not tensor.is_cuda:
            mark.ident = (DIRECT, self.ident, n, path)
            return self.channels[path]
        header = Header(kind, 0, tensor.dtype, tensor.shape, args)
        mark.ident = (DIRECT, self.ident, n, CHECK, ",".join(map(str, header.words())))
        self.label = label
        agreed = self._agreement.agreed(header.digest())
        self.after()
        if not agreed:
            self._agreement.disagreement(header, label)
        if not tensor.numel() or streams.api().covers(tensor.device):
            return None
        if path is None and len(self.keys) < self._capacity:
            path = self._add(key)
        mark.ident = (DIRECT, self.ident, n, CHECKED if path is None else path)
        return self._host if path is None else self.channels[path]

    def after(self) -> None:
        """Raise the mismatch the breaker found, if this member's call was one (once it has
        joined the other members' paths, so that none is left blocked)."""
        broken = self.broken
        if broken is not None:
            message, joined = broken
            joined.wait()
            self.broken = None
            self.consumed()
            raise CollectiveMismatchError(message)

    def _add(self, key: tuple) -> int:
        """Give a key every member just agreed on its channel (collective over the host)."""
        channel = self._host.split(0, self._host.rank)
        self._paths[key] = len(self.keys)
        self.keys.append(key)
        self.channels.append(channel)
        return self._paths[key]

    # -- for the breaker -----------------------------------------------------------------
    def describe(self, path: int, words: str = "") -> str:
        """What a call on ``path`` is (a call being checked says so in ``words``)."""
        if path == CHECK:
            return Header.decode([int(w) for w in words.split(",")]).describe()
        kind, dtype, shape, args = self.keys[path]
        return Header(kind, 0, dtype, shape, args).describe()

    def mismatch(self, calls: Sequence[tuple[int, int, str, str]]) -> str:
        """The one message every member raises: ``calls`` are (rank, path, words, call site)."""
        described: dict[str, list[tuple[int, str]]] = {}
        for rank, path, words, site in sorted(calls):
            described.setdefault(self.describe(path, words), []).append((rank, site))
        parts = []
        for what, ranks in described.items():
            sites = sorted({site for _, site in ranks if site})
            many = len(ranks) > 1
            parts.append(f"rank{'s' if many else ''} {rank_ranges(r for r, _ in ranks)} {'have' if many else 'has'} "
                         f"{what}" + (f" (called at {', '.join(sites)})" if sites else ""))
        calls_text = ", ".join(parts[:-1]) + " but " + parts[-1] if len(parts) > 1 else parts[0]
        return (f"{self.label or 'direct'} collectives over {self._name()}: {calls_text} (a call agreed on before "
                "is not checked again: the ranks were found blocked on the channels of different calls)")

    def join(self, path: int) -> None:
        """Take part in the collective that the members blocked on ``path`` wait in, with
        buffers of that path's key (on the breaker's thread)."""
        if path == CHECK:
            self._agreement.agreed(0)
            return
        kind, dtype, shape, args = self.keys[path]
        channel, size = self.channels[path], self._host.size
        numel = torch.Size(shape).numel()
        if kind == Kind.ALL_REDUCE:
            channel.allreduce(torch.zeros(shape, dtype=dtype), _OPS[args[0]])
        elif kind == Kind.ALL_GATHER:
            channel.allgatherv(torch.zeros(numel, dtype=dtype), torch.zeros(numel * size, dtype=dtype),
                               [numel] * size).wait()
        else:
            channel.reduce_scatter(torch.zeros(numel, dtype=dtype), torch.zeros(numel // size, dtype=dtype),
                                   [numel // size] * size, _OPS[args[0]]).wait()

    def free(self) -> None:
        for channel in self.channels:
            channel.free()
        self.channels.clear()
