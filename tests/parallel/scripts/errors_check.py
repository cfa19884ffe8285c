"""Argument errors and cross-rank mismatches, in one job.

Run on every rank (``psrun -np N python errors_check.py``); rank 0 prints one
JSON line per check (see ``_harness``).

Argument errors ("local" checks) must be raised on the calling rank before any
communication, so only one rank (it changes from check to check) makes the bad
call while the others make none; then every rank runs a collective that must
still line up.  Had the bad call sent anything, that collective would be
matched with it and fail or hang.

Mismatches ("mismatch" checks): every rank calls the same collective with
arguments that differ by rank; every rank must raise CollectiveMismatchError
naming the tensor, the field and each rank's value, and the next collective
must work.
"""
from __future__ import annotations

import re
import time

import numpy as np
import torch

import psrt
import psrt.torch as hvd

import _harness
from _reference import check_reduced, expect_raises, sample

TypeErr, ValueErr = psrt.ArgumentTypeError, psrt.InvalidArgumentError
Device, SetErr = psrt.UnsupportedDeviceError, psrt.ProcessSetError


def _then_in_step(key: str) -> None:
    """A collective every rank runs after the check: it must line up across ranks."""
    rank, size = hvd.rank(), hvd.size()
    inputs = [sample(key + "/after", r, torch.int64, (3,)) for r in range(size)]
    check_reduced(hvd.allreduce(inputs[rank], op=hvd.Sum, name=key + "/after"), inputs, "Sum",
                  key + ": the collective after it")


def local_error(key: str, caller: int, kind: type, call, fragments: tuple[str, ...]) -> None:
    if hvd.rank() == caller % hvd.size():
        expect_raises(kind, call, *fragments, what=key)
    _then_in_step(key)


