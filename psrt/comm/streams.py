"""Where CUDA communication runs, and how it is ordered with compute without the host waiting.

Every use psrt makes of CUDA streams and events goes through :func:`api`, so that one
place decides which memory is a device's and tests can put a fake in its stead (streams,
events and NCCL calls recorded, no GPU: ``tests/fake_device.py``).

The rule, as in ``ProcessGroupNCCL`` and FSDP2:

* a collective on a device runs on a communication stream of that device
  (:class:`DeviceStreams`: one for all-gathers, one for reductions, one for point-to-point),
  after that stream has waited for a *ready* event recorded on its producer's stream when
  the work was submitted;
* a *done* event is recorded after it; whoever consumes the result makes its own current
  stream wait for that event, never the host;
* the tensors a collective reads or writes stay referenced by its work until the consumer
  has waited, so the caching allocator cannot hand their memory to another kernel early.

The host waits for the GPU only where it needs a value: each such place calls
:meth:`CudaApi.host_wait` with a reason (docs/concepts/gpu-streams.md lists them).
"""
from __future__ import annotations

import contextlib
import os
import socket
from typing import Iterator

import torch


class CudaApi:
    """The CUDA stream and event operations psrt uses (torch.cuda's)."""

    def available(self) -> bool:
        return torch.cuda.is_available()

    def covers(self, device: torch.device) -> bool:
        """Whether ``device``'s memory is a GPU's (communication goes through streams)."""
        return device.type == "cuda"

    def identity(self, device: torch.device) -> tuple[str, str]:
        """What tells ``device`` apart from every other device of the job: the host name and
        the device's UUID (the index within ``CUDA_VISIBLE_DEVICES`` where torch reports none)."""
        uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
        if uuid is None:
            uuid = f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')}#{device.index}"
        return socket.gethostname(), str(uuid)

    def index(self, device: torch.device) -> int:
        return torch.cuda.current_device() if device.index is None else device.index

    def current(self, device: torch.device):
        """The calling thread's current stream on ``device``."""
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device):
        """A high-priority stream, as ``ProcessGroupNCCL`` makes its own."""
        return torch.cuda.Stream(device, priority=-1)

    def record(self, stream):
        """An event marking what ``stream`` has been given so far."""
        return stream.record_event()

    def wait(self, stream, event) -> None:
        """Make ``stream`` wait for ``event`` (the host goes on)."""
        stream.wait_event(event)

    def query(self, event) -> bool:
        return event.query()

    def using(self, stream) -> contextlib.AbstractContextManager:
        """Make ``stream`` the calling thread's current stream for a block."""
        return torch.cuda.stream(stream)

    def on_device(self, device: torch.device) -> contextlib.AbstractContextManager:
        return torch.cuda.device(device)

    def host_wait(self, event, why: str) -> None:
        """Block the host until ``event`` has fired: only where the host needs a value (``why``
        says which, for the docs' list and for the fake's record)."""
        event.synchronize()

    def host_wait_stream(self, stream, why: str) -> None:
        """Block the host until ``stream`` has finished its work (see :meth:`host_wait`)."""
        stream.synchronize()


_api: CudaApi = CudaApi()


def api() -> CudaApi:
    """The stream and event operations in use (torch.cuda's unless a test installed a fake)."""
    return _api


@contextlib.contextmanager
def installed(replacement: CudaApi) -> Iterator[CudaApi]:
    """Use ``replacement`` instead of torch.cuda's operations for a block (tests' fakes)."""
    global _api
    previous, _api = _api, replacement
    try:
        yield replacement
    finally:
        _api = previous


class DeviceStreams:
    """One device's communication streams, made once per device and shared by its
    communicators: collectives of one kind run in order on one stream, so all-gathers
    (ZeRO-3's prefetches) never queue behind reductions, nor pipeline messages behind
    either."""

    __slots__ = ("device", "gather", "reduce", "p2p")

    def __init__(self, device: torch.device) -> None:
        cuda = api()
        self.device = device
        self.gather = cuda.new_stream(device)
        self.reduce = cuda.new_stream(device)
        self.p2p = cuda.new_stream(device)

    def for_collective(self, collective: str):
        """The stream a collective named ``collective`` (an announcement's) runs on."""
        if collective.startswith("allgather"):
            return self.gather
        if collective in ("send", "recv", "sendrecv", "alltoall"):
            return self.p2p
        return self.reduce


_streams: dict[tuple[CudaApi, int], DeviceStreams] = {}


def device_streams(device: torch.device) -> DeviceStreams:
    """``device``'s communication streams (made on first use)."""
    cuda = api()
    key = (cuda, cuda.index(device))
    streams = _streams.get(key)
    if streams is None:
        streams = _streams[key] = DeviceStreams(device)
    return streams
