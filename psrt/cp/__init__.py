"""Context parallelism: a sequence split over a CP process set (zig-zag placed), with ring
attention passing key/value blocks around the set."""
from psrt.cp.ring import ring_attention, stats
from psrt.cp.zigzag import check_length, positions, split, unsplit

__all__ = ["check_length", "positions", "ring_attention", "split", "stats", "unsplit"]
