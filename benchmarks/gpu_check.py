"""``make gpu-check``: on a machine with a CUDA GPU, the CUDA tests and every GPU benchmark in one
run of under 10 minutes, written to one Markdown report.

Sections, each a subprocess with its share of the time budget (a section that runs out is cut
off, and the report keeps what it printed and says so):

1. ``pytest -m cuda``: the tests that need a CUDA device;
2. ``benchmarks/step_time.py --device cuda``: step time of every sampler (eager, philox,
   capturable, captured CUDA graph) against ``torch.optim.SGD``, and host syncs per step;
3. ``benchmarks/chains.py --device cuda``: ``sgrld.Chains`` for K = 1 … 100 against one chain;
4. ``benchmarks/compile_step.py --device cuda``: the user's whole step under ``torch.compile``
   (graph breaks against SGD's, recompiles as ℓ changes, compiled / eager).

Without a GPU it says so in one line and exits 0 at once (no report is written).

    .venv/bin/python benchmarks/gpu_check.py REPORT.md [--budget 570] [--cpu-dry-run]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Section:
    title: str
    args: tuple[str, ...]  # after the python executable
    weight: float  # its share of the time left is weight / (its and the later ones' weights)


def sections(device: str, dry_run: bool) -> list[Section]:
    """The plan; ``dry_run`` shrinks every size to check the plumbing on a CPU."""

    def sizes(rounds: int, steps: int) -> tuple[str, ...]:
        return (
            ("--rounds", "2", "--steps", "2")
            if dry_run
            else ("--rounds", f"{rounds}", "--steps", f"{steps}")
        )

    return [
        Section("CUDA tests (`pytest -m cuda`)", ("-m", "pytest", "-q", "-m", "cuda"), 1.5),
        Section(
            "Step time per sampler against SGD, host syncs per step, captured vs eager "
            "(`benchmarks/step_time.py`)",
            ("benchmarks/step_time.py", "--device", device, *sizes(10, 40))
            + (("--defaults-only", "--only", "SGLD") if dry_run else ()),
            1.5,
        ),
        Section(
            "Chains K = 1 … 100 (`benchmarks/chains.py`)",
            ("benchmarks/chains.py", "--device", device, *sizes(3, 10), "--ks")
            + (("1,2", "--samplers", "identity") if dry_run else ("1,2,4,10,30,100",)),
            1.5,
        ),
        Section(
            "The whole training step under torch.compile (`benchmarks/compile_step.py`)",
            ("benchmarks/compile_step.py", "--device", device, *sizes(5, 20))
            + (("--only", "SGLD") if dry_run else ()),
            1.0,
        ),
    ]


def run(section: Section, timeout: float) -> tuple[str, str, float]:
    """(status, output, seconds) of one section, cut off after ``timeout`` seconds."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-u", *section.args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=max(timeout, 1.0))
        status = "passed" if proc.returncode == 0 else f"failed (exit status {proc.returncode})"
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        status = f"cut off after {timeout:.0f} s (the time budget)"
    return status, out, time.perf_counter() - start


def header(torch_version: str, device_name: str) -> str:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"# GPU check\n\n"
        f"- device: {device_name}\n- torch {torch_version}, Python {platform.python_version()}\n"
        f"- commit {commit or 'unknown'}, {now}\n\n"
        "Ratios are measured side by side in one run (see each benchmark's docstring); absolute "
        "times depend on the machine.\n"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="Markdown file to write")
    parser.add_argument("--budget", type=float, default=570.0, help="seconds for all sections")
    parser.add_argument(
        "--cpu-dry-run",
        action="store_true",
        help="without a GPU: run every section on the CPU at the smallest sizes (checks the "
        "plumbing, measures nothing)",
    )
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available() and not args.cpu_dry_run:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        print(
            f"gpu-check: no CUDA GPU on this machine (torch {torch.__version__}, {build}): skipped"
        )
        return 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (dry run)"
    deadline = time.perf_counter() + args.budget
    parts = [header(torch.__version__, name)]
    failed = False
    plan = sections(device, args.cpu_dry_run)
    for i, section in enumerate(plan):
        left = deadline - time.perf_counter()
        later = sum(s.weight for s in plan[i + 1 :])
        timeout = left * section.weight / (section.weight + later)
        print(f"gpu-check: {section.title} (at most {timeout:.0f} s)", flush=True)
        status, out, spent = run(section, timeout)
        failed |= not status.startswith("passed")
        print(f"gpu-check:   {status}, {spent:.0f} s", flush=True)
        command = " ".join(("python", "-u", *section.args))
        parts.append(
            f"\n## {section.title}\n\n`{command}`: {status}, {spent:.0f} s\n\n"
            f"```text\n{out.rstrip()}\n```\n"
        )
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text("".join(parts))
    print(f"gpu-check: report written to {args.report}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
