"""One sampler's full training step, this tree against another git revision, side by side.

Each round runs a fresh process of each tree in turn (alternating which goes first) that times
``--steps`` steps of the MLP 784-400-400-10 (batch 100) after a warm-up; the ratio is the median
over rounds of the paired per-round ratio (this tree / the other), with its quartiles. Both
processes import their own ``src/`` (``PYTHONPATH``), so two versions of sgrld never meet in one
interpreter.

    .venv/bin/python benchmarks/compare_revisions.py REV [--sampler shampoo] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SNIPPET = """
import sys, time, torch, sgrld
from torch import nn
torch.set_num_threads(int(sys.argv[3]))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(784, 400), nn.ReLU(), nn.Linear(400, 400), nn.ReLU(),
                      nn.Linear(400, 10))
kw = {"shampoo": ("ShampooSGLD", 1e-3), "monge": ("MongeSGLD", 0.05), "sgld": ("SGLD", 0.05),
      "rmsprop": ("RMSpropSGLD", 2.5e-4), "wenzel": ("WenzelSGLD", 0.05)}[sys.argv[1]]
opt = getattr(sgrld, kw[0])(model.parameters(), lr=kw[1], num_data=50_000)
gen = torch.Generator().manual_seed(0)
xs, ys = torch.rand(16, 100, 784, generator=gen), torch.randint(0, 10, (16, 100), generator=gen)
def step(i):
    opt.zero_grad(set_to_none=False)
    nn.functional.cross_entropy(model(xs[i % 16]), ys[i % 16]).backward()
    opt.step()
for i in range(110):
    step(i)
t0 = time.perf_counter()
for i in range(int(sys.argv[2])):
    step(i)
print((time.perf_counter() - t0) / int(sys.argv[2]))
"""


def time_tree(src: Path, args: argparse.Namespace) -> float:
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run(
        [sys.executable, "-c", SNIPPET, args.sampler, str(args.steps), str(args.threads)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev", help="the git revision to compare with (e.g. HEAD~5, a tag)")
    parser.add_argument("--sampler", default="shampoo")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(tmp) / "tree"
        added = subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(other), args.rev],
            capture_output=True,
            text=True,
        )
        if added.returncode != 0:
            last = (added.stderr.strip().splitlines() or ["git failed"])[-1]
            sys.exit(f"compare_revisions: cannot check out {args.rev!r}: {last}")
        try:
            pairs = []
            for r in range(args.rounds):
                trees = [("this", REPO / "src"), ("other", other / "src")]
                if r % 2:
                    trees.reverse()
                times = {name: time_tree(src, args) for name, src in trees}
                pairs.append((times["this"], times["other"]))
        finally:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(other)],
                check=True,
                capture_output=True,
            )
    ratios = [a / b for a, b in pairs]
    q1, med, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    this = statistics.median(a for a, _ in pairs)
    that = statistics.median(b for _, b in pairs)
    print(
        f"{args.sampler}, MLP 784-400-400-10, batch 100, {args.threads} threads, "
        f"{args.rounds} alternating rounds x {args.steps} steps"
    )
    print(
        f"this tree {1e3 * this:.2f} ms/step, {args.rev} {1e3 * that:.2f} ms/step; "
        f"ratio this/{args.rev}: {med:.3f} [{q1:.3f}, {q3:.3f}]"
    )


if __name__ == "__main__":
    main()
