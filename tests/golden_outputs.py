"""Golden outputs of the ``sgrld`` commands: a before/after equality check for refactors.

Tiny fixed configurations (:data:`CASES`) run through the command line only (``python -m sgrld``
in a subprocess, never an internal module, so the check survives files moving), and every file
they write is reduced to a JSON digest (:func:`digest_tree`) with the fields that legitimately
vary removed: timings, hardware, versions, absolute paths. Everything else is kept exactly:
floats are compared bit for bit (``float.hex``), tensors and arrays through the SHA-256 of their
bytes. The digests live in ``tests/data/golden/<case>.json``; ``tests/test_golden_outputs.py``
reruns the cases and compares.

    python tests/golden_outputs.py --write          # regenerate every golden (MNIST needed)
    python tests/golden_outputs.py --write funnel   # only the named cases
    python tests/golden_outputs.py                  # compare, print the first differences

The MNIST cases read ``$SGRLD_MNIST_DIR`` (the folder of the four ``*-ubyte.gz`` files).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GOLDEN_DIR = Path(__file__).resolve().parent / "data" / "golden"
MNIST_ENV = "SGRLD_MNIST_DIR"

# --- the configurations -----------------------------------------------------------------------

#: A run small enough for seconds: fc16 on 300 MNIST points, 2 epochs of 6 updates, a sample
#: every 3 updates after 4 (3 samples), evaluated on 200 validation and 200 test points. One
#: thread: float reductions split by thread count (sample refuses to resume across counts).
_MNIST = ["--dataset", "mnist", "--model", "fc", "--width", "16", "--subset", "300"]
_MNIST += ["--eval-subset", "200", "--num-val", "200", "--batch-size", "50"]
_MNIST += ["--burn-in", "4", "--thinning", "3", "--data-dir", "{data}", "--threads", "1"]
_MNIST += ["--no-progress"]


@dataclass(frozen=True)
class Case:
    """Commands run in order in a fresh folder ``{root}``; every file they leave is digested.

    ``pin_timings`` names folders whose ``results.json`` timings are set to fixed values before
    the commands after ``pin_before`` run (``report`` and ``table`` print seconds per epoch and
    choose Table 6 by them, so their outputs would otherwise vary with the machine's load).
    """

    name: str
    commands: tuple[tuple[str, ...], ...]
    mnist: bool = True
    pin_timings: tuple[str, ...] = ()
    pin_before: int = 0
    #: Fields (key paths, ``*`` any key or index) whose value is not reproducible and is
    #: replaced by :data:`UNSEEDED` in the digest (kept there, so a field gone still shows).
    unseeded: tuple[tuple[str, ...], ...] = ()
    #: The exit status each command must end with (default: 0 for every one).
    statuses: tuple[int, ...] = ()
    #: Processes of a ``torchrun --standalone`` job that runs each command (0: a plain process).
    processes: int = 0


def _cmd(*parts: str | list[str]) -> tuple[str, ...]:
    return tuple(p for part in parts for p in ([part] if isinstance(part, str) else part))


#: Every case that runs a chain passes its ``--adapt`` (``burnin``, ``always`` or N): the goldens
#: were written when ``burnin`` was the default, and the default ``wait`` is covered by
#: ``tests/test_run_warmup.py``.
CASES = (
    # One chain, Monge, horseshoe prior, curvature measured, Philox noise: the loop with the
    # one-chain stepper (eager on CPU): sampling, thinning, evaluation, telemetry, checkpoint.
    Case(
        "sample_monge",
        (
            _cmd(
                "sample",
                _MNIST,
                ["--prior", "horseshoe", "--sampler", "monge", "--lr", "0.1", "--alpha2", "0.5"],
                ["--curvature", "--curvature-points", "50", "--epochs", "2", "--seed", "1"],
                ["--adapt", "burnin", "--out", "{root}/run", "--no-plot"],
            ),
        ),
    ),
    # Shampoo (block preconditioner and its refresh steps), Gaussian prior, --adapt always, the
    # cyclical schedule (not in the resume case: its cycles depend on --epochs, which a resume
    # may not change then).
    Case(
        "sample_shampoo",
        (
            _cmd(
                "sample",
                _MNIST,
                ["--prior", "gaussian", "--sampler", "shampoo", "--lr", "0.05", "--epochs", "2"],
                ["--schedule", "cyclical", "--cycles", "2", "--explore-fraction", "0.25"],
                ["--adapt", "always", "--seed", "2", "--out", "{root}/run", "--no-plot"],
            ),
        ),
    ),
    # Wenzel with torch noise, run for 1 epoch and then extended to 2 with --resume: the
    # checkpoint read back and the loop continued.
    Case(
        "sample_wenzel_resume",
        (
            _cmd(
                "sample",
                _MNIST,
                ["--prior", "gaussian", "--sampler", "wenzel", "--lr", "0.05", "--noise", "torch"],
                ["--epochs", "1", "--seed", "3", "--adapt", "burnin", "--out", "{root}/run"],
                ["--no-plot"],
            ),
            _cmd(
                "sample",
                ["--resume", "--epochs", "2", "--out", "{root}/run", "--data-dir", "{data}"],
                ["--threads", "1", "--no-progress", "--no-plot"],
            ),
        ),
    ),
    # Three chains in one process (the vmapped stepper): per-chain results and one checkpoint.
    Case(
        "sample_chains3",
        (
            _cmd(
                "sample",
                _MNIST,
                ["--prior", "gaussian", "--sampler", "monge", "--lr", "0.1", "--alpha2", "0.5"],
                ["--chains", "3", "--epochs", "2", "--seed", "0", "--out", "{root}/run"],
                ["--adapt", "burnin", "--no-plot"],
            ),
        ),
        # The vectorised sampler's state holds a torch.Generator that `sgrld.build(...).init`
        # seeds from torch's global generator, which nothing seeds (torch.initial_seed() differs
        # from process to process). With Philox noise (which --chains requires) it draws nothing:
        # the noise keys come from each chain's own seed, so results.json and every other tensor
        # are reproducible; only this generator's saved state is not.
        unseeded=(("run/checkpoint.pt", "chains", "samplers", "*", "generator"),),
    ),
    # A local sweep over two ℓ, then `table` and `report` over it (timings pinned, see Case).
    Case(
        "sweep_report",
        (
            _cmd(
                "sweep",
                _MNIST,
                ["--prior", "gaussian", "--sampler", "identity", "--lr", "0.05,0.1"],
                ["--epochs", "2", "--seeds", "0", "--engine", "local", "--jobs", "1"],
                ["--adapt", "burnin", "--out", "{root}/sweep"],
            ),
            _cmd(
                "table",
                "{root}/pinned",
                ["--layout", "long", "--csv", "{root}/table_long.csv"],
                ["--markdown", "{root}/table_long.md"],
            ),
            _cmd("table", "{root}/pinned", "--markdown", "{root}/table_paper.md"),
            _cmd("report", "{root}/pinned", "--out", "{root}/report", "--no-figures"),
        ),
        pin_timings=("sweep",),
        pin_before=1,
    ),
    # RMSprop adapting for the first 5 updates only (--adapt N), a metric option, its telemetry
    # (drift/noise, the state's size) in results.json.
    Case(
        "sample_rmsprop_adapt",
        (
            _cmd(
                "sample",
                _MNIST,
                ["--prior", "gaussian", "--sampler", "rmsprop", "--lr", "0.005", "--adapt", "5"],
                ["--option", "decay=0.95", "--epochs", "2", "--seed", "5"],
                ["--out", "{root}/run", "--no-plot"],
            ),
        ),
    ),
    # A chain that breaks down (exit 3): the failing update, the record closed, the checkpoint
    # of the last good update. Then two chains in one process of which one breaks down and the
    # other completes.
    Case(
        "sample_breakdown",
        (
            _cmd(
                "sample",
                _MNIST,
                ["--prior", "gaussian", "--sampler", "identity", "--lr", "1e9", "--epochs", "2"],
                ["--seed", "6", "--adapt", "burnin", "--out", "{root}/one", "--no-plot"],
            ),
            _cmd(
                "sample",
                _MNIST,
                ["--prior", "gaussian", "--sampler", "identity", "--lr", "0.05,1e9"],
                ["--epochs", "2", "--seed", "6", "--adapt", "burnin", "--out", "{root}/two"],
                ["--no-plot"],
            ),
        ),
        unseeded=(("two/checkpoint.pt", "chains", "samplers", "*", "generator"),),
        statuses=(3, 3),
    ),
    # Two chains, one per vectorised call (--chain-batch 1), run for 1 epoch and extended to 2
    # with --resume: the multi-chain checkpoint read back and the loop continued.
    Case(
        "sample_chains_resume",
        (
            _cmd(
                "sample",
                _MNIST,
                ["--prior", "horseshoe", "--sampler", "wenzel", "--lr", "0.05", "--chains", "2"],
                ["--chain-batch", "1", "--epochs", "1", "--seed", "7", "--out", "{root}/run"],
                ["--adapt", "burnin", "--no-plot"],
            ),
            _cmd(
                "sample",
                ["--resume", "--epochs", "2", "--out", "{root}/run", "--data-dir", "{data}"],
                ["--threads", "1", "--no-progress", "--no-plot"],
            ),
        ),
        unseeded=(("run/checkpoint.pt", "chains", "samplers", "*", "generator"),),
    ),
    # One chain over two processes (torchrun, gloo): data parallel, Monge, then sharded (FSDP2),
    # horseshoe prior (its 0-d scales held as one-row shards), rank 0 writing.
    Case(
        "sample_ddp",
        (
            _cmd(
                "sample",
                _MNIST,
                ["--prior", "gaussian", "--sampler", "monge", "--lr", "0.1", "--alpha2", "0.5"],
                ["--parallel", "ddp", "--epochs", "2", "--seed", "8", "--out", "{root}/run"],
                ["--adapt", "burnin", "--no-plot"],
            ),
        ),
        processes=2,
    ),
    Case(
        "sample_fsdp",
        (
            _cmd(
                "sample",
                _MNIST,
                ["--prior", "horseshoe", "--sampler", "rmsprop", "--lr", "0.05"],
                ["--parallel", "fsdp", "--epochs", "2", "--seed", "9", "--out", "{root}/run"],
                ["--adapt", "burnin", "--no-plot"],
            ),
        ),
        processes=2,
    ),
    # The funnel, eager (compiling takes tens of seconds and is a separate code path), all four
    # samplers, 2 batched chains, 200 steps, one worker. Needs no data, so it runs in CI.
    Case(
        "funnel",
        (
            _cmd(
                "funnel",
                ["--out", "{root}/funnel", "--steps", "200", "--chains", "2", "--seed", "3"],
                ["--jobs", "1", "--no-compile", "--no-plot", "--no-progress"],
            ),
        ),
        mnist=False,
    ),
    # The exact-metric funnel (Monge with m = ∇u and its correction Γ) from exact draws: its
    # own case, as it takes about 10 s.
    Case(
        "funnel_exact",
        (
            _cmd(
                "funnel",
                ["--out", "{root}/exact", "--steps", "200", "--chains", "2", "--seed", "4"],
                ["--samplers", "monge", "--exact-metric", "--correction", "--start", "exact"],
                ["--jobs", "1", "--no-compile", "--no-plot", "--no-progress"],
            ),
        ),
        mnist=False,
    ),
)
CASE_NAMES = tuple(c.name for c in CASES)

# --- running ----------------------------------------------------------------------------------


def run_case(case: Case, root: Path, data: Path | None) -> None:
    """Run ``case``'s commands in ``root`` (empty) through ``python -m sgrld``.

    Raises:
        RuntimeError: a command exited with another status than expected (its output in it).
    """
    if case.mnist and data is None:
        raise ValueError(f"{case.name} needs MNIST: set {MNIST_ENV}")
    # One OpenMP/MKL thread for the commands without --threads (funnel): same reductions anywhere.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    launcher = [sys.executable]
    if case.processes:
        launcher += ["-m", "torch.distributed.run", "--standalone"]
        launcher += ["--nproc-per-node", str(case.processes)]
    for k, command in enumerate(case.commands):
        if k == case.pin_before:
            for folder in case.pin_timings:
                pin_timings(root / folder, root / "pinned")
        argv = [part.format(root=root, data=data) for part in command]
        done = subprocess.run(
            [*launcher, "-m", "sgrld", *argv],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        expected = case.statuses[k] if case.statuses else 0
        if done.returncode != expected:
            raise RuntimeError(
                f"{case.name}: `sgrld {' '.join(argv)}` exited {done.returncode}, not {expected}\n"
                f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )


def pin_timings(source: Path, target: Path) -> None:
    """Copy ``source``'s ``results.json`` files (and its ``sweep.json``) to ``target`` with every
    timing set to 1.0, so that what ``report`` and ``table`` derive from them is reproducible."""
    for path in sorted(source.rglob("*.json")):
        dest = target / path.relative_to(source)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if path.name != "results.json":
            shutil.copyfile(path, dest)
            continue
        data = _map_timings(json.loads(path.read_text(encoding="utf-8")))
        dest.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def _map_timings(value: Any, timed: bool = False) -> Any:
    if isinstance(value, dict):
        return {k: _map_timings(v, timed or _is_timing(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_timings(v, timed) for v in value]
    if timed and isinstance(value, float):
        return 1.0
    return value


# --- normalising ------------------------------------------------------------------------------

#: Keys whose values depend on the machine, its load or the installed versions, never on the
#: chain: wall times (``*seconds*``, ``ess_bulk_per_second``), the CPU's name, the kernel's
#: (``platform``), versions.
VARYING_KEYS = frozenset(
    {"hardware", "platform", "torch", "python", "version", "hostname", "pid", "date"}
)


def _is_timing(key: str) -> bool:
    return "seconds" in key or "per_second" in key


def _varies(key: str) -> bool:
    return key in VARYING_KEYS or _is_timing(key)


#: Absolute paths and what they are written as in a digest: ``(("/tmp/x", "{root}"), ...)``.
Paths = tuple[tuple[str, str], ...]


def _relative(text: str, paths: Paths) -> str:
    for path, name in paths:
        text = text.replace(path, name)
    return text


def normalise(value: Any, paths: Paths) -> Any:
    """A JSON value with the varying keys dropped and the ``paths`` written as their
    placeholders. Floats stay floats: JSON writes them as ``repr`` does, which reads back to the
    same double, and :func:`differences` compares them bit for bit."""
    if isinstance(value, dict):
        return {str(k): normalise(v, paths) for k, v in value.items() if not _varies(str(k))}
    if isinstance(value, (list, tuple)):
        return [normalise(v, paths) for v in value]
    if isinstance(value, str):
        return _relative(value, paths)
    return value


def _tensor_digest(dtype: str, shape: tuple[int, ...], data: bytes) -> str:
    return f"{dtype}{list(shape)} sha256:{hashlib.sha256(data).hexdigest()[:20]}"


def _checkpoint_value(value: Any, paths: Paths) -> Any:
    """A checkpoint's state with each tensor replaced by its dtype, shape and bytes' hash."""
    import torch

    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        return _tensor_digest(str(t.dtype).removeprefix("torch."), tuple(t.shape), data)
    if isinstance(value, dict):
        return {
            str(k): _checkpoint_value(v, paths) for k, v in value.items() if not _varies(str(k))
        }
    if isinstance(value, (list, tuple)):
        return [_checkpoint_value(v, paths) for v in value]
    if value is not None and not isinstance(value, (str, int, float)):
        return f"{type(value).__name__}: {value}"  # e.g. a torch.dtype in Shampoo's state
    return normalise(value, paths)


def _read_checkpoint(path: Path) -> Any:
    """A sgrld checkpoint's state: a magic line, a JSON header line (the payload's size and
    SHA-256: the payload holds timings, so its hash varies), then the ``torch.save`` payload."""
    import torch

    magic, _header, payload = path.read_bytes().split(b"\n", 2)
    if magic != b"sgrld-checkpoint":
        raise ValueError(f"{path} is not a sgrld checkpoint")
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)


def digest_file(path: Path, paths: Paths) -> Any:
    """What of one output file must not change (by its kind; see the module docstring)."""
    suffix = path.suffix
    if suffix == ".json":
        return normalise(json.loads(path.read_text(encoding="utf-8")), paths)
    if suffix == ".pt":
        return _checkpoint_value(_read_checkpoint(path), paths)
    if suffix == ".npz":
        import numpy as np

        with np.load(path) as arrays:
            return {
                name: _tensor_digest(str(a.dtype), a.shape, np.ascontiguousarray(a).tobytes())
                for name, a in ((n, arrays[n]) for n in sorted(arrays.files))
            }
    if suffix == ".csv":  # rows of cells: a diff names the cell, not a whole line
        return list(csv.reader(io.StringIO(_relative(path.read_text(encoding="utf-8"), paths))))
    if suffix in (".md", ".txt"):
        return _relative(path.read_text(encoding="utf-8"), paths).splitlines()
    if suffix == ".png":  # matplotlib's bytes vary with its version: only that it was drawn
        return "png"
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def digest_tree(root: Path, paths: Paths, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """``{relative path: digest}`` of every file under ``root`` but the ``skip`` folders."""
    files = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and not any(rel.startswith(s + "/") for s in skip):
            files[rel] = digest_file(path, paths)
    return files


UNSEEDED = "not reproducible, not compared (see the case's `unseeded`)"


def blank_fields(value: Any, pattern: tuple[str, ...]) -> Any:
    """``value`` with the fields at ``pattern`` replaced by :data:`UNSEEDED`."""
    if not pattern:
        return UNSEEDED
    head, rest = pattern[0], pattern[1:]
    if isinstance(value, dict):
        return {k: blank_fields(v, rest) if head in ("*", k) else v for k, v in value.items()}
    if isinstance(value, list):
        return [blank_fields(v, rest) if head in ("*", str(i)) else v for i, v in enumerate(value)]
    return value


def case_digest(case: Case, data: Path | None) -> dict[str, Any]:
    """Run ``case`` in a fresh temporary folder and digest what it wrote."""
    with tempfile.TemporaryDirectory(prefix=f"sgrld-golden-{case.name}-") as tmp:
        root = Path(tmp).resolve()
        run_case(case, root, data)
        paths: Paths = ((str(root), "{root}"),)
        if data is not None:
            paths += ((str(data), "{data}"), (str(data.resolve()), "{data}"))
        # the pinned copy is an input of report/table, not an output of sgrld
        files = digest_tree(root, paths, skip=("pinned",) if case.pin_timings else ())
        for pattern in case.unseeded:
            files = blank_fields(files, pattern)
        return {"case": case.name, "commands": [" ".join(c) for c in case.commands], "files": files}


# --- comparing --------------------------------------------------------------------------------


def differences(golden: Any, now: Any, where: str = "") -> Iterator[str]:
    """Each field that differs, as ``path: golden … now …`` (in document order)."""
    if isinstance(golden, dict) and isinstance(now, dict):
        for key in golden:
            if key not in now:
                yield f"{where}/{key}: missing now (golden {_short(golden[key])})"
            else:
                yield from differences(golden[key], now[key], f"{where}/{key}")
        for key in now:
            if key not in golden:
                yield f"{where}/{key}: new (now {_short(now[key])})"
    elif isinstance(golden, list) and isinstance(now, list):
        for k, (a, b) in enumerate(zip(golden, now, strict=False)):
            yield from differences(a, b, f"{where}[{k}]")
        if len(golden) != len(now):
            yield f"{where}: length {len(golden)} in the golden, {len(now)} now"
    elif isinstance(golden, float) and isinstance(now, float):
        if golden.hex() != now.hex():  # exact: NaN equals NaN, -0.0 differs from 0.0
            yield f"{where}: golden {golden!r}, now {now!r} (difference {now - golden:.3g})"
    elif type(golden) is not type(now) or golden != now:
        yield f"{where}: golden {_short(golden)}, now {_short(now)}"


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 120 else text[:117] + "..."


def golden_path(name: str) -> Path:
    return GOLDEN_DIR / f"{name}.json"


def environment() -> dict[str, str]:
    """Where the goldens were written: floats may differ on another torch or CPU (recorded, not
    compared)."""
    import platform

    import torch

    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def write_golden(case: Case, data: Path | None) -> Path:
    digest = {**case_digest(case, data), "written_with": environment()}
    path = golden_path(case.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(digest, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def compare(case: Case, data: Path | None, limit: int = 25) -> list[str]:
    """The differences between ``case``'s golden and a rerun (the first ``limit``, then a count);
    empty when they agree."""
    golden = json.loads(golden_path(case.name).read_text(encoding="utf-8"))
    now = case_digest(case, data)
    if golden["commands"] != now["commands"]:
        return [f"the commands of {case.name} changed since its golden: regenerate it (--write)"]
    # a key counted as varying after its golden was written is dropped from the golden too
    found = list(differences(normalise(golden["files"], ()), now["files"]))
    if not found:
        return []
    lines = found[:limit] + [f"... and {len(found) - limit} more"] * (len(found) > limit)
    env = environment()
    if golden.get("written_with") != env:
        lines.append(f"note: golden written with {golden.get('written_with')}, this is {env}")
    return lines


def mnist_dir() -> Path | None:
    value = os.environ.get(MNIST_ENV)
    path = Path(value) if value else None
    return path if path is not None and (path / "train-images-idx3-ubyte.gz").exists() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("cases", nargs="*", help=f"of {', '.join(CASE_NAMES)} (default: all)")
    parser.add_argument("--write", action="store_true", help="regenerate the goldens")
    args = parser.parse_args(argv)
    unknown = set(args.cases) - set(CASE_NAMES)
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; the cases are {', '.join(CASE_NAMES)}")
    data = mnist_dir()
    status = 0
    for case in [c for c in CASES if not args.cases or c.name in args.cases]:
        if case.mnist and data is None:
            print(f"{case.name}: skipped (set {MNIST_ENV} to the MNIST folder)")
            continue
        started = time.perf_counter()
        if args.write:
            path = write_golden(case, data)
            print(f"{case.name}: wrote {path} ({time.perf_counter() - started:.1f} s)")
            continue
        diff = compare(case, data)
        print(
            f"{case.name}: {'DIFFERS' if diff else 'same'} ({time.perf_counter() - started:.1f} s)"
        )
        for line in diff:
            print("  " + line)
        status |= bool(diff)
    return status


if __name__ == "__main__":
    sys.exit(main())
