"""A non-blocking MPI operation as psrt's :class:`~psrt.comm.base.Request`, and MPI's failures
as :class:`~psrt.errors.CommunicationError` naming the operation.

Kept apart from :mod:`psrt.comm.mpi` so that what that module's algorithms build on (the
ring's exchanges, :mod:`psrt.comm.paced`) waits for MPI's requests the same way.
"""
from __future__ import annotations

import torch
from mpi4py import MPI

from psrt.comm.base import Request
from psrt.comm.crowding import crowded
from psrt.comm.poll import wait_politely
from psrt.errors import CommunicationError

__all__ = ["MpiRequest", "Translated", "failure"]


def failure(exc: MPI.Exception, what: str) -> CommunicationError:
    return CommunicationError(f"MPI failed during {what}: {exc.Get_error_string()}")


class Translated:
    """Context that turns an MPI failure into a :class:`CommunicationError`.

    The description is formatted only when something failed.  Entering a context costs
    about a microsecond, as much as a small message: the per-message paths (a request's
    test and wait, a persistent start, a blocking allreduce) catch with ``try`` instead.
    """

    __slots__ = ("what", "args")

    def __init__(self, what: str, *args: object) -> None:
        self.what, self.args = what, args

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> None:
        if isinstance(exc, MPI.Exception):
            raise failure(exc, self.what.format(*self.args)) from exc


class MpiRequest(Request):
    """A non-blocking MPI operation, holding its tensors alive until it completes."""

    __slots__ = ("_request", "_what", "_keep")

    def __init__(self, request: MPI.Request, what: str, *keep: torch.Tensor) -> None:
        self._request, self._what, self._keep = request, what, keep

    def test(self) -> bool:
        try:
            return self._request.Test()
        except MPI.Exception as exc:
            raise failure(exc, self._what) from exc

    def wait(self) -> None:
        if crowded():  # MPI's wait spins on the core the ranks awaited need: nap between tests
            wait_politely(self)
            return
        try:
            self._request.Wait()
        except MPI.Exception as exc:
            raise failure(exc, self._what) from exc

    def cancel(self) -> None:
        with Translated(self._what):
            self._request.Cancel()
            self._request.Wait()
