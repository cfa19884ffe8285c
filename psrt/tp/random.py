"""Random streams for tensor parallelism, and the dropouts that use them.

Two kinds of region need two kinds of randomness:

- **Tensor-parallel regions** (activations split along the hidden dimension, such as
  the attention probabilities of a rank's own heads) hold different data on each TP
  rank, so their dropout masks must differ per rank: they are drawn inside
  ``rng_tracker().fork()``, from a stream seeded with ``seed + 2718 + tp_rank``
  (Megatron's offset).
- **Replicated and sequence-parallel regions** hold (blocks of) the same tensor on
  every TP rank, so their masks are drawn from torch's default generator, seeded alike
  on every rank of the set.  A sequence-parallel dropout draws the mask of the whole
  sequence and keeps its own block, so the TP ranks stay in step and the result equals
  the single-process model's dropout exactly.

The tracker swaps its streams into torch's default generators (the CPU one, and the
current CUDA device's once CUDA is in use) for the duration of a ``fork``, so any
random op inside draws from the stream.  Like those generators it is process-wide
state: one tracker per process, reached with :func:`rng_tracker`.  Activation
recomputation (:mod:`psrt.tp.recompute`) saves and replays its states, so recomputed
masks equal the original ones.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from psrt.errors import ArgumentTypeError, InvalidArgumentError
from psrt.tp.comm import group_rank, group_size
from psrt.topology import ProcessSet

TENSOR_PARALLEL_STREAM = "tensor-parallel"
TENSOR_PARALLEL_SEED_OFFSET = 2718


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _default_states() -> dict[str, torch.Tensor]:
    """The states of the default generators a random op may draw from now."""
    states = {"cpu": torch.get_rng_state()}
    if _cuda_in_use():
        states[f"cuda:{torch.cuda.current_device()}"] = torch.cuda.get_rng_state()
    return states


def _set_default_states(states: dict[str, torch.Tensor]) -> None:
    for device, state in states.items():
        if device == "cpu":
            torch.set_rng_state(state)
        else:
            torch.cuda.set_rng_state(state, device)


class RNGStatesTracker:
    """Named random streams, each a seed and the states of its generators."""

    def __init__(self) -> None:
        self._seeds: dict[str, int] = {}
        self._states: dict[str, dict[str, torch.Tensor]] = {}

    def reset(self) -> None:
        self._seeds.clear()
        self._states.clear()

    def add(self, name: str, seed: int) -> None:
        """A new stream ``name`` seeded with ``seed`` (the seeds of two streams must differ)."""
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ArgumentTypeError(f"the seed of stream {name!r} must be an int, got {type(seed).__name__}")
        if name in self._seeds:
            raise InvalidArgumentError(f"random stream {name!r} already exists")
        if seed in self._seeds.values():
            raise InvalidArgumentError(f"seed {seed} is already used by another random stream")
        self._seeds[name] = seed
        self._states[name] = {}

    def has(self, name: str) -> bool:
        return name in self._seeds

    def get_states(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every stream's generator states (copies), for recomputation and checkpoints."""
        return {name: {device: state.clone() for device, state in states.items()}
                for name, states in self._states.items()}

    def set_states(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        unknown = sorted(set(states) - set(self._seeds))
        if unknown:
            raise InvalidArgumentError(f"no random stream named {unknown[0]!r}: add it before restoring its state")
        for name, devices in states.items():
            self._states[name] = {device: state.clone() for device, state in devices.items()}

    def state_dict(self) -> dict:
        """Every stream's seed and generator states (copies): the tracker's part of a
        checkpoint or elastic commit, so that dropout in TP regions resumes exactly."""
        return {"seeds": dict(self._seeds), "states": self.get_states()}

    def load_state_dict(self, state: dict) -> None:
        """Replace every stream by those of :meth:`state_dict` (the streams ``manual_seed``
        added are dropped: a commit made on another TP rank holds another seed)."""
        seeds, states = state["seeds"], state["states"]
        if set(states) - set(seeds):
            raise InvalidArgumentError(f"RNG tracker state has generator states for streams "
                                       f"{sorted(set(states) - set(seeds))} without a seed: it is not a "
                                       "state_dict() of an RNGStatesTracker")
        self.reset()
        for name, seed in seeds.items():
            self.add(name, seed)
        self.set_states(states)

    @contextlib.contextmanager
    def fork(self, name: str = TENSOR_PARALLEL_STREAM) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the default generators are untouched."""
        if name not in self._seeds:
            raise InvalidArgumentError(f"random stream {name!r} has not been added: call psrt.tp.manual_seed(seed, "
                                       "tp_process_set) on every rank before running tensor-parallel dropout")
        saved = _default_states()
        streams = self._states[name]
        for device in saved:
            if device not in streams:  # first use on this device: the stream starts from its seed
                streams[device] = _seeded_state(device, self._seeds[name])
        _set_default_states({device: streams[device] for device in saved})
        try:
            yield
        finally:
            streams.update(_default_states())
            _set_default_states(saved)


def _seeded_state(device: str, seed: int) -> torch.Tensor:
    if device == "cpu":
        return torch.Generator().manual_seed(seed).get_state()
    return torch.Generator(device=device).manual_seed(seed).get_state()


_TRACKER = RNGStatesTracker()


def rng_tracker() -> RNGStatesTracker:
    """This process's tracker (process-wide, like torch's default generators)."""
    return _TRACKER


def manual_seed(seed: int, process_set: ProcessSet | None = None) -> None:
    """Seed torch's default generators with ``seed`` (identical on every rank of the TP set)
    and the tracker's tensor-parallel stream with ``seed + 2718 + tp_rank`` (different on
    each).  Call it on every rank, with the same ``seed``, before building the model."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ArgumentTypeError(f"seed must be an int, got {type(seed).__name__}")
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(TENSOR_PARALLEL_STREAM, seed + TENSOR_PARALLEL_SEED_OFFSET + group_rank(process_set))


