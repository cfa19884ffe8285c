"""Allreduce checks for a job started with tiny PSRT_RING_THRESHOLD and PSRT_RING_SEGMENT.

With a 64-byte threshold and 64-byte segments, every tensor below goes through
psrt's own ring, and each ring step moves several segments, so the ring's
chunking, segmentation, reducers and folded scaling all meet small, odd sizes.
"""
from __future__ import annotations

import os

import psrt.runtime
import psrt.torch as hvd
from _harness import Checks
from _reference import DTYPES, check_reduced, ops_for, samples

RING_BYTES = 64
# At least 64 bytes even for 1-byte dtypes, so every dtype takes the ring.
SHAPE = (9, 10)
# Element counts around multiples of the segment (64 bytes) and of the rank count.
SIZES = {"float32": (16, 17, 33, 63, 65, 129, 1001), "float64": (8, 9, 17, 33, 1001),
         "float16": (16, 17, 65, 257), "int8": (64, 65, 257), "bool": (64, 65, 257)}


def config_applied(key: str) -> None:
    """psrun forwarded PSRT_* to every rank, and psrt read them."""
    config = psrt.runtime.current().config
    seen = (config.ring_threshold, config.ring_segment)
    env = (os.environ.get("PSRT_RING_THRESHOLD"), os.environ.get("PSRT_RING_SEGMENT"))
    assert seen == (RING_BYTES, RING_BYTES), (
        f"{key}: ring_threshold/ring_segment = {seen} with PSRT_RING_* = {env}; expected "
        f"{RING_BYTES} bytes each")


def ring_allreduce(key: str, dtype_name: str, op: str, shape, scaled: bool = False,
                   in_place: bool = False, transposed: bool = False) -> None:
    rank, size = hvd.rank(), hvd.size()
    dtype = DTYPES[dtype_name]
    pre, post = ((0.5, 4.0) if dtype.is_floating_point else (2, 3)) if scaled else (1.0, 1.0)
    inputs = samples(key, size, dtype, shape, op=op, factor=int(pre * post))
    if transposed:
        inputs = [t.t() for t in inputs]
    mine = inputs[rank].clone() if not transposed else inputs[rank].t().clone().t()
    if in_place:
        got = hvd.allreduce_(mine, op=getattr(hvd, op), prescale_factor=pre,
                             postscale_factor=post, name=key)
        assert got is mine, f"{key}: allreduce_ returned a new tensor"
    else:
        got = hvd.allreduce(mine, op=getattr(hvd, op), prescale_factor=pre,
                            postscale_factor=post, name=key)
    check_reduced(got, inputs, op, key, pre=pre, post=post)


def ring_grouped_allreduce(key: str) -> None:
    rank, size = hvd.rank(), hvd.size()
    group = [samples(f"{key}/{i}", size, DTYPES[d], shape)
             for i, (d, shape) in enumerate((("float32", (7, 3)), ("float64", (11,)),
                                             ("float32", (13,)), ("int16", (40,))))]
    got = hvd.grouped_allreduce([g[rank] for g in group], op=hvd.Average, name=key)
    for i, inputs in enumerate(group):
        check_reduced(got[i], inputs, "Average", f"{key} tensor {i}")


def add_checks(checks: Checks) -> None:
    checks.add("ring/config_applied", config_applied)
    for d in DTYPES:
        for op in ops_for(d):
            name = f"ring_allreduce/{d}/{op}"
            checks.add(name, ring_allreduce, d, op, SHAPE)
    for d in ("float32", "float64", "float16", "int32"):
        name = f"ring_allreduce_scaled/{d}/Average"
        checks.add(name, ring_allreduce, d, "Average", SHAPE, True)
    checks.add("ring_allreduce_inplace_noncontiguous/float32", ring_allreduce, "float32", "Sum",
               SHAPE, False,
               True, True)
    checks.add("ring_grouped_allreduce/Average", ring_grouped_allreduce)
    for d, counts in SIZES.items():
        op = "Max" if d == "bool" else "Sum"
        for count in counts:
            name = f"ring_allreduce_sizes/{d}/{count}"
            checks.add(name, ring_allreduce, d, op, (count,))
