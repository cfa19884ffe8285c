"""Runtime configuration: one typed, frozen object built from the environment.

``PSRT_*`` variables (set by the user or forwarded by ``psrun``) map onto the
fields below; ``HOROVOD_*`` names are accepted as aliases where they mean the
same thing.  Defaults are documented on each field.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Mapping

from psrt.errors import InvalidArgumentError

_MiB = 1 << 20


@dataclass(frozen=True)
class Config:
    # Allreduce and reducescatter messages at least this large (bytes) use
    # psrt's chunked ring; smaller ones use MPI's own algorithms, which win or
    # tie below it.  Measured crossover 8-32 MiB on a 2-core shared-memory box
    # (benchmarks/RESULTS.md, --sweep-threshold).
    ring_threshold: int = 16 * _MiB
    # The ring moves each chunk in segments of this many bytes, so each
    # received segment is reduced while it is still in cache.
    ring_segment: int = 1 * _MiB
    # Before each collective, check cheaply that every rank passed the same
    # shape, dtype, op and root; a mismatch raises on every rank instead of
    # hanging or returning garbage.
    check_consistency: bool = True
    # An uncaught exception on any rank aborts the whole job (as
    # ``python -m mpi4py`` does) instead of leaving the other ranks blocked.
    abort_on_exception: bool = True


_ENV_NAMES: dict[str, tuple[str, ...]] = {
    "ring_threshold": ("PSRT_RING_THRESHOLD",),
    "ring_segment": ("PSRT_RING_SEGMENT",),
    "check_consistency": ("PSRT_CHECK_CONSISTENCY",),
    "abort_on_exception": ("PSRT_ABORT_ON_EXCEPTION",),
}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _parse(name: str, raw: str, kind: type) -> object:
    text = raw.strip().lower()
    if kind is bool:
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise InvalidArgumentError(f"{name}={raw!r} is not a boolean (use 1/0, true/false)")
    try:
        value = int(text)
    except ValueError:
        raise InvalidArgumentError(f"{name}={raw!r} is not an integer") from None
    if value <= 0:
        raise InvalidArgumentError(f"{name}={raw!r} must be positive")
    return value


def config_from_env(env: Mapping[str, str] | None = None) -> Config:
    """Build the config from ``env`` (default ``os.environ``); the first name set wins."""
    env = os.environ if env is None else env
    values: dict[str, object] = {}
    for field in fields(Config):
        for name in _ENV_NAMES[field.name]:
            if name in env:
                values[field.name] = _parse(name, env[name], type(field.default))
                break
    return Config(**values)
