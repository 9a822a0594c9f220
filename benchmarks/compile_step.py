"""A user's whole training step under ``torch.compile``: graph breaks, recompiles, speed.

For ``torch.optim.SGD`` and every sampler with its default options (``benchmarks/step_time.py``'s
settings; ``--capturable`` adds each with ``capturable=True``), the step a user compiles:

    loss = cross_entropy(model(x), y); loss.backward(); opt.step(); opt.zero_grad(); sched.step()

* **graph breaks**, from ``torch._dynamo.explain`` over that step without the scheduler, ℓ a
  float (the default) and a 0-d tensor, against SGD's (``backward()`` itself is one break for
  every optimizer);
* **recompiles as ℓ changes**: ℓ a 0-d tensor and a ``LinearLR`` warm-up stepped *inside* the
  compiled function (torch's recipe for compiled optimizers with schedulers), so ℓ changes every
  step; a compiled graph added after the first steps is a recompile;
* **compiled / eager**: the same step eager and compiled, each on its own copy of the model,
  interleaved round by round; the median of the paired per-round ratios [quartiles], so the ratio
  is measured side by side (absolute times depend on the machine and are not claims).

    .venv/bin/python benchmarks/compile_step.py [--model mlp400] [--rounds 10] [--steps 20]
        [--threads 2] [--only SGLD,Monge] [--capturable] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

from step_time import BASE, NUM_DATA, batches, build

Factory = Callable[[list[nn.Parameter], Any], torch.optim.Optimizer]


def factories(capturable: bool) -> dict[str, Factory]:
    """Row name → ``(params, lr tensor) -> optimizer``."""
    out: dict[str, Factory] = {"SGD": lambda p, lr: torch.optim.SGD(p, lr=lr)}
    for name, (cls, _, options) in BASE.items():
        out[name] = partial(_sampler, cls, options)
        if capturable:
            out[f"{name}/capturable"] = partial(_sampler, cls, {**options, "capturable": True})
    return out


def _sampler(
    cls: type[torch.optim.Optimizer], options: dict[str, Any], params: Any, lr: Any
) -> torch.optim.Optimizer:
    return cls(params, lr=lr, num_data=NUM_DATA, **options)


def default_lr(name: str) -> float:
    base = name.split("/")[0]
    return 1e-3 if base == "SGD" else BASE[base][1]


class Run:
    """One model and optimizer, with the user's step eager or compiled."""

    def __init__(
        self,
        name: str,
        factory: Factory,
        model: str,
        device: str,
        sched: bool,
        tensor_lr: bool = True,
    ) -> None:
        self.model = build(model, 0).to(device)
        lr: Any = default_lr(name)
        self.opt = factory(
            list(self.model.parameters()), torch.tensor(lr, device=device) if tensor_lr else lr
        )
        self.sched = (
            torch.optim.lr_scheduler.LinearLR(self.opt, start_factor=0.1, total_iters=1000)
            if sched
            else None
        )

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        loss = nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        if self.sched is not None:
            self.sched.step()


def graph_breaks(run: Run, x: torch.Tensor, y: torch.Tensor) -> tuple[int, list[str]]:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(run.step)(x, y)
    reasons = []
    for r in explained.break_reasons:
        where = r.user_stack[-1] if r.user_stack else None
        at = f" at {Path(where.filename).name}:{where.lineno}" if where else ""
        reasons.append(f"{r.reason.splitlines()[0][:80]}{at}")
    return explained.graph_break_count, reasons


def recompiles(run: Run, xs: torch.Tensor, ys: torch.Tensor, steps: int = 8) -> int:
    """Graphs compiled after the first two steps of a compiled step whose ℓ changes each step."""
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(run.step)
    graphs = []
    for i in range(steps):
        compiled(xs[i % len(xs)], ys[i % len(ys)])
        graphs.append(counters["stats"]["unique_graphs"])
    return graphs[-1] - graphs[1]


def timings(
    eager: Run, compiled_run: Run, xs: torch.Tensor, ys: torch.Tensor, rounds: int, steps: int
) -> list[float]:
    """Paired per-round ratios compiled / eager."""
    sync = torch.cuda.synchronize if xs.is_cuda else (lambda: None)
    compiled = torch.compile(compiled_run.step)
    for i in range(5):  # compile and warm up both
        compiled(xs[i % len(xs)], ys[i % len(ys)])
        eager.step(xs[i % len(xs)], ys[i % len(ys)])
    ratios = []
    for r in range(rounds):
        spent = {}
        order = [("eager", eager.step), ("compiled", compiled)]
        for label, fn in order if r % 2 == 0 else order[::-1]:
            sync()
            t0 = time.perf_counter()
            for i in range(steps):
                fn(xs[i % len(xs)], ys[i % len(ys)])
            sync()
            spent[label] = time.perf_counter() - t0
        ratios.append(spent["compiled"] / spent["eager"])
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--model", choices=["mlp400", "mlp1200", "resnet20"], default="mlp400")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", default="", help="comma list of row prefixes (SGD always)")
    parser.add_argument("--capturable", action="store_true", help="add capturable=True rows")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", module="torch")
    torch._logging.set_logs(dynamo=logging.ERROR, inductor=logging.ERROR)
    rows = factories(args.capturable)
    if args.only:
        keep = ("SGD", *args.only.split(","))
        rows = {k: v for k, v in rows.items() if k.startswith(keep)}
    xs, ys = batches(args.model, args.device, 8)
    print(
        f"{args.model} on {args.device} ({args.threads} threads), torch {torch.__version__}: "
        "the user's step (forward, backward, step, zero_grad) under torch.compile.\n"
        "breaks: graph breaks (torch._dynamo.explain, no scheduler) with a float / a tensor lr, "
        "- SGD: the float-lr count less SGD's; "
        "recompiles: graphs added while a LinearLR changes a tensor lr inside the compiled "
        f"step; compiled/eager: median of {args.rounds} paired rounds x {args.steps} steps "
        "[quartiles]"
    )
    print(f"{'row':<20}{'breaks':>8}{'- SGD':>7}{'recompiles':>11}  compiled/eager")
    reasons_seen: dict[str, list[str]] = {}
    sgd_breaks = None
    for name, factory in rows.items():
        try:
            float_breaks, reasons = graph_breaks(
                Run(name, factory, args.model, args.device, False, tensor_lr=False), xs[0], ys[0]
            )
            breaks, _ = graph_breaks(
                Run(name, factory, args.model, args.device, False), xs[0], ys[0]
            )
            again = recompiles(Run(name, factory, args.model, args.device, True), xs, ys)
            torch._dynamo.reset()
            ratios = timings(
                Run(name, factory, args.model, args.device, False),
                Run(name, factory, args.model, args.device, False),
                xs,
                ys,
                args.rounds,
                args.steps,
            )
        except Exception as exc:  # a refused option or a failed trace is a result here
            print(f"{name:<20}{'-':>8}{'-':>7}{'-':>11}  failed: {type(exc).__name__}: {exc}"[:200])
            continue
        q1, med, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        sgd_breaks = float_breaks if sgd_breaks is None else sgd_breaks
        reasons_seen[name] = reasons
        print(
            f"{name:<20}{f'{float_breaks} / {breaks}':>8}{float_breaks - sgd_breaks:>+7d}"
            f"{again:>11}  {med:.2f} [{q1:.2f}, {q3:.2f}]"
        )
    print("\ngraph-break reasons (float lr):")
    for name, reasons in reasons_seen.items():
        for reason in reasons:
            print(f"  {name}: {reason}")


if __name__ == "__main__":
    main()
