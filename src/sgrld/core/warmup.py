"""When a metric adapts: during a warm-up of ``adapt_until`` steps, then never again.

An adaptive metric whose statistics keep following the stochastic gradient makes G a function
of the recent path of θ, while the step drops Γ (``docs/conventions.md``): the chain then samples
a different law from the posterior (``docs/posterior.md`` measures by how much). Adapting during
a warm-up and then freezing G, as Stan and every HMC library adapt their mass matrix, keeps the
posterior exact up to the discretisation. ``adapt_until=None`` is the paper's protocol: adapt at
every step.

Every path decides with :func:`adapting` on the host step count, so the facade, the functional
sampler, :class:`~sgrld.Chains` and the runner freeze G at the same step.
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
    """Whether the next step (number ``steps_taken + 1``) updates the metric's statistics.

    Steps 1, …, ``adapt_until`` adapt (and a scheduled refresh due at one of them runs, so that
    Shampoo's roots are last computed at the warm-up's last refresh); later steps use G as it
    was after step ``adapt_until``. ``adapt_until=0`` never adapts (G stays at its initial value).
    """
    return adapt_until is None or steps_taken < adapt_until


def drawn_while_adapting(
    metric: Any, steps_taken: int, adapt_until: int | None, adapt: bool = True
) -> bool:
    """Whether a sample of the chain after ``steps_taken`` steps was drawn while ``metric``
    still adapted: its last step updated G (G = I has nothing to adapt; ``adapt=False``: the
    user froze it). The one answer of the optimizer, :class:`~sgrld.Chains` and the runner."""
    last = steps_taken - 1
    return steps_taken > 0 and adapt and metric.preconditions and adapting(last, adapt_until)


def closes_warmup(metric: Any, step: int, adapt_until: int | None) -> bool:
    """Whether step ``step`` ends the warm-up off the metric's refresh schedule, so that its
    scheduled part (Shampoo's inverse roots) must be refreshed once more now: else the frozen
    G would be the one of the last scheduled refresh, or I when the warm-up is shorter than
    the interval (Shampoo with a 20-step warm-up and roots every 100 steps would be SGLD)."""
    interval = metric.refresh_interval
    return (
        interval is not None
        and adapt_until is not None
        and step == adapt_until > 0
        and step % interval != 0
    )