def _local_cases(size: int) -> list[tuple[str, type, object, tuple[str, ...]]]:
    """(name, exception, call, fragments its message must contain)."""
    t = torch.ones(2 * size, 3)
    meta = torch.empty(2 * size, device="meta")
    complex_ = torch.ones(2 * size, dtype=torch.complex64)
    flag = torch.ones(4, dtype=torch.bool)
    unregistered = hvd.ProcessSet([0])
    cases = [
        ("type/allreduce_list", TypeErr, lambda: hvd.allreduce([1.0, 2.0]),
         ("torch.Tensor", "list")),
        ("type/allreduce_numpy", TypeErr, lambda: hvd.allreduce(np.ones(2)),
         ("torch.Tensor", "ndarray")),
        ("type/allreduce_inplace_float", TypeErr, lambda: hvd.allreduce_(3.0), ("torch.Tensor",)),
        ("type/allreduce_async_none", TypeErr, lambda: hvd.allreduce_async(None),
         ("torch.Tensor",)),
        ("type/grouped_allreduce_tensor_not_list", TypeErr, lambda: hvd.grouped_allreduce(t),
         ("list",)),
        ("type/grouped_allreduce_member_not_tensor", TypeErr,
         lambda: hvd.grouped_allreduce([t, 3]), ("tensors[1]",)),
        ("value/grouped_allreduce_empty_list", ValueErr, lambda: hvd.grouped_allreduce([]), ()),
        ("type/allgather_list", TypeErr, lambda: hvd.allgather([1, 2]), ("torch.Tensor",)),
        ("type/broadcast_list", TypeErr, lambda: hvd.broadcast([1], root_rank=0),
         ("torch.Tensor",)),
        ("type/alltoall_list", TypeErr, lambda: hvd.alltoall([1, 2]), ("torch.Tensor",)),
        ("type/reducescatter_list", TypeErr, lambda: hvd.reducescatter([1, 2]), ("torch.Tensor",)),
        ("type/op_string", TypeErr, lambda: hvd.allreduce(t, op="sum"), ("op", "'sum'")),
        ("type/op_float", TypeErr, lambda: hvd.allreduce(t, op=1.0), ("op",)),
        ("type/average_not_bool", TypeErr, lambda: hvd.allreduce(t, average="yes"), ("average",)),
        ("type/prescale_string", TypeErr, lambda: hvd.allreduce(t, prescale_factor="2"),
         ("prescale_factor",)),
        ("type/postscale_none", TypeErr, lambda: hvd.allreduce(t, postscale_factor=None),
         ("postscale_factor",)),
        ("type/name_int", TypeErr, lambda: hvd.allreduce(t, name=5), ("name",)),
        ("type/broadcast_root_float", TypeErr, lambda: hvd.broadcast(t, root_rank=0.0),
         ("root_rank", "0.0")),
        ("type/broadcast_root_string", TypeErr, lambda: hvd.broadcast_(t, root_rank="0"),
         ("root_rank",)),
        ("value/op_unknown", ValueErr, lambda: hvd.allreduce(t, op=99), ("99",)),
        ("value/op_adasum_int", ValueErr, lambda: hvd.allreduce(t.long(), op=hvd.Adasum),
         ("Adasum", "floating-point", "int64")),
        ("value/grouped_op_adasum_int", ValueErr,
         lambda: hvd.grouped_allreduce([t, t.int()], op=hvd.Adasum), ("Adasum", "int32")),
        ("value/reducescatter_op_adasum", ValueErr, lambda: hvd.reducescatter(t, op=hvd.Adasum),
         ("Sum and Average", "Adasum")),
        ("value/reducescatter_op_unknown", ValueErr, lambda: hvd.reducescatter(t, op=99), ("99",)),
        ("value/reducescatter_op_min", ValueErr, lambda: hvd.reducescatter(t, op=hvd.Min),
         ("Sum and Average", "Min")),
        ("value/op_and_average", ValueErr, lambda: hvd.allreduce(t, op=hvd.Sum, average=True),
         ("average",)),
        ("value/broadcast_root_out_of_range", ValueErr,
         lambda: hvd.broadcast(t, root_rank=size), ("root_rank", str(size))),
        ("value/broadcast_root_negative", ValueErr, lambda: hvd.broadcast(t, root_rank=-1),
         ("root_rank", "-1")),
        ("value/broadcast_inplace_root_out_of_range", ValueErr,
         lambda: hvd.broadcast_(t, root_rank=size + 3), ("root_rank", str(size + 3))),
        ("value/broadcast_async_root_out_of_range", ValueErr,
         lambda: hvd.broadcast_async(t, root_rank=size), ("root_rank",)),
        ("dtype/allreduce_sparse", ValueErr, lambda: hvd.allreduce(t.to_sparse()), ("sparse",)),
        ("bool/allreduce_sum", ValueErr, lambda: hvd.allreduce(flag, op=hvd.Sum), ("Sum", "bool")),
        ("bool/allreduce_default_average", ValueErr, lambda: hvd.allreduce(flag), ("bool",)),
        ("bool/allreduce_inplace_average", ValueErr,
         lambda: hvd.allreduce_(flag, op=hvd.Average), ("Average", "bool")),
        ("bool/grouped_allreduce_sum", ValueErr,
         lambda: hvd.grouped_allreduce([t, flag], op=hvd.Sum), ("bool",)),
        ("bool/allreduce_prescale", ValueErr,
         lambda: hvd.allreduce(flag, op=hvd.Max, prescale_factor=2.0), ("bool",)),
        ("bool/reducescatter", ValueErr, lambda: hvd.reducescatter(flag, op=hvd.Max), ("bool",)),
        ("splits/sum_differs", ValueErr, lambda: hvd.alltoall(t, splits=[1] * size),
         ("sum", str(size), str(2 * size))),
        ("splits/wrong_length", ValueErr, lambda: hvd.alltoall(t, splits=[2 * size] + [0] * size),
         (str(size + 1), str(size))),
        ("splits/negative", ValueErr,
         lambda: hvd.alltoall(t, splits=[2 * size + 1, -1] + [0] * (size - 2)), ("negative",)),
        ("splits/floats", ValueErr, lambda: hvd.alltoall(t, splits=[2.0] * size), ("splits", "2.0")),
        ("splits/float_tensor", ValueErr,
         lambda: hvd.alltoall(t, splits=torch.full((size,), 2.0)), ("splits", "float32")),
        ("splits/none_with_indivisible_rows", ValueErr,
         lambda: hvd.alltoall(torch.ones(2 * size + 1, 2)), (str(2 * size + 1), str(size))),
        ("value/alltoall_0d", ValueErr, lambda: hvd.alltoall(torch.tensor(1.0)), ("dimension",)),
        ("value/reducescatter_0d", ValueErr, lambda: hvd.reducescatter(torch.tensor(1.0)),
         ("dimension",)),
        ("handle/synchronize_unknown", ValueErr, lambda: hvd.synchronize(123456789),
         ("123456789",)),
        ("handle/poll_unknown", ValueErr, lambda: hvd.poll(123456789), ("123456789",)),
        ("handle/synchronize_string", TypeErr, lambda: hvd.synchronize("1"), ("handle",)),
        ("process_set/unregistered", SetErr,
         lambda: hvd.allreduce(t, process_set=unregistered), ("not registered",)),
        ("process_set/unregistered_broadcast", SetErr,
         lambda: hvd.broadcast(t, root_rank=0, process_set=unregistered), ("not registered",)),
        ("process_set/not_a_process_set", TypeErr,
         lambda: hvd.allreduce(t, process_set=[0, 1]), ("process_set",)),
        ("process_set/add_out_of_range", SetErr, lambda: hvd.add_process_set([0, size]),
         (str(size),)),
        ("process_set/add_duplicates", ValueErr, lambda: hvd.add_process_set([0, 0]),
         ("duplicate",)),
        ("process_set/add_empty", ValueErr, lambda: hvd.add_process_set([]), ()),
        ("process_set/add_non_int", TypeErr, lambda: hvd.add_process_set([0, "1"]), ("'1'",)),
        ("process_set/add_registered_again", SetErr,
         lambda: hvd.add_process_set(hvd.global_process_set), ("already registered",)),
        ("process_set/remove_global", SetErr,
         lambda: hvd.remove_process_set(hvd.global_process_set), ("global",)),
    ]
    forms = {"allreduce": lambda x: hvd.allreduce(x), "allreduce_": lambda x: hvd.allreduce_(x),
             "allreduce_async": lambda x: hvd.allreduce_async(x),
             "grouped_allreduce": lambda x: hvd.grouped_allreduce([x]),
             "allgather": lambda x: hvd.allgather(x),
             "broadcast": lambda x: hvd.broadcast(x, root_rank=0),
             "broadcast_": lambda x: hvd.broadcast_(x, root_rank=0),
             "alltoall": lambda x: hvd.alltoall(x), "reducescatter": lambda x: hvd.reducescatter(x)}
    for form, call in forms.items():
        cases.append((f"device/{form}_meta", Device, lambda c=call: c(meta), ("meta",)))
        cases.append((f"dtype/{form}_complex64", ValueErr, lambda c=call: c(complex_),
                      ("complex64",)))
    return cases


