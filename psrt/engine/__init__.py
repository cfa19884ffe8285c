"""Horovod-style background engine: named asynchronous collectives, negotiated across
ranks, fused, cached, checked for mismatches and stalls, and traced on a timeline.

Strategies reach it through a :class:`Channel` (:mod:`psrt.engine.channel`)."""
from psrt.engine.channel import Channel, PreparedAllreduce
from psrt.engine.engine import Engine
from psrt.engine.work import Announcement, Descriptor, Piece, Reduction, Work

__all__ = ["Announcement", "Channel", "Descriptor", "Engine", "Piece", "PreparedAllreduce", "Reduction", "Work"]
