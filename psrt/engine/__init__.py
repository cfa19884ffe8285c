"""Horovod-style background engine: named asynchronous collectives, negotiated across
ranks, fused, cached, checked for mismatches and stalls, and traced on a timeline."""
from psrt.engine.engine import Engine
from psrt.engine.work import Announcement, Descriptor, Express, Piece, Reduction, Work

__all__ = ["Announcement", "Descriptor", "Engine", "Express", "Piece", "Reduction", "Work"]
