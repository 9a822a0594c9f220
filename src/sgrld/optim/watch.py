"""The figures an optimizer sums on the device: telemetry, and :func:`sgrld.health`'s watch (one
step in ``WATCH_EVERY``, read once per ``WATCH_WINDOW``, with a snapshot of the window's sums
every ``PART_WATCHED`` on the device: :mod:`sgrld.chain_health`); under FSDP the rank's sums are
summed over the mesh at the read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from sgrld.chain_health import PART_WATCHED, SHORT_PARTS, WATCH_EVERY, WATCH_WINDOW, Health, Watch
from sgrld.core.shards import ShardSpec
from sgrld.core.warmup import DEFAULT_WARMUP, warmup_length
from sgrld.optim.groups import Owner

#: steps between two closes of the watch's window
WINDOW_STEPS = WATCH_EVERY * WATCH_WINDOW
#: the state dict's entry of the watch's first window (the growth reference, kept on a resume)
WATCH_KEY = "health_watch"


def new_sums(device: torch.device) -> Tensor:
    return torch.zeros(4, dtype=torch.float64, device=device)


def chain_sums(sums_of: Sequence[Sequence[float]]) -> list[float]:
    """The chain's sums from its groups': the squares add; the step count is each group's (the
    groups step together)."""
    total = [sum(column) for column in zip(*sums_of, strict=True)]
    total[3] = sums_of[0][3]
    return total


def over_the_mesh(
    shards: ShardSpec, sums: Tensor, diagnostics: dict[str, Tensor]
) -> tuple[Tensor, dict[str, Tensor]]:
    """A sharded group's figures for the whole chain: sums over the ranks, metric figures'
    maximum.
    """
    import torch.distributed as dist

    shards.sum_(sums[:3])  # the step count is every rank's
    if diagnostics:
        names = sorted(diagnostics)
        peaks = torch.stack([diagnostics[n].to(sums.device, torch.float64) for n in names])
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=shards.mesh.get_group())
        diagnostics = dict(zip(names, peaks.unbind(), strict=True))
    return sums, diagnostics


#: the fewest steps an ℓ verdict rests on: :data:`~sgrld.chain_health.SHORT_PARTS` parts
SHORT_STEPS = SHORT_PARTS * PART_WATCHED * WATCH_EVERY


def settled(steps: int, adapt_until: int | None) -> bool:
    """Past the warm-up and :data:`SHORT_STEPS`: only then is ℓ judged (a run shorter than its
    warm-up never sampled with its final G, and gets no ℓ verdict)."""
    return steps > max(DEFAULT_WARMUP if adapt_until is None else int(adapt_until), SHORT_STEPS)


def chain_settled(opt: Owner, steps: int) -> bool:
    """:func:`settled` for the optimizer's chain, past its warm-up as it stands (extended while
    the chain travelled); a metric that adapts nothing (G = I, or frozen) has none to wait for."""
    group = opt.param_groups[0]
    if not (group["adapt_metric"] and opt.group_metrics[0].preconditions):
        return settled(steps, 0)
    return settled(steps, warmup_length(group["adapt_until"], opt.sampler_states[0].warmup))


def first_window(saved: Any) -> dict[str, float] | None:
    """The watch's first window from a state dict (``None``: none, or a dict from before)."""
    if saved is None:
        return None
    if not isinstance(saved, Mapping) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in saved.values()
    ):
        raise ValueError(f"{WATCH_KEY!r}: not a mapping of figures to floats")
    return {str(k): float(v) for k, v in saved.items()}


class HealthWatch(Watch):
    """One optimizer's watch, a post-step hook (``register_step_post_hook``): the rule's windows
    (:class:`sgrld.chain_health.Watch`) and the open window's sums per parameter group, with a
    copy of them (on the device, no read) at the end of each of its parts."""

    def __init__(self, first: dict[str, float] | None = None) -> None:
        super().__init__(first=first)
        self.sums: dict[int, Tensor] = {}  # per group: the open window's
        self.marks: dict[int, list[Tensor]] = {}  # per group: the sums at each part's end
        self.counts: dict[int, int] = {}  # per group: watched steps in the open window
        self.open_parts: list[dict[str, float]] = []  # the complete parts at the last read

    def __call__(self, opt: Owner, args: Any, kwargs: Any) -> None:
        """After a step: add the sums it recorded to the window; every :data:`WINDOW_STEPS` steps
        judge the window, warning once per verdict (the step is done then), and start a new one."""
        if opt.recorded is None:
            return
        for index, step in enumerate(opt.recorded):
            self.add(index, step)
        if opt.num_steps % WINDOW_STEPS == 0:
            window, settled = self.read(opt), chain_settled(opt, opt.num_steps)
            for acc in self.sums.values():
                acc.zero_()
            self.marks, self.counts = {}, {}
            if window is not None:
                self.warn(self.close(window, settled, self.open_parts))

    def add(self, index: int, step: Tensor) -> None:
        """Add group ``index``'s sums of a watched step to the window."""
        if index not in self.sums:
            self.sums[index] = torch.zeros_like(step)
        self.sums[index].add_(step)
        self.counts[index] = self.counts.get(index, 0) + 1
        if self.counts[index] % PART_WATCHED == 0:
            self.marks.setdefault(index, []).append(self.sums[index].clone())

    def read(self, opt: Owner) -> dict[str, float] | None:
        """The open window of the optimizer's groups (one host read; summed over the mesh under
        FSDP); ``None`` when empty. Its complete parts go to :attr:`open_parts`."""
        states = opt.sampler_states
        columns = []  # per group: its parts' end sums, then the open window's, as columns
        for index, acc in self.sums.items():
            stacked = torch.stack([*self.marks.get(index, []), acc], 1)  # (4, parts + 1)
            mesh = states[index].layout.shards
            columns.append(
                (stacked if mesh is None else over_the_mesh(mesh, stacked.clone(), {})[0]).tolist()
            )
        if not columns or not columns[0][3][-1]:
            self.open_parts = []
            return None
        ends = [chain_sums([[row[j] for row in group] for group in columns])
                for j in range(len(columns[0][0]))]  # fmt: skip
        temperature = opt.param_groups[0]["temperature"]
        self.open_parts = [
            Watch.window([b - a for a, b in zip(before, after, strict=True)], temperature)
            for before, after in zip([[0.0] * 4, *ends], ends[:-1], strict=False)
        ]
        return Watch.window(ends[-1], temperature)

    def health(self, opt: Owner) -> Health:
        """The chain's verdict from every step so far, the open window (and its parts) too."""
        settled = chain_settled(opt, opt.num_steps)
        return self.verdict(settled, self.read(opt), self.open_parts)

    def nonfinite_message(self, opt: Owner, message: str) -> str:
        """A non-finite gradient's error with the step, ‖θ‖ over the last windows (the open one
        read) and the fix."""
        window = self.read(opt)
        text = f"{message} at step {opt.num_steps + 1}"
        windows = self.windows[-3:] + ([window] if window else [])
        if windows:
            norms = ", ".join(f"{w['theta_norm']:.3g}" for w in windows)
            text += f" (|theta| over the last {WINDOW_STEPS}-step windows: {norms})"
        return text + "; a smaller lr usually avoids this"