# -- process sets that exclude the caller, and a removed one --------------------------------
_PARTIAL: list[psrt.ProcessSet] = []


def register_partial_set(key: str) -> None:
    """[0 .. size-2]: the last rank is outside it."""
    _PARTIAL.append(hvd.add_process_set(list(range(hvd.size() - 1))))
    _then_in_step(key)


def non_member_error(key: str, call) -> None:
    rank = hvd.rank()
    if rank == hvd.size() - 1:
        expect_raises(SetErr, lambda: call(_PARTIAL[0]), f"rank {rank}", what=key)
    _then_in_step(key)


_NON_MEMBER_CALLS = {
    "allreduce": lambda s: hvd.allreduce(torch.ones(3), process_set=s),
    "allreduce_": lambda s: hvd.allreduce_(torch.ones(3), process_set=s),
    "allreduce_async": lambda s: hvd.allreduce_async(torch.ones(3), process_set=s),
    "allreduce_async_": lambda s: hvd.allreduce_async_(torch.ones(3), process_set=s),
    "grouped_allreduce": lambda s: hvd.grouped_allreduce([torch.ones(3)], process_set=s),
    "grouped_allreduce_": lambda s: hvd.grouped_allreduce_([torch.ones(3)], process_set=s),
    "grouped_allreduce_async":
        lambda s: hvd.grouped_allreduce_async([torch.ones(3)], process_set=s),
    "allgather": lambda s: hvd.allgather(torch.ones(3), process_set=s),
    "allgather_async": lambda s: hvd.allgather_async(torch.ones(3), process_set=s),
    "broadcast": lambda s: hvd.broadcast(torch.ones(3), root_rank=0, process_set=s),
    "broadcast_": lambda s: hvd.broadcast_(torch.ones(3), root_rank=0, process_set=s),
    "broadcast_async": lambda s: hvd.broadcast_async(torch.ones(3), root_rank=0, process_set=s),
    "alltoall": lambda s: hvd.alltoall(torch.ones(3), splits=[3], process_set=s),
    "alltoall_async": lambda s: hvd.alltoall_async(torch.ones(3), splits=[3], process_set=s),
    "reducescatter": lambda s: hvd.reducescatter(torch.ones(3), process_set=s),
    "reducescatter_async": lambda s: hvd.reducescatter_async(torch.ones(3), process_set=s),
    "barrier": lambda s: hvd.barrier(process_set=s),
}


