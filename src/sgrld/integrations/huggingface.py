"""What ``transformers.Trainer`` changes in a chain, said once.

``Trainer`` runs any ``torch.optim`` optimizer, an sgrld sampler included, but with its defaults
it is no longer the sampler's chain: it decays ℓ linearly to 0 after every step
(``lr_scheduler_type="linear"``) and rescales any gradient whose norm exceeds 1.0
(``max_grad_norm=1.0``) while the noise stays as it was. Every :class:`sgrld.SGRLDOptimizer`
carries a :class:`TrainerWatch` (a ``torch.optim`` step pre-hook) that sees both from the
``Trainer`` that calls it and warns once each; the recipe is ``TrainingArguments(...,
lr_scheduler_type="constant", max_grad_norm=0)``, or a schedule of the library's own
(``optimizers=(sampler, sgrld.CyclicalLR(...))``). ``docs/huggingface.md``.

Nothing here imports ``transformers``: outside a ``Trainer`` the hook costs one look at the
call stack, at the first step only (none inside a traced step).
"""

from __future__ import annotations

import sys
import warnings
from types import FrameType
from typing import Any

import torch

__all__ = ["TrainerWatch"]

#: how far up the call stack the ``Trainer``'s training loop is looked for
_DEPTH = 30

#: the recipe every warning ends with
RECIPE = (
    "for the sampler's own chain: TrainingArguments(lr_scheduler_type='constant', "
    "max_grad_norm=0), or optimizers=(sampler, sgrld.CyclicalLR(...)) (docs/huggingface.md)"
)


def _trainer_frame() -> FrameType | None:
    """The frame of ``transformers.Trainer``'s training loop that is stepping, if any."""
    if "transformers.trainer" not in sys.modules:
        return None
    frame = sys._getframe(1)
    for _ in range(_DEPTH):
        if frame.f_back is None:
            return None
        frame = frame.f_back
        if frame.f_globals.get("__name__") == "transformers.trainer" and "self" in frame.f_locals:
            return frame
    return None


class TrainerWatch:
    """A step pre-hook warning once where a ``transformers.Trainer`` changed the chain.

    Before each step under a ``Trainer``: ℓ of a group changed since the last step by a
    scheduler that is not the library's (Trainer's default linear decay to 0), or the gradient
    was clipped (``max_grad_norm``: the norm the ``Trainer`` measured exceeded it). Each is
    warned once per optimizer. Outside a ``Trainer`` (seen at the first step) it does nothing.

    Example:
        >>> import torch, sgrld
        >>> from sgrld.integrations.huggingface import TrainerWatch
        >>> w = torch.zeros(3, requires_grad=True)
        >>> opt = torch.optim.SGD([w], lr=0.1)
        >>> handle = opt.register_step_pre_hook(TrainerWatch())  # sgrld's samplers carry one
    """

    def __init__(self) -> None:
        self.active: bool | None = None  # None: not yet stepped; False: no Trainer
        self.lrs: list[float] | None = None
        self.warned: set[str] = set()

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.active is False or torch.compiler.is_compiling():  # no Trainer traces a step
            return
        frame = _trainer_frame()
        if self.active is None:
            self.active = frame is not None
        if frame is None:
            return
        trainer = frame.f_locals["self"]
        lrs = [float(g["lr"]) for g in optimizer.param_groups]
        if self.lrs is not None and lrs != self.lrs and not _own_schedule(trainer):
            self._warn(
                "lr",
                f"sgrld: transformers.Trainer changed ℓ (lr) between steps, {self.lrs[0]:.4g} → "
                f"{lrs[0]:.4g}: its scheduler (by default lr_scheduler_type='linear', a decay "
                "to 0) makes every step a different chain's, and the last ones hardly move; "
                + RECIPE,
            )
        self.lrs = lrs
        limit = float(getattr(getattr(trainer, "args", None), "max_grad_norm", 0.0) or 0.0)
        norm = frame.f_locals.get("grad_norm")  # the norm before clipping (Trainer's own)
        if limit > 0.0 and norm is not None and float(norm) > limit:
            self._warn(
                "clip",
                f"sgrld: transformers.Trainer clipped the gradient's norm from {float(norm):.4g} "
                f"to {limit:g} (max_grad_norm): the sampler then follows a rescaled gradient "
                "with unscaled noise, which is not the posterior's chain; " + RECIPE,
            )

    def _warn(self, kind: str, message: str) -> None:
        if kind not in self.warned:
            self.warned.add(kind)
            warnings.warn(message, UserWarning, stacklevel=4)


def _own_schedule(trainer: Any) -> bool:
    """Whether the ``Trainer``'s scheduler is one of the library's (``sgrld.schedules``)."""
    scheduler = getattr(trainer, "lr_scheduler", None)
    scheduler = getattr(scheduler, "scheduler", scheduler)  # accelerate's wrapper, if any
    return type(scheduler).__module__.startswith("sgrld.")
