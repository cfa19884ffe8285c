"""One step of a pipeline schedule on one rank: the actions, the activations held
between a micro-batch's forward and backward, the messages in flight, and the
record of what the step did.

On a device (CUDA) nothing here makes the host wait for it: messages are device messages
issued round by round (:class:`psrt.pp.p2p.RoundIssuer`), the compute stream waits for a
received tensor and for a sent one before its memory is freed, and the loss is summed on the
device (the caller reads it when it needs the value)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from psrt.comm.base import Request
from psrt.pp.p2p import BACKWARD_TAG, FORWARD_TAG, TIED_GRADIENT_TAG, RoundIssuer, message_id
from psrt.pp.schedule import Action, Op
from psrt.pp.simulate import Event
from psrt.pp.split_backward import WeightPass, backward_input
from psrt.pp.tied import Tie

if TYPE_CHECKING:
    from psrt.pp.executor import Pipeline

Key = tuple[int, int]  # (micro-batch, chunk)


@dataclass
class StepProfile:
    """What one step did on this rank: compute events (seconds from the step start), wall
    time, the most micro-batches held at once, and the most activation bytes held at once
    (what autograd saved for backward, the stage's inputs and outputs, and messages not
    yet delivered)."""

    events: list[Event] = field(default_factory=list)
    wall: float = 0.0
    in_flight: int = 0
    peak_activation_bytes: int = 0

    @property
    def compute(self) -> float:
        return sum(e.end - e.start for e in self.events)

    @property
    def idle(self) -> float:
        return max(0.0, self.wall - self.compute)


@dataclass
class _Held:
    """A micro-batch between its forward and its (last) backward."""

    input: torch.Tensor
    output: torch.Tensor
    bytes: int
    send: Request | None = None
    weight_pass: WeightPass | None = None  # a split backward's weight half, until it runs


class StepRun:
    """Executes this rank's actions for one step."""

    def __init__(self, pipeline: Pipeline, inputs: list[torch.Tensor] | None,
                 targets: list[torch.Tensor] | None) -> None:
        self.p, self.inputs, self.targets = pipeline, inputs, targets
        self.stage, self.link = pipeline.stage, pipeline.link
        self.received: dict[Key, torch.Tensor] = {}  # inputs from the previous stage, until their gradient is sent
        self.held: dict[Key, _Held] = {}
        self.grads: dict[Key, torch.Tensor] = {}
        self.leaves: dict[int, list[torch.Tensor]] = {}  # per chunk, for split backwards
        self.pending: list[tuple[Request, int]] = []  # sends whose payload is held by nothing else
        self.profile = StepProfile()
        self.live_bytes = 0
        self.device = next(self.stage.parameters(), torch.empty(0)).device
        self.loss = torch.zeros(1, dtype=torch.float64, device=self.device)
        self.messages = self.link.on_device(self.device)  # None on the host: messages over MPI
        self.rounds = None if self.messages is None else RoundIssuer(self.messages, pipeline._message_rounds())
        self.parameter_storage = {p.untyped_storage().data_ptr() for p in self.stage.parameters()}

    def execute(self) -> torch.Tensor:
        self.start = time.perf_counter()
        try:
            for position, action in enumerate(self.p.actions):
                for tie in self.p.tie_points.get(position, ()):
                    self._take_tied_gradients(tie)
                self._do(action)
                self._release_delivered()
            if self.rounds is not None and not self.rounds.finished:
                raise RuntimeError("a pipeline step ended with device messages never issued")
            self._send_tied_gradients()
            with self.p._waiting("the delivery of its last messages"):
                for request, _ in self.pending:
                    request.wait()
        finally:
            self.held.clear()
            self.pending.clear()
        if self.p.loss_reduction == "mean":
            self.loss /= self.p.microbatches
        self.profile.wall = time.perf_counter() - self.start
        return self.loss

    def _take_tied_gradients(self, tie: Tie) -> None:
        """The owner of a shared parameter adds its copies' gradients, before the backward that
        accumulates its own last micro-batch (so a DP hook on that accumulation sees the sum)."""
        param = tie.tensor
        for peer in tie.peers:
            grad = self.link.recv_tied(peer, TIED_GRADIENT_TAG, tie.index, param)
            param.grad = grad if param.grad is None else param.grad.add_(grad)

    def _send_tied_gradients(self) -> None:
        """A copy's gradient of this step goes to its owner (zeros if it got none)."""
        for tie in self.stage.ties:
            if tie.is_owner:
                continue
            copy = tie.tensor
            grad = copy.grad if copy.grad is not None else torch.zeros_like(copy)
            copy.grad = None
            self._track(self.link.send(grad, tie.owner, TIED_GRADIENT_TAG, tie.index),
                        grad.numel() * grad.element_size())

    def _peer(self, chunk: int, step: int) -> tuple[int, int]:
        """(PP set rank, virtual stage) of the stage ``step`` away from this chunk's."""
        stages = self.stage.stages
        virtual = chunk * stages + self.stage.rank
        return (virtual + step) % stages, virtual

    def _do(self, a: Action) -> None:
        key = (a.microbatch, a.chunk)
        if a.op is Op.RECV_FORWARD:
            source, virtual = self._peer(a.chunk, -1)
            x = self._recv(a, source, FORWARD_TAG, message_id(a.microbatch, virtual - 1))
            self.received[key] = x.requires_grad_()
        elif a.op is Op.FORWARD:
            self._timed(a, self._forward, a, key)
        elif a.op is Op.SEND_FORWARD:
            dest, virtual = self._peer(a.chunk, +1)
            held = self.held[key]
            held.send = self._send(a, held.output, dest, FORWARD_TAG, message_id(a.microbatch, virtual))
        elif a.op is Op.RECV_BACKWARD:
            source, virtual = self._peer(a.chunk, +1)
            self.grads[key] = self._recv(a, source, BACKWARD_TAG, message_id(a.microbatch, virtual + 1),
                                         like=self.held[key].output)
        elif a.op is Op.BACKWARD:
            self._timed(a, self._backward, a, key)
        elif a.op is Op.BACKWARD_INPUT:
            self._timed(a, self._backward_input, a, key)
        elif a.op is Op.BACKWARD_WEIGHT:
            self._timed(a, self._backward_weight, a, key)
        else:  # SEND_BACKWARD
            dest, virtual = self._peer(a.chunk, -1)
            x = self.received.pop(key)
            grad = x.grad if x.grad is not None else torch.zeros_like(x)  # the stage did not use its input
            request = self._send(a, grad, dest, BACKWARD_TAG, message_id(a.microbatch, virtual))
            self._track(request, grad.numel() * grad.element_size())

    def _send(self, a: Action, tensor: torch.Tensor, dest: int, tag: int, ident: int) -> Request:
        if self.messages is None:
            return self.link.send(tensor, dest, tag, ident)
        return self.rounds.post(a, self.link.post_send(self.messages, tensor, dest, tag, ident))

    def _recv(self, a: Action, source: int, tag: int, ident: int, like: torch.Tensor | None = None) -> torch.Tensor:
        """The message, usable by the compute that follows (on a device: its stream has waited)."""
        if self.messages is None:
            return self.link.recv(source, tag, ident, self.device, like=like)
        tensor, message = self.link.post_recv(self.messages, source, tag, ident, self.device, like=like)
        self.rounds.post(a, message).wait()
        return tensor

    def _timed(self, a: Action, work: Callable, *args) -> None:
        begin = time.perf_counter()
        work(*args)
        end = time.perf_counter()
        self.profile.events.append(Event(self.stage.rank, a.op, a.microbatch, a.chunk,
                                         begin - self.start, end - self.start))

    def _forward(self, a: Action, key: Key) -> None:
        x = self.inputs[a.microbatch] if self.stage.is_first(a.chunk) else self.received[key]
        saved, kept = _SavedBytes(self.parameter_storage), []
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            y = self.stage.run_chunk(a.chunk, x, kept)
            if self.stage.is_last(a.chunk):
                loss = self.p.loss_fn(y, self.targets[a.microbatch])
                self.loss += loss.detach().double()
                y = loss / self.p.microbatches if self.p.loss_reduction == "mean" else loss
        # the received input and the output are held too, whether or not autograd saved them
        # (and, recomputing, each block's input); the first stage's input is the caller's batch
        for tensor in ([t for t in kept if t is not x] + [y] if self.stage.is_first(a.chunk) else [x, *kept, y]):
            saved.pack(tensor)
        self.held[key] = _Held(x, y, saved.bytes)
        self.live_bytes += saved.bytes
        self.profile.peak_activation_bytes = max(self.profile.peak_activation_bytes, self.live_bytes)
        self.profile.in_flight = max(self.profile.in_flight, len(self.held))

    def _backward(self, a: Action, key: Key) -> None:
        held = self.held[key]
        if held.output.requires_grad:  # else nothing before this point needs a gradient
            held.output.backward(self._output_grad(a, key))
        self._release(key)

    def _backward_input(self, a: Action, key: Key) -> None:
        """The input half of a split backward; the micro-batch stays held until its weight half."""
        held = self.held[key]
        if held.output.requires_grad:
            held.weight_pass = backward_input(held.output, self._output_grad(a, key), held.input,
                                              self._leaves(a.chunk))

    def _leaves(self, chunk: int) -> list[torch.Tensor]:
        """What a chunk's weight halves differentiate: its parameters and this rank's copies of
        parameters owned by another stage (found once per chunk and step)."""
        if chunk not in self.leaves:
            self.leaves[chunk] = [p for index in self.stage.chunk_ranges[chunk]
                                  for p in self.stage._modules[str(index)].parameters()]
            self.leaves[chunk] += [tie.tensor for tie in self.stage.ties if not tie.is_owner]
        return self.leaves[chunk]

    def _backward_weight(self, a: Action, key: Key) -> None:
        weight_pass = self.held[key].weight_pass
        if weight_pass is not None:
            weight_pass.run()
        self._release(key)

    def _output_grad(self, a: Action, key: Key) -> torch.Tensor | None:
        """The gradient flowing into this chunk's output: none for the loss, else the one received."""
        grad = self.grads.pop(key, None)
        return None if self.stage.is_last(a.chunk) else grad

    def _release(self, key: Key) -> None:
        """The micro-batch's backward is complete: drop what it held."""
        held = self.held.pop(key)
        self.grads.pop(key, None)
        self.live_bytes -= held.bytes
        if held.send is not None:
            if not held.send.test():
                self._track(held.send, held.output.numel() * held.output.element_size())
            elif self.messages is not None:
                held.send.wait()  # on a device: a stream wait, so the memory is freed after the transfer

    def _track(self, request: Request, size: int) -> None:
        """Keep a send's payload (and count it) until the message is delivered."""
        self.pending.append((request, size))
        self.live_bytes += size
        self.profile.peak_activation_bytes = max(self.profile.peak_activation_bytes, self.live_bytes)

    def _release_delivered(self) -> None:
        still, on_device = [], self.messages is not None
        for request, size in self.pending:
            if request.test():
                if on_device:
                    request.wait()  # a stream wait, so the payload's memory is freed after the transfer
                self.live_bytes -= size
            else:
                still.append((request, size))
        self.pending = still


class _SavedBytes:
    """Counts the bytes of the tensors autograd saves during a forward, each (address, size)
    once, leaving out parameters and views of them (``parameter_storage``: the data
    pointers of their storages)."""

    def __init__(self, parameter_storage: set[int]) -> None:
        self.bytes = 0
        self._parameters = parameter_storage
        self._seen: set[tuple[int, int]] = set()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        view = (tensor.data_ptr(), tensor.numel())
        if view not in self._seen and tensor.untyped_storage().data_ptr() not in self._parameters:
            self._seen.add(view)
            self.bytes += tensor.numel() * tensor.element_size()
        return tensor
