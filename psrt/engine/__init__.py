"""Horovod-style background engine: named asynchronous collectives, negotiated across
ranks, fused, cached, checked for mismatches and stalls, and traced on a timeline.

Strategies reach it through a :class:`Channel` (:mod:`psrt.engine.channel`)."""
from psrt.engine.channel import Channel, PreparedAllreduce
from psrt.engine.engine import Engine
from psrt.engine.work import Announcement, BufferSpec, Descriptor, Reduction, Work

__all__ = ["Announcement", "BufferSpec", "Channel", "Descriptor", "Engine", "PreparedAllreduce", "Reduction", "Work"]
