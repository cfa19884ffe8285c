"""Autotuning of the fusion threshold and the cycle time on the job's own steps
(``PSRT_AUTOTUNE=1``, Horovod's ``HOROVOD_AUTOTUNE``).

After ``warmup_samples`` samples, each candidate setting runs for a sample of
``steps_per_sample`` training steps and is scored by the bytes allreduced per second;
the best is kept for the rest of the job.  The search is a coordinate search, not
Horovod's Bayesian optimisation: every fusion threshold at the starting cycle time, then
every cycle time at the best threshold, a dozen samples in all (the two settings barely
interact: the threshold decides how a cycle's tensors are grouped, the cycle time how
many are ready in it).

Every rank must fuse alike (the fusion plan is computed on each rank from the agreed
responses), so every rank must switch settings at the same response.  Steps are counted
from what the engine executed, which is the same list on every rank: a step ends where a
tensor name of the current step comes again.  Scores are timed on each rank but rank 0's
is shared (``share``) at the end of each sample, so the search takes the same path
everywhere.
"""
from __future__ import annotations

import csv
import time
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Sequence

_MiB = 1 << 20
FUSION_THRESHOLDS = (0, 1 * _MiB, 4 * _MiB, 16 * _MiB, 64 * _MiB, 128 * _MiB)
CYCLE_TIMES_MS = (0.5, 1.0, 2.5, 5.0)
_COLUMNS = ("sample", "phase", "fusion_threshold_bytes", "cycle_time_ms", "steps", "bytes", "seconds",
            "score_bytes_per_s")


@dataclass(frozen=True)
class Setting:
    fusion_threshold: int
    cycle_time_ms: float


class CoordinateSearch:
    """Candidates in a fixed order: each threshold (at ``start``'s cycle time), then each
    cycle time at the best threshold.  :meth:`record` scores the current candidate and moves
    on; once all are scored, :attr:`best` is the result."""

    def __init__(self, start: Setting, thresholds: Sequence[int] = FUSION_THRESHOLDS,
                 cycles: Sequence[float] = CYCLE_TIMES_MS) -> None:
        self._cycles = cycles
        self._pending = [Setting(t, start.cycle_time_ms) for t in thresholds]
        self._cycles_queued = False
        self.scores: dict[Setting, float] = {}
        self.current: Setting | None = self._pending.pop(0)

    def record(self, score: float) -> Setting | None:
        """Score the current candidate; returns the next one, or None when the search is over."""
        assert self.current is not None, "the search is over"
        self.scores[self.current] = max(score, self.scores.get(self.current, score))
        if not self._pending and not self._cycles_queued:
            self._cycles_queued = True
            threshold = self.best.fusion_threshold
            self._pending = [s for s in (Setting(threshold, c) for c in self._cycles) if s not in self.scores]
        self.current = self._pending.pop(0) if self._pending else None
        return self.current

    @property
    def best(self) -> Setting:
        return max(self.scores, key=self.scores.get)


class Autotuner:
    """Feeds on what the engine executed; says when to switch settings (the engine applies
    :attr:`setting` from the start).

    ``share`` turns this rank's score into rank 0's (a broadcast: collective, and called at
    the same response on every rank); ``log`` is a CSV path written on rank 0 ("" for none).
    """

    def __init__(self, start: Setting, *, warmup_samples: int, steps_per_sample: int,
                 share: Callable[[float], float], rank: int, log: str = "",
                 clock: Callable[[], float] = time.perf_counter,
                 search: CoordinateSearch | None = None) -> None:
        self._search = search if search is not None else CoordinateSearch(start)
        self._warmup, self._steps_per_sample = warmup_samples, steps_per_sample
        self._share, self._clock = share, clock
        self._log = open(log, "w", newline="", encoding="utf-8") if log and rank == 0 else None
        if self._log is not None:
            csv.writer(self._log).writerow(_COLUMNS)
        self._seen: set[Hashable] = set()  # names of the current step
        self._samples = self._steps = self._bytes = 0
        self._start: float | None = None
        self.setting = self._search.current  # from the start: warm-up samples run the first candidate
        self.done = False

    def observe(self, reduced: Iterable[tuple[Hashable, int]]) -> Setting | None:
        """Note allreduces just executed, as (name or key, bytes), in the agreed order; returns the
        setting to switch to now, if a sample ended with a new one."""
        switch = None
        for name, nbytes in reduced:
            if self._start is None:
                self._start = self._clock()
            if name in self._seen:  # a new step begins
                self._seen.clear()
                self._steps += 1
                if self._steps == self._steps_per_sample:
                    switch = self._end_sample() or switch
                    if self.done:
                        return switch
            self._seen.add(name)
            self._bytes += nbytes
        return switch

    def _end_sample(self) -> Setting | None:
        now = self._clock()
        seconds = now - self._start
        score = self._share(self._bytes / seconds if seconds > 0 else 0.0)
        warming = self._samples < self._warmup
        phase = "warm-up" if warming else "trial"
        self._write(self._samples, phase, self.setting, self._steps, self._bytes, seconds, score)
        self._samples += 1
        self._steps = self._bytes = 0
        self._start = now
        if warming:
            return None
        following = self._search.record(score)
        if following is None:
            following, self.done = self._search.best, True
            self._write(self._samples, "settled", following, 0, 0, 0.0, self._search.scores[following])
            if self._log is not None:
                self._log.close()
        changed = following != self.setting
        self.setting = following
        return following if changed else None

    def _write(self, sample: int, phase: str, setting: Setting, steps: int, nbytes: int, seconds: float,
               score: float) -> None:
        if self._log is not None:
            csv.writer(self._log).writerow((sample, phase, setting.fusion_threshold, setting.cycle_time_ms, steps,
                                            nbytes, f"{seconds:.6f}", f"{score:.1f}"))
            self._log.flush()
