"""When a metric adapts: during a warm-up of ``adapt_until`` steps, then never again, so that the
frozen G samples the posterior (adapting throughout, the paper's protocol ``None``, biases it:
``docs/posterior.md``). Every path decides with :func:`adapting` on the host step count.
"""

from __future__ import annotations

from typing import Any

#: Steps of warm-up by default: the runner's default burn-in (and Stan's default warm-up).
DEFAULT_WARMUP = 1000

__all__ = [
    "DEFAULT_WARMUP",
    "adapting",
    "check_adapt_until",
    "closes_warmup",
    "drawn_while_adapting",
]


def check_adapt_until(adapt_until: int | None) -> None:
    """Refuse anything but ``None`` (always adapt) or an integer ≥ 0 (steps of warm-up)."""
    if adapt_until is None:
        return
    if isinstance(adapt_until, bool) or not isinstance(adapt_until, int) or adapt_until < 0:
        raise ValueError(
            f"invalid adapt_until: {adapt_until!r} (expected None, to adapt at every step, or "
            "an integer >= 0: the steps of warm-up after which the metric is frozen)"
        )


def adapting(steps_taken: int, adapt_until: int | None) -> bool:
    """Whether step ``steps_taken + 1`` updates the metric: steps 1, …, ``adapt_until`` do (and
    their due refreshes run); 0 never adapts."""
    return adapt_until is None or steps_taken < adapt_until


def drawn_while_adapting(
    metric: Any, steps_taken: int, adapt_until: int | None, adapt: bool = True
) -> bool:
    """Whether a sample after ``steps_taken`` steps was drawn while ``metric`` still adapted (G = I
    has nothing to adapt; ``adapt=False``: frozen by the user).
    """
    last = steps_taken - 1
    return steps_taken > 0 and adapt and metric.preconditions and adapting(last, adapt_until)


def closes_warmup(metric: Any, step: int, adapt_until: int | None) -> bool:
    """Whether step ``step`` ends the warm-up off the refresh schedule, so the scheduled part
    (Shampoo's roots) is refreshed once more now, else the frozen G would be stale (or I).
    """
    interval = metric.refresh_interval
    return (
        interval is not None
        and adapt_until is not None
        and step == adapt_until > 0
        and step % interval != 0
    )
