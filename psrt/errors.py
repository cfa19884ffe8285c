"""One exception hierarchy for psrt.

Every error psrt raises derives from :class:`PsrtError`, so a training script
can catch them all in one place.  Each class also derives from the builtin a
Python user would expect (``TypeError`` for a wrong argument type,
``ValueError`` for a bad value, ``RuntimeError`` for a failed collective), so
code written against Horovod or torch.distributed keeps catching what it did.
"""
from __future__ import annotations


class PsrtError(Exception):
    """Base class of every psrt error."""


class NotInitializedError(PsrtError, RuntimeError):
    """A psrt function that needs the runtime was called before ``init()``."""


class ArgumentTypeError(PsrtError, TypeError):
    """A public API call received an argument of the wrong type."""


class InvalidArgumentError(PsrtError, ValueError):
    """A public API call received an argument with an impossible value."""


class InvalidArgumentTypeError(ArgumentTypeError, InvalidArgumentError):
    """An argument holds values of the wrong type where Horovod raises ``ValueError``
    (alltoall splits that are not integers): catchable as ``TypeError`` or ``ValueError``."""


class UnsupportedOperationError(InvalidArgumentError, RuntimeError):
    """A valid op that cannot run on these arguments: Adasum on reducescatter, on integer
    tensors, or on a process set whose size is not a power of two.  A ``ValueError`` (a bad
    argument, raised before any communication) and, as Horovod's error is, a ``RuntimeError``."""


class UnsupportedDeviceError(InvalidArgumentError):
    """A tensor lives on a device no initialised backend can carry."""


class ProcessSetError(InvalidArgumentError):
    """A process set is unknown, malformed, or does not include the caller."""


class CollectiveMismatchError(PsrtError, RuntimeError):
    """Ranks called the same collective with disagreeing arguments.

    Raised on every participating rank, with a message naming the tensor, the
    ranks and the values that differ.
    """


class CommunicationError(PsrtError, RuntimeError):
    """The transport failed while carrying a collective or message."""


class EngineStoppedError(PsrtError, RuntimeError):
    """A collective was submitted or still pending when psrt was shut down on some rank."""


class ParameterServerError(PsrtError, RuntimeError):
    """A parameter server refused or failed a worker's request (the message says which
    server, key and worker), or a consistency mode can no longer make progress."""


class ScheduleError(PsrtError):
    """A pipeline schedule breaks a property every rank relies on: a micro-batch
    missing or repeated, a backward before its forward, a send without its receive,
    or a deadlock.  The message names the rank, the action and what is wrong."""


class HostsUpdatedInterrupt(PsrtError, RuntimeError):
    """Raised by ``state.commit()`` (or ``state.check_host_updates()``) on every rank when
    the elastic launcher found hosts added or removed: the state was just committed, so the
    job stops there and ``psrun`` relaunches it on the new hosts (Horovod's exception of the
    same name; ``skip_sync`` is True when hosts were only added)."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the hosts of this elastic job changed: relaunching at the last commit")
        self.skip_sync = skip_sync


class CheckpointError(PsrtError, RuntimeError):
    """A checkpoint that other ranks failed to write or read: every rank raises together, the
    failing ranks their own error and the others this one, naming each failing rank.  Also
    a ``torch.distributed.checkpoint`` file that does not match the size and sha256
    :class:`psrt.checkpoint.dcp.ChecksummedWriter` recorded, or a checkpoint that records
    none (torch then raises its ``CheckpointException``, holding this error, on every rank)."""


class NothingFitsError(InvalidArgumentError):
    """``psrt plan``: no layout can run the model on these ranks, or none fits the memory per
    rank; the message says why and what would help.  ``smallest`` is the layout needing the
    fewest bytes (None when none can run)."""

    def __init__(self, message: str, smallest: object = None) -> None:
        super().__init__(message)
        self.smallest = smallest


class TimelineError(PsrtError, ValueError):
    """``psrt timeline-summary``: the file is not a psrt timeline, or is damaged beyond what a
    crash leaves."""


class ElasticError(PsrtError, RuntimeError):
    """Elastic state that cannot be committed or restored: a damaged or foreign commit, a
    value that cannot be stored, or a layout that cannot take the commit.  The message names
    the file or attribute and what to do."""


class ParameterReleasedError(PsrtError, RuntimeError):
    """A ZeRO stage-3 parameter was read outside a gather: between its module's forward and
    backward it holds no memory (only its shape and dtype).  The message names the parameter
    and how to gather it (``with opt.gathered_parameters():``)."""
