"""Loss scaling for float16 compute: the loss is multiplied before backward so that small
gradients do not flush to zero, and the gradients are divided back in fp32 before the step.

The dynamic scaler behaves as ``torch.amp.GradScaler``: a step whose gradients hold an inf or
NaN on any rank is skipped and the scale halved; after ``growth_interval`` good steps in a row
the scale doubles.  The overflow check is combined over the data-parallel set, since each rank
sees only its shard.
"""
from __future__ import annotations

import torch

from psrt.engine import Channel
from psrt.errors import InvalidArgumentError
from psrt.zero import comm


class LossScaler:
    def __init__(self, value: float, dynamic: bool, growth_interval: int = 2000) -> None:
        self.value, self.dynamic = float(value), dynamic
        self.growth_interval, self._good_steps = growth_interval, 0
        self._applied = False  # scale() was called since the last step: gradients carry the scale

    @classmethod
    def create(cls, loss_scale: float | str | None, compute_dtype: torch.dtype | None) -> LossScaler:
        """``None``: dynamic for float16, none otherwise; ``"dynamic"``; or a fixed positive number."""
        if loss_scale is None:
            loss_scale = "dynamic" if compute_dtype == torch.float16 else 1.0
        if loss_scale == "dynamic":
            return cls(2.0 ** 16, True)
        if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)) or not loss_scale > 0:
            raise InvalidArgumentError(f"loss_scale must be None, 'dynamic' or a positive number, got {loss_scale!r}")
        return cls(loss_scale, False)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        self._applied = True
        return loss * self.value if self.value != 1.0 else loss

    def unscale_(self, grads: list[torch.Tensor], channel: Channel) -> bool:
        """Divide ``grads`` by the scale if :meth:`scale` was used for them; False (and a lower
        scale) if a dynamic scaler found an inf or NaN on any rank of ``channel``'s set."""
        if self.dynamic:
            if comm.any_rank(channel, [torch.isfinite(grad).all().logical_not() for grad in grads], "zero.overflow"):
                self.value /= 2.0
                self._good_steps = 0
                return False
        if self._applied and self.value != 1.0:
            for grad in grads:
                grad.div_(self.value)
        return True

    def finish_step(self, taken: bool) -> None:
        """After a step (taken or skipped): grow the scale after enough good steps in a row."""
        self._applied = False
        if self.dynamic and taken:
            self._good_steps += 1
            if self._good_steps == self.growth_interval:
                self.value *= 2.0
                self._good_steps = 0

    def state_dict(self) -> dict:
        return {"value": self.value, "good_steps": self._good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.value, self._good_steps = float(state["value"]), int(state["good_steps"])
