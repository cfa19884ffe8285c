"""The direct layer's one cross-rank agreement check: whether every member of a direct
group made the same call, told in one small all-reduce.

The members all-reduce the maximum of the call's :class:`~psrt.comm.header.Header` digest
and of its negation: equal results mean equal digests.  Only when they differ are the
headers gathered, so that every member raises the same
:class:`~psrt.errors.CollectiveMismatchError` naming two ranks and what each passed.
Whether calls are checked is the caller's setting; the members compare it on the group's
first collective (:meth:`Agreement.settle`), since a check on some members only would pair
their digest all-reduce with the others' data.  Kept apart from the group
(:class:`psrt.comm.direct.DirectGroup`, which holds one) because it is a protocol of its
own: what a disagreement costs and says, not how the group moves data.

Every method is collective over the group's members; the caller marks the wait.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from psrt.comm.base import Communicator, Persistent, ElementwiseOp
from psrt.comm.header import HEADER_WORDS, Header, Kind
from psrt.errors import CollectiveMismatchError

_KEPT_DIGESTS = 4096  # of calls' (kind, dtype, shape), per group: a model has a few per layer
#: What a member's ``check`` setting means, in errors (``"once"``: see :mod:`psrt.comm.keyed`)
_HOW = {True: "checks that every rank makes the same call", False: "does not",
        "once": "checks each new call once"}


class Agreement:
    """The agreement check of one direct group: ``host`` is the group's own communicator,
    ``ranks[r]`` names its rank r in errors, ``name()`` says what the group is."""

    def __init__(self, host: Communicator, ranks: Sequence[int], name: Callable[[], str]) -> None:
        self._host, self._ranks, self._name = host, ranks, name
        self.settled = False  # whether the members compared their ``check`` setting
        # The all-reduce of a digest and its negation, set up once (one blocking MPI call on
        # a buffer spec made once: about a microsecond, a fresh call several).
        self._reduction: Persistent | None = None
        self._words: memoryview | None = None  # the digest and its negation, as the all-reduce sees them
        self._digests: dict[tuple, int] = {}  # by (kind, dtype, shape, args): see on_call
        self.exchanges = 0  # digest all-reduces run: what checking costs, for tests

    def settle(self, label: str, check: bool) -> None:
        """Compare whether each member checks its calls: an error on every member unless all do
        or none does."""
        theirs = self._host.allgather_object(check)
        if any(value != check for value in theirs):
            checking = next(member for member, value in enumerate(theirs) if value)
            other = next(member for member, value in enumerate(theirs) if value != theirs[checking])
            raise CollectiveMismatchError(
                f"{label} collectives over {self._name()}: rank {self._ranks[checking]} {_HOW[theirs[checking]]} "
                f"but rank {self._ranks[other]} {_HOW[theirs[other]]} (every rank must run with the same setting)")
        self.settled = True

    def on_call(self, kind: Kind, tensor: torch.Tensor, label: str, args: tuple[int, ...] = ()) -> None:
        """:meth:`check` a call of ``kind`` over ``tensor`` (and ``args``: a root), whose header
        is made only should the members disagree: the digest of a (kind, dtype, shape, args)
        is kept (a few per layer), as working it out is most of a small collective's Python."""
        key = (kind, tensor.dtype, tensor.shape, args)
        digest = self._digests.get(key)
        if digest is None:
            digest = Header.of(kind, tensor, args=args).digest()
            if len(self._digests) < _KEPT_DIGESTS:
                self._digests[key] = digest
        if not self.agreed(digest):
            self.disagreement(Header.of(kind, tensor, args=args), label)

    def check(self, header: Header, label: str) -> None:
        """Raise the same :class:`CollectiveMismatchError` on every member unless all passed
        equal headers: one small all-reduce when they did, and a gather of the headers, to
        name what differs, when they did not."""
        if not self.agreed(header.digest()):
            self.disagreement(header, label)

    def rows(self, send: torch.Tensor, send_rows: Sequence[int], label: str) -> list[int]:
        """For an all-to-all: exchange row counts and what one row is (dtype, shape); the rows
        each member sends here.  A member that sends rows of another kind is an error on
        every member, naming both."""
        header = Header(Kind.MESSAGE, 0, send.dtype, send.shape[1:])
        size = self._host.size
        mine = torch.tensor([[rows, *header.words()] for rows in send_rows], dtype=torch.int64)
        theirs = torch.empty_like(mine)
        width = mine.shape[1]
        self._host.alltoallv(mine.view(-1), [width] * size, theirs.view(-1), [width] * size).wait()
        own = header.words()
        for member, words in enumerate(theirs[:, 1:].tolist()):
            if words != own:
                raise CollectiveMismatchError(
                    f"{label} all_to_all over {self._name()}: rank {self._ranks[self._host.rank]} sends "
                    f"{header.describe_rows()} but rank {self._ranks[member]} sends "
                    f"{Header.decode(words).describe_rows()}")
        return theirs[:, 0].tolist()

    def free(self) -> None:
        if self._reduction is not None:
            self._reduction.free()
            self._reduction = None

    def agreed(self, digest: int) -> bool:
        """Whether every member passed ``digest`` (one small all-reduce)."""
        self.exchanges += 1
        if self._reduction is None:  # made on the first check, which every member makes
            extremes = torch.zeros(2, dtype=torch.int64)  # kept alive by the request and the view
            self._reduction = self._host.persistent_allreduce(extremes, ElementwiseOp.MAX)
            self._words = memoryview(extremes.numpy())
        words = self._words
        words[0], words[1] = digest, -digest
        self._reduction.run()
        return words[0] == -words[1]

    def disagreement(self, header: Header, label: str) -> None:
        """Name what differs, after an agreement that failed."""
        size, rank = self._host.size, self._host.rank
        mine = header.encode()
        everyone = torch.empty((size, HEADER_WORDS), dtype=torch.int64)
        self._host.allgatherv(mine, everyone.view(-1), [HEADER_WORDS] * size).wait()
        differing = (everyone != mine).any(dim=1).nonzero().flatten().tolist() or [rank]
        theirs = Header.decode(everyone[differing[0]].tolist())
        raise CollectiveMismatchError(
            f"{label} {Kind(header.kind).name.lower()} over {self._name()}: rank {self._ranks[rank]} has "
            f"{header.describe()} but rank {self._ranks[differing[0]]} has {theirs.describe()}")
