"""When a metric adapts: during a warm-up, then never again, so that the frozen G samples the
posterior (adapting throughout, the paper's protocol ``None``, biases it: ``docs/posterior.md``).
Every path decides with :func:`adapting` on the host step count and the state's :class:`Arrival`.

``adapt_until`` is ``None`` (adapt at every step), an integer N (the first N steps adapt, then G
is frozen), or :class:`Windows`: Stan's windowed warm-up of N steps, whose last steps (the
terminal window) run with G already frozen, and whose scheduled refreshes (Shampoo's roots) also
run at the end of every slow window. The default, ``Windows(1000, arrival=True)``, also waits for
the chain: at the end of its last slow window one host read of :class:`Arrival`'s statistic asks
whether the chain is stationary, and if not the warm-up gets another slow window (twice the last
nominal one), up to 16 × its nominal length; the bias-corrected metrics (Adam) restart their
statistics at every slow window's start, as Stan does, so the frozen G is learned from the last
window alone. The restarts come from the schedule (:func:`restart_steps`; the arrival only adds
windows) and are decided inside the step from its count, on the host or, for a captured step's
device count, on the device (:func:`since_restart`): eager, sharded and captured chains restart
at the same steps. K chains held in one state (``num_chains``, :class:`sgrld.Chains`) each get their
own verdict: a chain that has arrived freezes at the window's end while the others wait on, its
statistics left as they were by the steps that still adapt the others (``adapt`` per chain:
:meth:`Arrival.chains_adapting`, applied by the step engine with no host read).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "DEFAULT_WARMUP",
    "Arrival",
    "Windows",
    "adapting",
    "after_step",
    "capped",
    "check_adapt_until",
    "closes_warmup",
    "drawn_while_adapting",
    "keep_where",
    "new_arrival",
    "restart",
    "restart_steps",
    "since_restart",
    "warmup_end",
    "warmup_length",
]


class Windows(int):
    """Stan's windowed warm-up of ``int(self)`` steps (Stan Reference Manual, "Automatic
    parameter tuning"): a fast initial window (75 steps), slow windows of 25, 50, 100, … steps
    (the last one stretched to the terminal window), and a terminal window (50 steps) in which G
    is already frozen, so the chain relaxes under its final G before the warm-up (the burn-in)
    ends. Below 150 steps the windows are 15 %, 75 % and 10 % of it, as in Stan.

    An ``int`` (its value the warm-up's nominal length), so that arithmetic on a warm-up keeps
    working; ``Windows(1000) == 1000`` but an explicit ``adapt_until=1000`` adapts for all 1,000
    steps.

    ``arrival=True`` (the default warm-up, :data:`DEFAULT_WARMUP`) waits for the chain: where the
    last slow window ends on a chain that is still travelling (:class:`Arrival`), another slow
    window of twice the last nominal one's length follows, as long as the warm-up stays within
    :attr:`CAP` × its nominal length; :meth:`slow_ends` with ``extensions`` gives that schedule.
    It also restarts a bias-corrected metric's statistics at every slow window's start
    (:func:`restart_steps`), whether or not the state can wait; a ``Windows(N)`` without
    ``arrival`` (the default before it waited, as old checkpoints hold it) restarts nothing.

    Examples:
        >>> Windows(1000).slow_ends()
        (100, 150, 250, 450, 950)
        >>> Windows(1000).adapts_until
        950
        >>> Windows(1000, arrival=True).slow_ends(extensions=2)[-3:]
        (950, 1950, 2950)
    """

    INIT, TERM, BASE = 75, 50, 25
    #: the longest a waiting warm-up gets, in multiples of its nominal length
    CAP = 16
    arrival: bool

    def __new__(cls, steps: int, arrival: bool = False) -> Windows:
        self = super().__new__(cls, steps)
        self.arrival = bool(arrival)
        return self

    def __repr__(self) -> str:
        return f"Windows({int(self)}{', arrival=True' if self.arrival else ''})"

    def __str__(self) -> str:  # messages say its length ("use burnin >= 1000")
        return str(int(self))

    def __reduce__(self) -> tuple[Any, ...]:
        # an older checkpoint's Windows(N) (no arrival) loads as it was saved
        return (Windows, (int(self), True) if self.arrival else (int(self),))

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

    def slow_ends(self, extensions: int = 0) -> tuple[int, ...]:
        """The step ending each slow window (the last one is :attr:`adapts_until`), with
        ``extensions`` more windows, each twice the last nominal one (not doubling again: the
        warm-up then ends within one such window of the chain's arrival)."""
        init, size, _ = self._parts()
        end, last, ends = init, self.adapts_until, []
        while end < last:
            # Stan: a window that would leave less than twice its doubled size is stretched
            nxt = end + size
            if nxt + 2 * size > last:
                nxt = last
            ends.append(nxt)
            end, size = nxt, 2 * size
        if extensions and ends:  # each added window twice the last nominal one
            size = 2 * (ends[-1] - (ends[-2] if len(ends) > 1 else init))
            ends += [ends[-1] + size * i for i in range(1, extensions + 1)]
        return tuple(ends)

    def slow_starts(self, extensions: int = 0) -> tuple[int, ...]:
        """The step after which each slow window begins (where Stan restarts the statistics)."""
        ends = self.slow_ends(extensions)
        return (self._parts()[0], *ends[:-1]) if ends else ()

    def can_extend(self, extensions: int) -> bool:
        """Whether one more slow window (after ``extensions``) keeps the warm-up, terminal window
        included, within :attr:`CAP` × its nominal length."""
        ends = self.slow_ends(extensions + 1)
        return self.arrival and len(ends) > 1 and ends[-1] + self._parts()[2] <= self.CAP * self


# checkpoints hold it (an optimizer's param groups) and are read with torch.load(weights_only=True)
torch.serialization.add_safe_globals([Windows])

#: The default warm-up of every adaptive metric in every API: Stan's windows over 1,000 steps (the
#: runner's default burn-in and Stan's default warm-up), G frozen after step 950 if the chain has
#: arrived by then, else after 1,950, 2,950, ... (at most 16,000 steps: :class:`Arrival`).
DEFAULT_WARMUP = Windows(1000, arrival=True)


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
    the same kind (a :class:`Windows` schedule stays windowed and waits if it waited, an
    explicit N stays N). ``sgrld.tune``'s candidates run it and ``result.options`` carries it:
    a waiting warm-up keeps adapting a chain still in its transient past ``steps`` rather than
    freeze G there (``docs/results/tuning_mnist.md``: frozen at a quarter of the run, one
    RMSprop chain in four diverged; waiting, none did)."""
    if adapt_until is None:
        return None
    length = min(int(adapt_until), steps)
    if isinstance(adapt_until, Windows):
        return Windows(length, arrival=adapt_until.arrival)
    return length


def _extensions(arrival: Arrival | None) -> int:
    return 0 if arrival is None else arrival.extensions


def warmup_end(adapt_until: int | None, arrival: Arrival | None = None) -> int | None:
    """The last step that adapts (``None``: every step does): ``adapt_until``, or with
    :class:`Windows` the end of its last slow window as ``arrival`` extended it so far."""
    if isinstance(adapt_until, Windows):
        ends = adapt_until.slow_ends(_extensions(arrival))
        return ends[-1] if ends else adapt_until.adapts_until
    return adapt_until


def warmup_length(adapt_until: int | None, arrival: Arrival | None = None) -> int | None:
    """The warm-up's length as it stands: ``adapt_until`` itself, or once ``arrival`` added
    windows, the end of the last one plus the terminal window (the burn-in it needs)."""
    if not isinstance(adapt_until, Windows) or not _extensions(arrival):
        return adapt_until
    end = warmup_end(adapt_until, arrival)
    assert end is not None
    return end + adapt_until._parts()[2]


def adapting(steps_taken: int, adapt_until: int | None, arrival: Arrival | None = None) -> bool:
    """Whether step ``steps_taken + 1`` updates the metric: steps 1, …, ``adapt_until`` do (and
    their due refreshes run), with :class:`Windows` all but its terminal window (after the
    windows ``arrival`` added); 0 never adapts."""
    end = warmup_end(adapt_until, arrival)
    return end is None or steps_taken < end


def drawn_while_adapting(
    metric: Any,
    steps_taken: int,
    adapt_until: int | None,
    adapt: bool = True,
    arrival: Arrival | None = None,
) -> bool:
    """Whether a sample after ``steps_taken`` steps was drawn while ``metric`` still adapted (G = I
    has nothing to adapt; ``adapt=False``: frozen by the user).
    """
    last = steps_taken - 1
    return (
        steps_taken > 0 and adapt and metric.preconditions and adapting(last, adapt_until, arrival)
    )


def closes_warmup(
    metric: Any, step: int, adapt_until: int | None, arrival: Arrival | None = None
) -> bool:
    """Whether step ``step`` ends the warm-up (or, with :class:`Windows`, a slow window) off the
    refresh schedule, so the scheduled part (Shampoo's roots) is refreshed once more now, else
    the frozen G would be stale (or I).
    """
    interval = metric.refresh_interval
    if interval is None or adapt_until is None or step % interval == 0:
        return False
    if isinstance(adapt_until, Windows):
        return step in adapt_until.slow_ends(_extensions(arrival))
    return step == adapt_until > 0


# --- waiting for the chain --------------------------------------------------------------------

#: coordinates tracked per group (a fixed strided subsample: no O(D) memory, a few kernels a step)
TRACKED = 256
#: a coordinate has arrived when its half-window means differ by less than ``RATIO`` × its
#: within-half standard deviation (steady travel across the window gives √12 ≈ 3.5, a stationary
#: chain ~√(2·τ/n) ≪ 1); a chain, when at least ``QUORUM`` of its tracked coordinates have
#: (``docs/posterior.md``: the measurements behind both)
RATIO, QUORUM = 2.0, 0.9


@dataclass
class Arrival:
    """Whether a chain has arrived: over the last slow window of its :class:`Windows` schedule,
    the sums and sums of squares of :data:`TRACKED` strided coordinates in each half of the window,
    kept on the device (no host read per step); one host read at the window's end.

    Attributes:
        schedule: the warm-up (``arrival=True``).
        picks: per parameter tensor, the flat indices tracked in it (from the layout: not state).
        sums: ``(5, *batch, m)``: the window's first x₁, then Σ(x − x₁) and Σ(x − x₁)² of the
            first half and of the second (at least float32, whatever the parameters' dtype).
        count: int64 of the batch shape (host memory): per chain, the slow windows added for it
            (a chain that arrived keeps its count while the others' grow).
    """

    schedule: Windows
    picks: list[tuple[int, Tensor]]
    sums: Tensor
    count: Tensor
    #: the last per-chain mask of :meth:`chains_adapting` (its flags, its device tensor)
    _mask: tuple[tuple[bool, ...], Tensor] | None = field(default=None, repr=False, compare=False)

    @property
    def extensions(self) -> int:
        """The windows added so far for the chains still waiting (the state's schedule)."""
        return int(self.count.max())

    def freeze_steps(self) -> list[int]:
        """Per chain (flattened), the last step that adapts its metric as its warm-up stands."""
        return [self.schedule.slow_ends(c)[-1] for c in self.count.reshape(-1).tolist()]

    def chains_adapting(self, steps_taken: int) -> Tensor | None:
        """Per chain, whether step ``steps_taken + 1`` updates its metric: a bool device tensor of
        the batch shape where the chains disagree (some froze at an earlier window's end), else
        ``None`` (they all do as :func:`adapting` says). From host counts: no device read."""
        if self.count.dim() == 0:
            return None
        counts = self.count.reshape(-1).tolist()
        if min(counts) == max(counts):
            return None
        ends = {c: self.schedule.slow_ends(c)[-1] for c in set(counts)}
        flags = tuple(steps_taken < ends[c] for c in counts)
        if all(flags) or not any(flags):
            return None
        if self._mask is None or self._mask[0] != flags:  # changes at a window's end only
            mask = torch.tensor(flags, device=self.sums.device).reshape(self.count.shape)
            self._mask = (flags, mask)
        return self._mask[1]

    def window(self) -> tuple[int, int]:
        """The last slow window of the schedule so far: the steps after its start to its end."""
        ends = self.schedule.slow_ends(self.extensions)
        return self.schedule.slow_starts(self.extensions)[-1], ends[-1]

    def observe(self, params: Sequence[Tensor], steps_taken: int) -> None:
        """Add the tracked coordinates after step ``steps_taken`` to their half's sums."""
        start, end = self.window()
        if not start < steps_taken <= end:
            return
        half = 1 if steps_taken <= (start + end) // 2 else 3
        batch = self.sums.shape[1:-1]
        x = torch.cat(
            [params[i].reshape(*batch, -1).index_select(-1, at) for i, at in self.picks], dim=-1
        ).to(self.sums.dtype)
        if steps_taken == start + 1:  # sums of x − x₁: no cancellation in Σx² − (Σx)²/n
            self.sums[0].copy_(x)
        x = x.sub_(self.sums[0])
        self.sums[half].add_(x)
        self.sums[half + 1].addcmul_(x, x)

    def arrived(self) -> bool:
        """Whether every chain has arrived (one host read), at the window's end."""
        return bool(self.verdicts().all())

    def verdicts(self) -> Tensor:
        """Per chain, whether it has arrived: a host bool tensor of the batch shape (one read)."""
        start, end = self.window()
        n1 = (start + end) // 2 - start
        n2 = end - start - n1
        mean1, mean2 = self.sums[1] / n1, self.sums[3] / n2
        var1 = (self.sums[2] / n1 - mean1 * mean1).clamp_(min=0.0)
        var2 = (self.sums[4] / n2 - mean2 * mean2).clamp_(min=0.0)
        gap = (mean2 - mean1).abs()
        # a coordinate that never moved (sd 0, gap 0) has arrived
        settled = (gap <= RATIO * ((var1 + var2) / 2).sqrt()).to(torch.float64)
        return (settled.mean(dim=-1) >= QUORUM).cpu()


def new_arrival(
    metric: Any,
    adapt_until: int | None,
    params: Sequence[Tensor],
    batch_shape: tuple[int, ...],
    eligible: bool = True,
) -> Arrival | None:
    """The :class:`Arrival` of a new state, if its warm-up waits: a :class:`Windows` with
    ``arrival=True``, a metric that adapts, and a step that may read the host at a window's end
    (``eligible``: not captured, not sharded)."""
    if not (isinstance(adapt_until, Windows) and adapt_until.arrival and eligible):
        return None
    if not metric.preconditions or not adapt_until.slow_ends():
        return None
    numels = [math.prod(p.shape[len(batch_shape) :]) for p in params]
    total = sum(numels)
    stride = -(-total // TRACKED)  # ceil: at most TRACKED coordinates
    picks, offset = [], 0
    for i, numel in enumerate(numels):
        first = -offset % stride  # the first multiple of the stride in this tensor
        if first < numel:
            at = torch.arange(first, numel, stride, device=params[i].device)
            picks.append((i, at))
        offset += numel
    tracked = sum(len(at) for _, at in picks)
    like = params[0]
    dtype = torch.promote_types(like.dtype, torch.float32)
    sums = torch.zeros((5, *batch_shape, tracked), dtype=dtype, device=like.device)
    count = torch.zeros(batch_shape, dtype=torch.int64)
    return Arrival(adapt_until, picks, sums, count)


def after_step(metric: Any, state: Any) -> None:
    """The warm-up's part of the host schedule after a step of ``state`` (a
    :class:`~sgrld.core.state.SamplerState`): the tracked coordinates summed; at the end of the
    last slow window, one host read, and another window for each chain that has not arrived (the
    restarts at the windows' starts are the step's own: :func:`since_restart`)."""
    arrival = state.warmup
    if arrival is None:
        return
    steps = state.step
    arrival.observe(list(state.params.values()), steps)
    last = arrival.window()[1]
    if steps == last and arrival.schedule.can_extend(arrival.extensions):
        # the one host read of a window; only the chains still waiting are judged
        travelling = (arrival.count == arrival.extensions) & ~arrival.verdicts()
        if bool(travelling.any()):
            arrival.count += travelling.to(torch.int64)
            arrival.sums.zero_()


def restart_steps(
    metric: Any, adapt_until: int | None, arrival: Arrival | None = None
) -> tuple[int, ...]:
    """The steps after which ``metric`` restarts its statistics: with a waiting schedule
    (``Windows(N, arrival=True)``, the default) and a metric that restarts (a bias-corrected
    second moment), every slow window's start, the windows ``arrival`` added included; else none
    (an explicit ``Windows(N)`` or N keeps its statistics across the warm-up, as before restarts
    existed). The same steps whether the state waits for its chain or cannot (sharded, captured):
    until a waiting chain's first extension, all of them are one chain."""
    if not (
        isinstance(adapt_until, Windows)
        and adapt_until.arrival
        and metric.preconditions
        and bool(getattr(metric, "restarts", False))
    ):
        return ()
    return adapt_until.slow_starts(_extensions(arrival))


#: the restart steps as device tensors, made by an eager step before any step is captured
_STARTS: dict[tuple[tuple[int, ...], torch.device], Tensor] = {}


def since_restart(
    restarts: tuple[int, ...], count: int | Tensor
) -> tuple[int | Tensor, bool | Tensor]:
    """For step ``count`` (1, 2, ...; a host int or a 0-d int64 device tensor, a captured step's
    count), the step its statistics were last restarted after (0: never), which a bias-corrected
    metric counts its steps from, and whether they restart before it (``count − 1`` in
    ``restarts``). A device count gets device answers (a comparison with the restart steps, no
    host read), so eager, sharded and captured steps restart at the same steps."""
    if isinstance(count, int):
        return max((s for s in restarts if s < count), default=0), count - 1 in restarts
    if torch.compiler.is_compiling():  # traced: a constant of the graph
        at = torch.tensor(restarts, dtype=torch.int64, device=count.device)
    else:
        key = (restarts, count.device)
        if key not in _STARTS:
            if len(_STARTS) > 64:  # a few schedules per process; never grows without bound
                _STARTS.clear()
            _STARTS[key] = torch.tensor(restarts, dtype=torch.int64, device=count.device)
        at = _STARTS[key]
    origin = torch.where(at < count, at, 0).amax()
    return origin, (at == count - 1).any()


def restart(
    metric: Any, stats: dict[str, Tensor], layout: Any, now: bool | Tensor, chains: Tensor | None
) -> None:
    """The restart of :func:`since_restart`'s verdict ``now`` (host or device) in the chains that
    adapt (``chains``: a bool of the batch shape, ``None``: all): a frozen chain's statistics are
    left as they are."""
    if now is False:
        return
    if now is True and chains is None:
        metric.restart(stats, layout)
        return
    where = chains if now is True else now if chains is None else now & chains
    assert where is not None
    metric.restart(stats, layout, where=where)


def keep_where(stats: dict[str, Tensor], before: dict[str, Tensor], mask: Tensor) -> None:
    """Per chain, the statistics as in ``stats`` where ``mask`` (a bool of the batch shape)
    holds, else as in ``before`` (in place; every statistic leads with the batch dimensions)."""
    for k, v in stats.items():
        keep = mask.reshape(*mask.shape, *([1] * (v.dim() - mask.dim())))
        v.copy_(torch.where(keep, v, before[k]))
