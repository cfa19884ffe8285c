"""Deterministic per-rank inputs, numpy references, and comparisons for the check scripts.

Every input is a pure function of (check key, rank), so each rank can rebuild
every other rank's input and compute the expected output of a collective on
its own, without trusting psrt to move the data.

Tolerances follow what psrt promises: integers, bool, and float Min/Max are
exact; float32/float64 sums are within 1e-6 / 1e-12 of the magnitude of the
summed terms; float16/bfloat16 are reduced in float32 and rounded once, so
they must be within one unit in the last place of the float32 reference
rounded to the dtype.
"""
from __future__ import annotations

import functools
import zlib
from typing import Sequence

import numpy as np
import torch

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float64": torch.float64, "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16,
    "int32": torch.int32, "int64": torch.int64, "bool": torch.bool,
}
NUMERIC = [name for name in DTYPES if name != "bool"]
OPS = ("Sum", "Average", "Min", "Max", "Product")
BOOL_OPS = ("Min", "Max", "Product")  # Min = all, Max = any, Product = all
HALF = (torch.float16, torch.bfloat16)
_RTOL = {torch.float32: 1e-6, torch.float64: 1e-12}
_BIG = 10 ** 15  # keeps int64 inputs far from overflow


def ops_for(dtype_name: str) -> tuple[str, ...]:
    return BOOL_OPS if dtype_name == "bool" else OPS


def rng_for(key: str, rank: int) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(f"{key}|{rank}".encode()))


def sample(key: str, rank: int, dtype: torch.dtype, shape: Sequence[int], *, op: str = "Sum",
           contributors: int = 1, factor: int = 1) -> torch.Tensor:
    """The input of ``rank`` for check ``key``; sums over ``contributors`` ranks, each term
    multiplied by ``factor``, stay inside the dtype's range."""
    rng = rng_for(key, rank)
    count = int(np.prod(shape, dtype=np.int64))
    if dtype == torch.bool:
        flat = rng.random(count) < 0.5
        every = min(count, 2 ** contributors)  # these elements cover every combination of ranks
        flat[:every] = (np.arange(every) >> rank) & 1
        return torch.from_numpy(flat.reshape(shape))
    if dtype.is_floating_point:
        if op == "Product":
            values = rng.uniform(0.5, 2.0, count) * rng.choice([-1.0, 1.0], count)
        else:
            values = rng.normal(0.0, 10.0, count)
        return torch.from_numpy(values.reshape(shape)).to(dtype)
    info = torch.iinfo(dtype)
    if op == "Product":
        low, high = (0 if info.min == 0 else -3), 3
    elif op in ("Min", "Max"):
        low, high = max(info.min, -_BIG), min(info.max, _BIG)
    else:
        high = min(info.max, _BIG) // (contributors * factor)
        low = 0 if info.min == 0 else -high
    values = rng.integers(low, high, count, endpoint=True)
    return torch.from_numpy(values.reshape(shape)).to(dtype)


def samples(key: str, size: int, dtype: torch.dtype, shape: Sequence[int],
            **kw) -> list[torch.Tensor]:
    """Every rank's input for check ``key`` (``size`` ranks)."""
    return [sample(key, r, dtype, shape, contributors=size, **kw) for r in range(size)]


_UFUNCS = {"Sum": np.add, "Average": np.add, "Min": np.minimum, "Max": np.maximum,
           "Product": np.multiply}
_BOOL_UFUNCS = {"Min": np.logical_and, "Max": np.logical_or, "Product": np.logical_and}


