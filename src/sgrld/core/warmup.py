"""When a metric adapts: during a warm-up, then never again, so that the frozen G samples the
posterior (adapting throughout, the paper's protocol ``None``, biases it: ``docs/posterior.md``).
Every path decides with :func:`adapting` on the host step count.

``adapt_until`` is ``None`` (adapt at every step), an integer N (the first N steps adapt, then G
is frozen), or :class:`Windows` (the default): Stan's windowed warm-up of N steps, whose last
steps (the terminal window) run with G already frozen, and whose scheduled refreshes (Shampoo's
roots) also run at the end of every slow window.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "DEFAULT_WARMUP",
    "Windows",
    "adapting",
    "capped",
    "check_adapt_until",
    "closes_warmup",
    "drawn_while_adapting",
]


class Windows(int):
    """Stan's windowed warm-up of ``int(self)`` steps (Stan Reference Manual, "Automatic
    parameter tuning"): a fast initial window (75 steps), slow windows of 25, 50, 100, … steps
    (the last one stretched to the terminal window), and a terminal window (50 steps) in which G
    is already frozen, so the chain relaxes under its final G before the warm-up (the burn-in)
    ends. Below 150 steps the windows are 15 %, 75 % and 10 % of it, as in Stan.

    An ``int`` (its value the warm-up's length), so that arithmetic on a warm-up keeps working;
    ``Windows(1000) == 1000`` but an explicit ``adapt_until=1000`` adapts for all 1,000 steps.

    Examples:
        >>> Windows(1000).slow_ends()
        (100, 150, 250, 450, 950)
        >>> Windows(1000).adapts_until
        950
    """

    INIT, TERM, BASE = 75, 50, 25

    def __repr__(self) -> str:
        return f"Windows({int(self)})"

    def __str__(self) -> str:  # messages say its length ("use burnin >= 1000")
        return str(int(self))

    def __reduce__(self) -> tuple[Any, ...]:
        return (Windows, (int(self),))

    def _parts(self) -> tuple[int, int, int]:
        """(fast initial window, first slow window, terminal window) in steps."""
        total = int(self)
        if total >= self.INIT + self.TERM + self.BASE:
            return self.INIT, self.BASE, self.TERM
        init, term = int(0.15 * total), int(0.1 * total)
        return init, total - init - term, term

    @property
    def adapts_until(self) -> int:
        """The steps that adapt: all but the terminal window."""
        return int(self) - self._parts()[2]

    def slow_ends(self) -> tuple[int, ...]:
        """The step ending each slow window (the last one is :attr:`adapts_until`)."""
        init, size, _ = self._parts()
        end, last, ends = init, self.adapts_until, []
        while end < last:
            # Stan: a window that would leave less than twice its doubled size is stretched
            nxt = end + size
            if nxt + 2 * size > last:
                nxt = last
            ends.append(nxt)
            end, size = nxt, 2 * size
        return tuple(ends)


# checkpoints hold it (an optimizer's param groups) and are read with torch.load(weights_only=True)
torch.serialization.add_safe_globals([Windows])

#: The default warm-up of every adaptive metric in every API: Stan's windows over 1,000 steps (the
#: runner's default burn-in and Stan's default warm-up), G frozen after step 950.
DEFAULT_WARMUP = Windows(1000)


def check_adapt_until(adapt_until: int | None) -> None:
    """Refuse anything but ``None`` (always adapt) or an integer ≥ 0 (steps of warm-up)."""
    if adapt_until is None:
        return
    if isinstance(adapt_until, bool) or not isinstance(adapt_until, int) or adapt_until < 0:
        raise ValueError(
            f"invalid adapt_until: {adapt_until!r} (expected None, to adapt at every step, or "
            "an integer >= 0: the steps of warm-up after which the metric is frozen)"
        )


def capped(adapt_until: int | None, steps: int) -> int | None:
    """The warm-up ``adapt_until`` for a chain of ``steps`` steps: at most ``steps`` long and of
    the same kind (a :class:`Windows` schedule stays windowed, an explicit N stays N)."""
    if adapt_until is None:
        return None
    length = min(int(adapt_until), steps)
    return Windows(length) if isinstance(adapt_until, Windows) else length


def _last_adapting(adapt_until: int) -> int:
    return adapt_until.adapts_until if isinstance(adapt_until, Windows) else adapt_until


def adapting(steps_taken: int, adapt_until: int | None) -> bool:
    """Whether step ``steps_taken + 1`` updates the metric: steps 1, …, ``adapt_until`` do (and
    their due refreshes run), with :class:`Windows` all but its terminal window; 0 never adapts."""
    return adapt_until is None or steps_taken < _last_adapting(adapt_until)


def drawn_while_adapting(
    metric: Any, steps_taken: int, adapt_until: int | None, adapt: bool = True
) -> bool:
    """Whether a sample after ``steps_taken`` steps was drawn while ``metric`` still adapted (G = I
    has nothing to adapt; ``adapt=False``: frozen by the user).
    """
    last = steps_taken - 1
    return steps_taken > 0 and adapt and metric.preconditions and adapting(last, adapt_until)


def closes_warmup(metric: Any, step: int, adapt_until: int | None) -> bool:
    """Whether step ``step`` ends the warm-up (or, with :class:`Windows`, a slow window) off the
    refresh schedule, so the scheduled part (Shampoo's roots) is refreshed once more now, else
    the frozen G would be stale (or I).
    """
    interval = metric.refresh_interval
    if interval is None or adapt_until is None or step % interval == 0:
        return False
    if isinstance(adapt_until, Windows):
        return step in adapt_until.slow_ends()
    return step == adapt_until > 0