def dropout_mask(shape: torch.Size | tuple[int, ...], p: float, device: torch.device) -> torch.Tensor:
    """A boolean keep-mask (one byte per element) from the current default generator, drawn
    as ``torch.nn.functional.dropout`` draws it."""
    return torch.empty(shape, dtype=torch.bool, device=device).bernoulli_(1.0 - p)


def _apply(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    return x * keep * (1.0 / (1.0 - p))


def check_probability(p: float, what: str = "dropout probability") -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise ArgumentTypeError(f"{what} must be a float, got {type(p).__name__}")
    if not 0.0 <= p < 1.0:
        raise InvalidArgumentError(f"{what} must lie in [0, 1), got {p}")
    return float(p)


def tensor_parallel_dropout(x: torch.Tensor, p: float, process_set: ProcessSet | None, training: bool = True
                            ) -> torch.Tensor:
    """Dropout inside a tensor-parallel region: each TP rank draws its own mask from the
    tracker's stream (the default generator with one process)."""
    check_probability(p)
    if not training or p == 0.0:
        return x
    if group_size(process_set) == 1 and not _TRACKER.has(TENSOR_PARALLEL_STREAM):
        return _apply(x, dropout_mask(x.shape, p, x.device), p)
    with _TRACKER.fork():
        keep = dropout_mask(x.shape, p, x.device)
    return _apply(x, keep, p)


def replicated_dropout(x: torch.Tensor, p: float, process_set: ProcessSet | None, *, sequence_parallel: bool,
                       sequence_dim: int = 1, training: bool = True) -> torch.Tensor:
    """Dropout of a tensor every TP rank holds alike, or (``sequence_parallel``) holds one
    block of along ``sequence_dim``: the mask comes from the default generator, drawn for
    the whole tensor, so every rank draws the same and keeps its own block."""
    check_probability(p)
    if not training or p == 0.0:
        return x
    size = group_size(process_set)
    if not sequence_parallel or size == 1:
        return _apply(x, dropout_mask(x.shape, p, x.device), p)
    full = list(x.shape)
    full[sequence_dim] *= size
    # a copy of this rank's block, so that backward keeps 1/size of the mask, not all of it
    keep = dropout_mask(full, p, x.device).chunk(size, sequence_dim)[group_rank(process_set)].contiguous()
    return _apply(x, keep, p)