def removed_set(key: str) -> None:
    """After every rank removed a set, using it raises on every rank, before communication."""
    process_set = hvd.add_process_set([0])
    hvd.remove_process_set(process_set)
    expect_raises(SetErr, lambda: hvd.allreduce(torch.ones(2), process_set=process_set),
                  "not registered", what=key)
    _then_in_step(key)


# -- cross-rank mismatches --------------------------------------------------------------------
def mismatch(key: str, field: str, values: tuple[str, str], call) -> None:
    """Even ranks make ``call(0, name)``, odd ranks ``call(1, name)``; ``values`` are how the
    message must show each variant's ``field``."""
    rank, size = hvd.rank(), hvd.size()
    start = time.monotonic()
    exc = expect_raises(psrt.CollectiveMismatchError, lambda: call(rank % 2, key), field, what=key)
    assert isinstance(exc, hvd.HorovodInternalError), f"{key}: not a hvd.HorovodInternalError"
    message = str(exc)
    assert key in message, f"{key}: message {message!r} does not name the tensor"
    for r in range(size):  # each rank is named together with its own value
        pattern = rf"\branks? (?:\d+,)*{r}(?:,\d+)* ha(?:s|ve) [^;]*{re.escape(values[r % 2])}"
        assert re.search(pattern, message), (
            f"{key}: message {message!r} does not say rank {r} passed {values[r % 2]!r}")
    elapsed = time.monotonic() - start
    assert elapsed < 5.0, f"{key}: took {elapsed:.1f} s to raise"
    _then_in_step(key)