def check_reduced(got: object, inputs: Sequence[torch.Tensor], op: str, what: str, *,
                  pre: float = 1.0, post: float = 1.0) -> None:
    """Assert ``got`` is the ``op`` reduction of ``inputs`` (one per rank), scaled as Horovod does:
    each input times ``pre``, the result times ``post`` (and divided by the count for Average;
    rounded toward zero for integers)."""
    dtype, count = inputs[0].dtype, len(inputs)
    check_layout(got, inputs[0].shape, dtype, what)
    if dtype == torch.bool:
        want = functools.reduce(_BOOL_UFUNCS[op], [t.numpy() for t in inputs])
        return assert_equal(got, torch.from_numpy(np.asarray(want)), what)
    if not dtype.is_floating_point:
        acc = functools.reduce(_UFUNCS[op], [t.numpy().astype(np.int64) * int(pre) for t in inputs])
        acc = acc * int(post)
        if op == "Average":
            acc = np.sign(acc) * (np.abs(acc) // count)
        info = torch.iinfo(dtype)
        assert info.min <= np.min(acc, initial=0) and np.max(acc, initial=0) <= info.max, (
            f"{what}: test inputs overflow {dtype} (bad test, not a psrt bug)")
        return assert_equal(got, torch.from_numpy(np.asarray(acc)).to(dtype), what)
    scaled = [t * pre if pre != 1.0 else t for t in inputs]  # prescaling happens in the dtype
    divisor = count if op == "Average" else 1
    if dtype in HALF:
        acc32 = functools.reduce(_UFUNCS[op], [t.float().numpy() for t in scaled])
        acc32 = np.asarray(acc32 * np.float32(post / divisor), dtype=np.float32)
        want = torch.from_numpy(acc32).to(dtype)
        if op in ("Min", "Max"):
            return assert_equal(got, want, what)
        return assert_within_ulps(got, want, what)
    terms = [t.double().numpy() for t in scaled]
    acc = np.asarray(functools.reduce(_UFUNCS[op], terms) * (post / divisor))
    if op in ("Min", "Max"):
        return assert_equal(got, torch.from_numpy(acc).to(dtype), what)
    if op == "Product":
        magnitude = np.abs(acc)
    else:
        magnitude = functools.reduce(np.add, [np.abs(t) for t in terms]) * abs(post / divisor)
    assert_close(got, acc, _RTOL[dtype] * magnitude + 1e-300, what)


def check_layout(got: object, shape: Sequence[int], dtype: torch.dtype, what: str) -> None:
    assert isinstance(got, torch.Tensor), f"{what}: returned {type(got).__name__}, not a tensor"
    assert got.dtype == dtype, f"{what}: dtype {got.dtype}, expected {dtype}"
    assert tuple(got.shape) == tuple(shape), (
        f"{what}: shape {tuple(got.shape)}, expected {tuple(shape)}")


def _first_bad(bad: torch.Tensor, got: torch.Tensor, want, extra: str = "") -> str:
    """Describe the differing elements: how many, and the first one (index, got, expected)."""
    flat = int(torch.nonzero(bad.reshape(-1))[0])
    index = tuple(int(i) for i in np.unravel_index(flat, tuple(bad.shape)))
    expected = want.reshape(-1)[flat].item()
    return (f"{int(bad.sum())} of {bad.numel()} elements differ; first at {index}: got "
            f"{got.reshape(-1)[flat].item()!r}, expected {expected!r}{extra}")


def assert_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Same shape, dtype and values (bitwise for floats, so -0.0 vs 0.0 would count)."""
    check_layout(got, want.shape, want.dtype, what)
    if want.dtype.is_floating_point:
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[want.element_size()]
        bad = got.contiguous().view(bits) != want.contiguous().view(bits)
    else:
        bad = got != want
    if bool(bad.any()):
        raise AssertionError(f"{what}: {_first_bad(bad, got, want)}")


def assert_close(got: torch.Tensor, want: np.ndarray, tolerance: np.ndarray, what: str) -> None:
    error = np.abs(got.double().numpy() - want)
    bad = torch.from_numpy(np.asarray(~(error <= tolerance)))
    if bool(bad.any()):
        worst = float(np.max(error / tolerance))
        worst_text = f"; worst error {worst:.3g}x tolerance"
        raise AssertionError(f"{what}: {_first_bad(bad, got, want, worst_text)}")


def _ordered_bits(tensor: torch.Tensor) -> torch.Tensor:
    """16-bit float patterns mapped to integers that are adjacent for adjacent floats."""
    bits = tensor.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def assert_within_ulps(got: torch.Tensor, want: torch.Tensor, what: str, ulps: int = 1) -> None:
    check_layout(got, want.shape, want.dtype, what)
    bad = (_ordered_bits(got) - _ordered_bits(want)).abs() > ulps
    if bool(bad.any()):
        raise AssertionError(f"{what}: {_first_bad(bad, got, want.float(), f' (over {ulps} ulp)')}")


def expect_raises(kind: type[BaseException], call, *fragments: str,
                  what: str = "") -> BaseException:
    """Run ``call``; assert it raises ``kind`` with every fragment in its message."""
    try:
        call()
    except kind as exc:
        message = str(exc)
        missing = [f for f in fragments if f not in message]
        assert not missing, f"{what}: message {message!r} does not mention {missing}"
        return exc
    except Exception as exc:
        raise AssertionError(f"{what}: raised {type(exc).__name__} ({exc}), expected "
                             f"{kind.__name__}") from exc
    raise AssertionError(f"{what}: did not raise {kind.__name__}")
