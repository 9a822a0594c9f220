"""Observers of a sampling run: the hooks (:class:`RunObserver`) and the progress display."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TextIO

from tqdm import tqdm

from sgrld.experiments.run.results import SHORT, second_score

if TYPE_CHECKING:
    from sgrld.experiments.run.single import SamplingRun


class RunObserver:
    """Hooks called by :class:`SamplingRun`; the base class does nothing."""

    def on_start(self, run: SamplingRun) -> None:
        """Before the first epoch of this call (after a resume, the restored state is visible)."""

    def on_step(self, run: SamplingRun) -> None:
        """After every sampler step (and the sample's evaluation, if it was one)."""

    def on_epoch(self, run: SamplingRun) -> None:
        """After an epoch's curves are recorded and its checkpoint is written."""

    def on_finish(self, run: SamplingRun) -> None:
        """When the run ends, completed or broken down."""


def breakdown_message(broken_down: Mapping[str, Any]) -> str:
    """One-paragraph account of a breakdown: the failing update, its epoch, the reason, a hint."""
    update = broken_down.get("update", broken_down["global_step"] + 1)  # older results
    text = (
        f"the chain broke down at update {update} (epoch "
        f"{broken_down['epoch'] + 1}): {broken_down['reason']}"
    )
    if broken_down.get("hint"):
        text += f"\n  hint: {broken_down['hint']}"
    return text


class _StepBar(RunObserver):
    """What both progress displays share: a tqdm bar over the process's updates on a terminal,
    one line per epoch (above the bar on a terminal; elsewhere, e.g. logs, the only output)."""

    def __init__(self, stream: TextIO | None, interval: float) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self._bar: tqdm | None = None

    def _open(self, run: Any, desc: str | None = None) -> None:
        if self.live:
            self._bar = tqdm(
                total=run.config.epochs * run.steps_per_epoch,
                initial=run.global_step,
                file=self.stream,
                mininterval=self.interval,
                dynamic_ncols=True,
                unit="step",
                desc=desc,
            )

    def _write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class ProgressBar(_StepBar):
    """Progress of a run on stderr: the bar with the running ensemble metrics, and a line per
    epoch. A breakdown is reported with :func:`breakdown_message` unless ``report_breakdown``
    is off (``sgrld sample`` reports it itself, progress bar or not).
    """

    def __init__(
        self, stream: TextIO | None = None, *, interval: float = 0.5, report_breakdown: bool = True
    ) -> None:
        super().__init__(stream, interval)
        self.report_breakdown = report_breakdown
        self._last = 0.0

    def _line(self, run: SamplingRun, *, epoch_done: bool = False) -> str:
        epoch = run.epoch if epoch_done else run.epoch + 1
        parts = [f"epoch {epoch}/{run.config.epochs} step {run.global_step}"]
        parts.append(f"S={run.ensembles['val'].num_samples}")
        if not run.ensembles["val"].num_samples:  # no ensemble yet: its metrics are NaN
            first = (run.config.burnin // run.config.thinning + 1) * run.config.thinning
            parts.append(f"burning in (first sample after update {first})")
        elif run.curves["epoch"]:
            second = second_score(run.curves)
            short = SHORT[second]
            parts.append(
                f"val LP {run.curves['val_lp'][-1]:.4f} {short} "
                f"{run.curves['val_' + second][-1]:.4f}"
                f" | test LP {run.curves['test_lp'][-1]:.4f}"
                f" {short} {run.curves['test_' + second][-1]:.4f}"
            )
        ratio = run.telemetry.get("drift_to_noise")
        if ratio:  # healthy chains read 0.04-0.35; above 1, ℓ is too large (docs/health.md)
            parts.append(f"drift/noise {ratio[-1]:.2g}")
        if run.timing["sampling_seconds"]:
            parts.append(f"{run.timing['sampling_seconds'][-1]:.1f} s/epoch")
        return " | ".join(parts)

    def on_start(self, run: SamplingRun) -> None:
        if run.epoch:
            print(f"resuming {run.config.label()} after epoch {run.epoch}", file=self.stream)
        self._open(run)

    def on_step(self, run: SamplingRun) -> None:
        if self._bar is None:
            return
        self._bar.update(run.global_step - self._bar.n)
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            self._bar.set_description_str(self._line(run), refresh=False)

    def on_epoch(self, run: SamplingRun) -> None:
        self._write(self._line(run, epoch_done=True))

    def on_finish(self, run: SamplingRun) -> None:
        self._close()
        if run.broken_down is not None and self.report_breakdown:
            print(breakdown_message(run.broken_down), file=self.stream)


class ChainsProgressBar(_StepBar):
    """Progress of a multi-chain run (:class:`~sgrld.experiments.run.chains.ChainsRun`) on
    stderr: the bar over the process's updates, and a line per epoch with how many chains run,
    completed and broke down and the spread of their ensemble metrics."""

    def __init__(self, stream: TextIO | None = None, *, interval: float = 0.5) -> None:
        super().__init__(stream, interval)

    @staticmethod
    def _spread(values: list[float]) -> str:
        ordered = sorted(v for v in values if v == v)  # NaN (no sample yet) left out
        if not ordered:
            return "n/a"
        middle = ordered[len(ordered) // 2]
        return f"{middle:.4f} [{ordered[0]:.4f}, {ordered[-1]:.4f}]"

    def _line(self, run: Any) -> str:
        records = run.records
        status = [r.status for r in records]
        parts = [
            f"epoch {run.epoch}/{run.config.epochs} step {run.global_step}",
            f"{len(records)} chains: {status.count('running')} running, "
            f"{status.count('completed')} completed, {status.count('broken_down')} broken down",
        ]
        live = [r for r in records if r.status != "broken_down" and r.curves["epoch"]]
        if live and live[0].ensembles["val"].num_samples:
            val_lp = [r.curves["val_lp"][-1] for r in live]
            parts.append("val LP median [min, max] " + self._spread(val_lp))
            second = second_score(live[0].curves)
            values = [r.curves["test_" + second][-1] for r in live]
            parts.append(f"test {SHORT[second]} " + self._spread(values))
        if live and live[0].timing["sampling_seconds"]:
            seconds = live[0].timing["sampling_seconds"][-1] * len(records)
            parts.append(f"{seconds:.1f} s/epoch (all chains)")
        return " | ".join(parts)

    def on_start(self, run: Any) -> None:
        if run.epoch:
            print(f"resuming {len(run.records)} chains after epoch {run.epoch}", file=self.stream)
        self._open(run, desc=f"{len(run.records)} chains")

    def on_step(self, run: Any) -> None:
        if self._bar is not None:
            self._bar.update(run.global_step - self._bar.n)

    def on_epoch(self, run: Any) -> None:
        self._write(self._line(run))

    def on_finish(self, run: Any) -> None:
        self._close()