_MISMATCHES = [
    ("allreduce_shape", "shape", ("2, 3", "2, 4"),
     lambda v, k: hvd.allreduce(torch.ones(2, 3 + v), name=k)),
    ("allreduce_dtype", "dtype", ("float32", "float64"),
     lambda v, k: hvd.allreduce(torch.ones(3, dtype=(torch.float32, torch.float64)[v]), name=k)),
    ("allreduce_op", "op", ("Sum", "Max"),
     lambda v, k: hvd.allreduce(torch.ones(3), op=(hvd.Sum, hvd.Max)[v], name=k)),
    ("allreduce_prescale", "prescale_factor", ("1.0", "2.0"),
     lambda v, k: hvd.allreduce(torch.ones(3), prescale_factor=1.0 + v, name=k)),
    ("allreduce_inplace_shape", "shape", ("5", "6"),
     lambda v, k: hvd.allreduce_(torch.ones(5 + v), name=k)),
    ("allreduce_async_shape", "shape", ("7", "8"),
     lambda v, k: hvd.synchronize(hvd.allreduce_async(torch.ones(7 + v), name=k))),
    ("grouped_allreduce_shapes", "shape", ("3", "4"),
     lambda v, k: hvd.grouped_allreduce([torch.ones(2), torch.ones(3 + v)], name=k)),
    ("grouped_allreduce_dtypes", "dtype", ("int32", "int64"),
     lambda v, k: hvd.grouped_allreduce(
         [torch.ones(2), torch.ones(3, dtype=(torch.int32, torch.int64)[v])], name=k)),
    ("allgather_trailing_shape", "trailing_shape", ("(3,)", "(4,)"),
     lambda v, k: hvd.allgather(torch.ones(1, 3 + v), name=k)),
    ("allgather_dtype", "dtype", ("int8", "int16"),
     lambda v, k: hvd.allgather(torch.ones(2, dtype=(torch.int8, torch.int16)[v]), name=k)),
    ("broadcast_root", "root_rank", ("0", "1"),
     lambda v, k: hvd.broadcast(torch.ones(3), root_rank=v, name=k)),
    ("broadcast_shape", "shape", ("(3,)", "(2,)"),
     lambda v, k: hvd.broadcast_(torch.ones(3 - v), root_rank=0, name=k)),
    ("alltoall_dtype", "dtype", ("float16", "bfloat16"),
     lambda v, k: hvd.alltoall(torch.ones(hvd.size(), dtype=(torch.float16, torch.bfloat16)[v]),
                               name=k)),
    ("reducescatter_op", "op", ("Sum", "Average"),
     lambda v, k: hvd.reducescatter(torch.ones(4, 2), op=(hvd.Sum, hvd.Average)[v], name=k)),
    ("reducescatter_shape", "shape", ("4, 2", "4, 3"),
     lambda v, k: hvd.reducescatter(torch.ones(4, 2 + v), op=hvd.Sum, name=k)),
    ("different_collectives", "collective", ("allreduce", "broadcast"),
     lambda v, k: (hvd.allreduce(torch.ones(3), name=k) if v == 0
                   else hvd.broadcast(torch.ones(3), root_rank=0, name=k))),
]


def add_process_set_mismatch(key: str) -> None:
    """Ranks passing different ranks to add_process_set all raise; none registers it."""
    rank = hvd.rank()
    expect_raises(SetErr, lambda: hvd.add_process_set([0] if rank % 2 == 0 else [0, 1]),
                  "different", what=key)
    _then_in_step(key)


def main() -> None:
    hvd.init()
    size = hvd.size()
    checks = _harness.Checks()
    for index, (name, kind, call, fragments) in enumerate(_local_cases(size)):
        checks.add(name, local_error, index, kind, call, fragments)
    checks.add("process_set/register_partial", register_partial_set)
    for form, call in _NON_MEMBER_CALLS.items():
        name = f"process_set/non_member/{form}"
        checks.add(name, non_member_error, call)
    checks.add("process_set/removed", removed_set)
    for name, field, values, call in _MISMATCHES:
        checks.add(f"mismatch/{name}", mismatch, field, values, call)
    checks.add("mismatch/add_process_set", add_process_set_mismatch)
    _harness.run(checks)
    hvd.shutdown()


if __name__ == "__main__":
    main()
