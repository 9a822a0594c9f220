"""The progress display of a sampling run, an observer (:class:`~.run.loop.RunObserver`)."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

from tqdm import tqdm

from sgrld.experiments.run.loop import RunObserver, SamplingRun
from sgrld.experiments.run.results import short_name

__all__ = ["ProgressBar", "RunObserver", "breakdown_message"]


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


class ProgressBar(RunObserver):
    """Progress on stderr: a tqdm bar on a terminal, and one line per epoch (one run's ensemble
    metrics, or K chains' counts and spread); one run's breakdown unless ``report_breakdown``
    is off (``sgrld sample`` reports it itself)."""

    def __init__(
        self, stream: TextIO | None = None, *, interval: float = 0.5, report_breakdown: bool = True
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.report_breakdown = report_breakdown
        self._bar: tqdm | None = None
        self._last = 0.0

    def _line(self, run: SamplingRun, *, epoch_done: bool = False) -> str:
        if len(run.records) > 1:
            return self._chains_line(run)
        epoch = run.epoch if epoch_done else run.epoch + 1
        record, config = run.records[0], run.config
        samples = record.ensembles["val"].num_samples
        parts = [f"epoch {epoch}/{config.epochs} step {run.global_step}", f"S={samples}"]
        curves = record.curves
        if not samples:  # no ensemble yet: its metrics are NaN
            first = (config.burnin // config.thinning + 1) * config.thinning
            parts.append(f"burning in (first sample after update {first})")
        elif curves["epoch"]:
            second = record.likelihood.second()
            short = short_name(second)
            parts.append(
                f"val LP {curves['val_lp'][-1]:.4f} {short} {curves['val_' + second][-1]:.4f}"
                f" | test LP {curves['test_lp'][-1]:.4f} {short} "
                f"{curves['test_' + second][-1]:.4f}"
            )
        ratio = record.telemetry.get("drift_to_noise")
        if ratio:  # healthy chains read 0.04-0.35; above 1, ℓ is too large (docs/health.md)
            parts.append(f"drift/noise {ratio[-1]:.2g}")
        if record.timing["sampling_seconds"]:
            parts.append(f"{record.timing['sampling_seconds'][-1]:.1f} s/epoch")
        return " | ".join(parts)

    @staticmethod
    def _spread(values: list[float]) -> str:
        ordered = sorted(v for v in values if v == v)  # NaN (no sample yet) left out
        if not ordered:
            return "n/a"
        middle = ordered[len(ordered) // 2]
        return f"{middle:.4f} [{ordered[0]:.4f}, {ordered[-1]:.4f}]"

    def _chains_line(self, run: SamplingRun) -> str:
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
            second = live[0].likelihood.second()
            values = [r.curves["test_" + second][-1] for r in live]
            parts.append(f"test {short_name(second)} " + self._spread(values))
        if live and live[0].timing["sampling_seconds"]:
            seconds = live[0].timing["sampling_seconds"][-1] * len(records)
            parts.append(f"{seconds:.1f} s/epoch (all chains)")
        return " | ".join(parts)

    def on_start(self, run: SamplingRun) -> None:
        k = len(run.records)
        if run.epoch:
            what = run.config.label() if k == 1 else f"{k} chains"
            print(f"resuming {what} after epoch {run.epoch}", file=self.stream)
        if self.live:
            self._bar = tqdm(
                total=run.config.epochs * run.steps_per_epoch,
                initial=run.global_step,
                file=self.stream,
                mininterval=self.interval,
                dynamic_ncols=True,
                unit="step",
                desc=None if k == 1 else f"{k} chains",
            )

    def on_step(self, run: SamplingRun) -> None:
        if self._bar is None:
            return
        self._bar.update(run.global_step - self._bar.n)
        now = time.monotonic()
        if len(run.records) == 1 and now - self._last >= self.interval:
            self._last = now
            self._bar.set_description_str(self._line(run), refresh=False)

    def on_epoch(self, run: SamplingRun) -> None:
        line = self._line(run, epoch_done=True)
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def on_finish(self, run: SamplingRun) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        broken_down = run.records[0].broken_down
        if len(run.records) == 1 and broken_down is not None and self.report_breakdown:
            print(breakdown_message(broken_down), file=self.stream)
