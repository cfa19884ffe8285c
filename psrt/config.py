"""Runtime configuration: one typed, frozen object built from the environment.

``PSRT_*`` variables (set by the user or forwarded by ``psrun``) map onto the
fields below; ``HOROVOD_*`` names are accepted as aliases where they mean the
same thing.  Defaults are documented on each field.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import Mapping

from psrt.errors import InvalidArgumentError

_MiB = 1 << 20


@dataclass(frozen=True)
class Config:
    # With tuning off (``tune``), allreduce and reducescatter messages at least this
    # large (bytes) use psrt's chunked ring; smaller ones use MPI's own algorithms,
    # which win or tie below it.  Measured crossover 8-32 MiB on a 2-core shared-memory
    # box (benchmarks/RESULTS.md, --sweep-threshold).  Setting it turns tuning off
    # unless PSRT_TUNE is set too.
    ring_threshold: int = 16 * _MiB
    # How host allreduces and reducescatters choose between MPI's algorithms and psrt's
    # ring (and, over several hosts, the hierarchical allreduce) by size: "auto" reads
    # the tuning table of this machine, MPI and layout, measuring it at init (within
    # 1.5 s, the sizes that fit) where there is none yet; "measure" measures every size
    # again and replaces the file; "off" uses ring_threshold.  See PSRT_TUNE_FILE for where tables live.
    tune: str = "auto"
    # The tuning table's file (e.g. one committed with the code); default
    # $XDG_CACHE_HOME/psrt/tuning/<host>-<n>ranks-<hash>.json (~/.cache without
    # XDG_CACHE_HOME), one per machine, MPI library, number of ranks and ranks per host.
    tune_file: str = ""
    # The ring moves each chunk in segments of this many bytes, so each
    # received segment is reduced while it is still in cache.
    ring_segment: int = 1 * _MiB
    # An uncaught exception on any rank aborts the whole job (as
    # ``python -m mpi4py`` does) instead of leaving the other ranks blocked.
    abort_on_exception: bool = True
    # Allreduces that are ready in the same engine cycle and share dtype, op,
    # scale and process set are reduced as one message of at most this many
    # bytes (Horovod's default); 0 turns fusion off.
    fusion_threshold: int = 128 * _MiB
    # How long (milliseconds) the engine waits between negotiation rounds when
    # it has nothing to run: the window in which ready tensors are collected.
    cycle_time_ms: float = 1.0
    # Named operations remembered by the response cache; a step whose
    # operations are all cached is negotiated with one tiny allreduce.
    cache_capacity: int = 1024
    # Any wait on other ranks (a collective some ranks have not submitted, a
    # negotiation round or a message a frozen or unreachable rank never answers, a
    # parameter-server request) this long (seconds) is reported, naming the ranks
    # to blame.
    stall_check_time_s: float = 60.0
    # After this many seconds of such a stall the job ends with that report (0:
    # never).  Ten minutes, as torch.distributed's default collective timeout with
    # NCCL: long enough for one rank's checkpoint or evaluation while the others
    # wait, short enough that a hung node does not hold an allocation for hours.
    # Unset, it is at least the check time.
    stall_shutdown_time_s: float = 600.0
    # Write a Chrome-trace timeline of every tensor's phases to this file (rank 0).
    timeline: str = ""
    # Mark each engine cycle in the timeline.
    timeline_mark_cycles: bool = False
    # Parameter-server mode: this many ranks are servers, the rest workers
    # (0: no servers, every rank is a worker of the allreduce world).
    num_servers: int = 0
    # Tensors larger than this (bytes) are split into chunks of about this size
    # spread across the servers (BytePS's partition size); smaller ones live whole
    # on the least-loaded server.  Each chunk is a message of its own (0.1-0.4 ms
    # each on a 2-core host), hence the floor of 256 bytes: 1-byte chunks made a
    # 64 KiB push take 32 s.
    ps_chunk_bytes: int = 4 * _MiB
    # Tensor-parallel collectives check that every rank makes the same call
    # (collective, dtype, shape, op), so that ranks feeding different shapes raise
    # the same error instead of hanging: one small exchange the first time each
    # call is made; later calls of it run unchecked on a communicator of their own,
    # and a rank whose call then differs is found blocked apart from the others
    # and raises a second or two later (CUDA tensors: checked on every call).
    # Off: no check at all (a mismatch is then a hang or a wrong result).
    tp_check_shapes: bool = True
    # Allreduces of the global process set on host tensors go in three steps when the
    # job spans several hosts and some host runs several ranks: reduce onto one rank
    # per host over shared memory, allreduce among those ranks across the network,
    # broadcast on each host (Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE).  It sends
    # each host's data across the network once instead of once per rank.
    hierarchical_allreduce: bool = False
    # Tune fusion_threshold and cycle_time_ms on the job's own training steps (Horovod's
    # autotuner): each candidate runs for autotune_steps_per_sample steps after
    # autotune_warmup_samples samples of warm-up, scored by bytes allreduced per second;
    # the best is kept.
    autotune: bool = False
    # Write each autotuning sample (settings and score) to this CSV file (rank 0).
    autotune_log: str = ""
    # Autotuning samples run and discarded first (the first steps are slower).
    autotune_warmup_samples: int = 3
    # Training steps per autotuning sample; a step ends where a tensor name of the
    # current step is allreduced again.
    autotune_steps_per_sample: int = 10
    # How a rank waits on others.  "auto": waits spin briefly and then nap, and nap at
    # once (large allreduces by MPI's non-blocking call, agreed by the ranks) while
    # the training thread waits for cores a quarter of its time.  "spin": never the crowded ways
    # (every rank has cores to itself whatever else runs).  "nap": always them.
    waits: str = "auto"


_ENV_NAMES: dict[str, tuple[str, ...]] = {
    "ring_threshold": ("PSRT_RING_THRESHOLD",),
    "ring_segment": ("PSRT_RING_SEGMENT",),
    "abort_on_exception": ("PSRT_ABORT_ON_EXCEPTION",),
    "fusion_threshold": ("PSRT_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD"),
    "cycle_time_ms": ("PSRT_CYCLE_TIME", "HOROVOD_CYCLE_TIME"),
    "cache_capacity": ("PSRT_CACHE_CAPACITY", "HOROVOD_CACHE_CAPACITY"),
    "stall_check_time_s": ("PSRT_STALL_CHECK_TIME", "HOROVOD_STALL_CHECK_TIME_SECONDS"),
    "stall_shutdown_time_s": ("PSRT_STALL_SHUTDOWN_TIME", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"),
    "timeline": ("PSRT_TIMELINE", "HOROVOD_TIMELINE"),
    "timeline_mark_cycles": ("PSRT_TIMELINE_MARK_CYCLES", "HOROVOD_TIMELINE_MARK_CYCLES"),
    "num_servers": ("PSRT_NUM_SERVERS",),
    "ps_chunk_bytes": ("PSRT_PS_CHUNK_BYTES",),
    "tp_check_shapes": ("PSRT_TP_CHECK_SHAPES",),
    "hierarchical_allreduce": ("PSRT_HIERARCHICAL_ALLREDUCE", "HOROVOD_HIERARCHICAL_ALLREDUCE"),
    "tune": ("PSRT_TUNE",),
    "tune_file": ("PSRT_TUNE_FILE",),
    "autotune": ("PSRT_AUTOTUNE", "HOROVOD_AUTOTUNE"),
    "autotune_log": ("PSRT_AUTOTUNE_LOG", "HOROVOD_AUTOTUNE_LOG"),
    "autotune_warmup_samples": ("PSRT_AUTOTUNE_WARMUP_SAMPLES", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES"),
    "autotune_steps_per_sample": ("PSRT_AUTOTUNE_STEPS_PER_SAMPLE", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE"),
    "waits": ("PSRT_WAITS",),
}
_TUNE_MODES = ("auto", "measure", "off")
WAIT_MODES = ("auto", "spin", "nap")
_TiB = 1 << 40
# The smallest parameter-server chunk: see Config.ps_chunk_bytes.
_PS_CHUNK_FLOOR = 256
# The stall check time must span at least this many engine cycles.
_CYCLES_PER_CHECK = 20
# The range each number may take: (lowest, highest, unit).  Sizes that make no sense at
# zero start at 1; every other number may be zero (0 = off).
_RANGES: dict[str, tuple[float, float, str]] = {
    "ring_threshold": (1, _TiB, "bytes"),
    "ring_segment": (1, _TiB, "bytes"),
    "fusion_threshold": (0, _TiB, "bytes"),
    "cycle_time_ms": (0, 10_000, "milliseconds"),
    "cache_capacity": (0, 10_000_000, "entries"),
    "stall_check_time_s": (0.001, 1e7, "seconds"),
    "stall_shutdown_time_s": (0, 1e7, "seconds"),
    "num_servers": (0, 1_000_000, "ranks"),
    "ps_chunk_bytes": (_PS_CHUNK_FLOOR, _TiB, "bytes"),
    "autotune_warmup_samples": (0, 1_000_000, "samples"),
    "autotune_steps_per_sample": (1, 1_000_000, "steps"),
}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _parse(field: str, name: str, raw: str, kind: type) -> object:
    text = raw.strip().lower()
    if kind is str:
        return raw.strip()
    if kind is bool:
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise InvalidArgumentError(f"{name}={raw!r} is not a boolean (use 1/0, true/false)")
    try:
        value = kind(text)
    except ValueError:
        raise InvalidArgumentError(f"{name}={raw!r} is not {'an integer' if kind is int else 'a number'}") \
            from None
    if not math.isfinite(value):
        raise InvalidArgumentError(f"{name}={raw!r} must be a finite number")
    lowest, highest, unit = _RANGES[field]
    if not lowest <= value <= highest:
        raise InvalidArgumentError(f"{name}={raw!r} is out of range: it must be between {_number(lowest)} and "
                                   f"{_number(highest)} ({unit})")
    return value


def _number(value: float) -> str:
    return f"{int(value):,}" if value == int(value) else f"{value:g}"


def config_from_env(env: Mapping[str, str] | None = None) -> Config:
    """Build the config from ``env`` (default ``os.environ``); the first name set wins."""
    env = os.environ if env is None else env
    values: dict[str, object] = {}
    for field in fields(Config):
        for name in _ENV_NAMES[field.name]:
            if name in env:
                values[field.name] = _parse(field.name, name, env[name], type(field.default))
                break
    if "tune" in values:
        values["tune"] = str(values["tune"]).lower()
        if values["tune"] not in _TUNE_MODES:
            raise InvalidArgumentError(f"PSRT_TUNE={env['PSRT_TUNE']!r} is not one of {', '.join(_TUNE_MODES)}")
    elif "ring_threshold" in values:  # a threshold the user set is theirs to keep
        values["tune"] = "off"
    if "waits" in values:
        values["waits"] = str(values["waits"]).lower()
        if values["waits"] not in WAIT_MODES:
            raise InvalidArgumentError(f"PSRT_WAITS={env['PSRT_WAITS']!r} is not one of {', '.join(WAIT_MODES)}")
    check = values.get("stall_check_time_s", Config.stall_check_time_s)
    if "stall_shutdown_time_s" not in values:  # the default follows a longer check time
        values["stall_shutdown_time_s"] = max(Config.stall_shutdown_time_s, check)
    config = Config(**values)
    if 0 < config.stall_shutdown_time_s < check:
        raise InvalidArgumentError(
            f"PSRT_STALL_SHUTDOWN_TIME={config.stall_shutdown_time_s:g} s is shorter than "
            f"PSRT_STALL_CHECK_TIME={check:g} s, after which a stall is first looked at: "
            "make it at least as long, or 0 never to end the job on a stall")
    # An idle engine's rounds are _IDLE_CYCLES (5) cycles apart: a peer may take that long
    # to join a round, which must not look like a stall.
    if check < _CYCLES_PER_CHECK * config.cycle_time_ms / 1000:
        raise InvalidArgumentError(
            f"PSRT_STALL_CHECK_TIME={check:g} s is shorter than {_CYCLES_PER_CHECK} engine cycles of "
            f"PSRT_CYCLE_TIME={config.cycle_time_ms:g} ms: an idle rank joins a negotiation round only every "
            "few cycles; lengthen the check time or shorten the cycle")
    return config
