"""The one protocol through which psrt saves and restores state.

Everything a checkpoint or an elastic commit holds is one of two kinds, told apart by the
methods it has, never by its type (so the code that writes commits imports no strategy):

- :class:`Stateful`: ``state_dict()`` / ``load_state_dict()``, torch's own pair, as
  ``torch.distributed.checkpoint`` and torchtitan's checkpoint manager take it.  One rank
  holds the whole state, or its own part of it: a model, a torch optimizer or
  ``hvd.DistributedOptimizer``, an :class:`~psrt.elastic.ElasticSampler`, the TP RNG
  tracker (:class:`~psrt.tp.RNGStatesTracker`), and a TP x PP stage with its optimizer
  seen whole (:class:`psrt.full_state.FullState`: its ``state_dict()`` is the one process
  would hold, gathered over the grid, so it restores on any grid).
- :class:`ShardedStateful`: a state spread over a process set and too large to gather on
  one rank (ZeRO's shards, the parameter servers' stores).  It writes its own checkpoint
  directory, collectively, with its own commit record, loads one written by any number of
  ranks, and its checkpoint holds the model it trains.

What either returns is tensors and plain data only (numbers, strings, lists, tuples,
dicts): :mod:`psrt.checkpoint.files` writes it as safetensors and JSON, with no pickle.
"""
from __future__ import annotations

from typing import Any, Mapping, Protocol, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    """A state held by one rank, saved and restored as a dictionary."""

    def state_dict(self) -> dict[str, Any]:
        """The state as tensors and plain data."""

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Take back what :meth:`state_dict` returned."""


@runtime_checkable
class ShardedStateful(Protocol):
    """A state sharded over a process set that writes and reads its own checkpoint directory."""

    #: the name of its directory inside an elastic commit (``"zero"``, ``"ps"``)
    checkpoint_name: str

    def save(self, directory: str, extra: dict | None = None) -> None:
        """Write the checkpoint into ``directory`` (the same on every rank), with ``extra``
        (anything JSON can hold: the caller's step or epoch) in its commit record.

        Collective: every rank of the state's process set calls it, in the same order.
        """

    def load(self, directory: str) -> dict | None:
        """Restore the checkpoint in ``directory``, written by any number of ranks (every file
        checked against the commit record before anything changes); returns its ``extra``.

        Collective: every rank of the state's process set calls it, in the same order.
        """

