"""Faults a cluster or a laptop injects: damaged checkpoints, two runs on one directory, killed
funnel parents, a full disk, Ctrl-C during start-up (``docs/experiments.md``)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import sgrld.data
from conftest import mnist_path
from sgrld.cli import RESUME_HINTS, main
from sgrld.experiments.base import files as _io
from sgrld.experiments.base.files import CheckpointError
from sgrld.experiments.commands import funnel as funnel_command
from sgrld.experiments.commands.sample import add_arguments
from sgrld.experiments.funnel import run as funnel
from sgrld.experiments.run.checkpoint import load_checkpoint
from sgrld.experiments.run.config import CHECKPOINT_FILE

RUN = ["sample", "--dataset", "mnist", "--prior", "horseshoe", "--sampler", "identity"]
RUN += ["--lr", "0.05", "--width", "8", "--subset", "200", "--eval-subset", "50"]
RUN += ["--batch-size", "50", "--burn-in", "2", "--thinning", "2", "--eval-batch-size", "50"]
RUN += ["--no-progress", "--no-plot", "--threads", "1"]


def sample(mnist_dir: Path, out: Path, *extra: str) -> int:
    return main([*RUN, "--data-dir", str(mnist_dir), "--out", str(out), *extra])


def forbid_work(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_work(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("data were loaded")

    monkeypatch.setattr(sgrld.data, "load_dataset", no_work)


def deterministic(out: Path) -> dict[str, Any]:
    results = json.loads((out / "results.json").read_text())
    return {k: results[k] for k in ("status", "curves", "final", "num_samples", "global_steps")}


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of one epoch (four updates) of the real MNIST subset, to damage in copies."""
    path = mnist_path()
    if not (path / "train-images-idx3-ubyte.gz").exists():
        pytest.skip(f"real MNIST not found in {path} (set SGRLD_DATA_DIR)")
    out = tmp_path_factory.mktemp("one-epoch") / "run"
    assert sample(path, out, "--epochs", "1") == 0
    return out


def copy_run(one_epoch: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(one_epoch, out)
    return out


# --- 1. checkpoint integrity ---------------------------------------------------------------------


def flip_byte(data: bytes) -> bytes:
    middle = len(data) // 2  # inside the payload's tensor data
    return data[:middle] + bytes([data[middle] ^ 0x01]) + data[middle + 1 :]


def bare_torch_file(data: bytes) -> bytes:
    """What torch.save alone writes (an older sgrld's checkpoint): no integrity header."""
    return data[data.index(b"\n", len("sgrld-checkpoint\n")) + 1 :]


DAMAGE = {
    "flipped byte": (flip_byte, "SHA-256 does not match"),
    "truncated": (lambda data: data[: len(data) * 2 // 3], "truncated"),
    "empty": (lambda data: b"", "is empty"),
    "foreign": (lambda data: b"<html>not a checkpoint</html>\n" * 40, "no sgrld integrity header"),
    "bare torch file": (bare_torch_file, "bare torch file"),
    "padded": (lambda data: data + b"\0" * 64, "truncated or padded"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_checkpoint_is_refused_before_any_work(
    damage: str,
    one_epoch: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = copy_run(one_epoch, tmp_path)
    checkpoint = out / CHECKPOINT_FILE
    change, reason = DAMAGE[damage]
    checkpoint.write_bytes(change(checkpoint.read_bytes()))
    with pytest.raises(CheckpointError, match=reason):
        load_checkpoint(checkpoint)
    forbid_work(monkeypatch)
    assert sample(tmp_path, out, "--epochs", "2", "--resume") == 2
    err = capsys.readouterr().err
    assert str(checkpoint) in err and reason in err
    assert "weights_only" not in err and err.count("\n") == 1


def resave(checkpoint: Path, edit: Any) -> None:
    """Change a checkpoint's content and write it with a valid checksum (not bit damage)."""
    state = load_checkpoint(checkpoint)
    edit(state)
    _io.save_checkpoint(checkpoint, state)


def first_weight(state: dict[str, Any]) -> str:
    return next(k for k, v in state["model"].items() if v.ndim == 2)


def transpose_weight(state: dict[str, Any]) -> None:
    key = first_weight(state)
    state["model"][key] = state["model"][key].t().contiguous()


def nan_weight(state: dict[str, Any]) -> None:
    state["model"][first_weight(state)][0, 0] = float("nan")


def inf_accumulator(state: dict[str, Any]) -> None:
    state["ensembles"]["test"]["log_sum_exp"][3, 1] = float("inf")


MISFITS = {
    "transposed weight": (transpose_weight, "this run needs"),
    "missing model entry": (lambda s: s["model"].pop(first_weight(s)), "model has no"),
    "unexpected model entry": (
        lambda s: s["model"].__setitem__("extra", torch.zeros(2)),
        "unexpected extra",
    ),
    "missing optimizer": (lambda s: s.pop("optimizer"), "incomplete: no optimizer"),
    "NaN in the model": (nan_weight, "NaN or Inf in model."),
    "Inf in an accumulator": (inf_accumulator, "NaN or Inf in ensembles.test"),
}


@pytest.mark.parametrize("misfit", list(MISFITS))
def test_misfitting_or_nonfinite_checkpoint_is_refused_before_any_work(
    misfit: str,
    one_epoch: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = copy_run(one_epoch, tmp_path)
    edit, reason = MISFITS[misfit]
    resave(out / CHECKPOINT_FILE, edit)
    forbid_work(monkeypatch)
    assert sample(tmp_path, out, "--epochs", "2", "--resume") == 2
    err = capsys.readouterr().err
    assert str(out / CHECKPOINT_FILE) in err and reason in err and err.count("\n") == 1


def test_misfitting_sampler_state_is_refused_not_a_traceback(
    one_epoch: Path,
    tmp_path: Path,
    mnist_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Checked only once the run is built (the sampler's state has no fixed shape before).
    out = copy_run(one_epoch, tmp_path)

    def other_optimizer(state: dict[str, Any]) -> None:
        state["optimizer"] = {"state": {}, "param_groups": []}  # a plain torch.optim state

    resave(out / CHECKPOINT_FILE, other_optimizer)
    assert sample(mnist_dir, out, "--epochs", "2", "--resume") == 2
    err = capsys.readouterr().err
    assert f"checkpoint {out / CHECKPOINT_FILE} does not fit this run" in err


def test_broken_down_checkpoint_may_hold_nan(tmp_path: Path) -> None:
    # A run that broke down is saved as it stopped; resuming it reports, never refuses it.
    out = tmp_path / "run"
    out.mkdir()
    state = {"format": "sgrld-sample-checkpoint/1", "status": "broken_down"}
    state |= {key: {} for key in ("config", "optimizer", "ensembles", "curves", "timing")}
    state |= {"epoch": 1, "global_step": 4, "broken_down": {}, "curvature_means": []}
    state |= {"data_order_generator": torch.zeros(1), "curvature_generator": torch.zeros(1)}
    state["model"] = {"w": torch.tensor([float("nan")])}
    _io.save_checkpoint(out / CHECKPOINT_FILE, state)
    assert load_checkpoint(out / CHECKPOINT_FILE)["status"] == "broken_down"
    state["status"] = "running"
    _io.save_checkpoint(out / CHECKPOINT_FILE, state)
    with pytest.raises(CheckpointError, match=r"NaN or Inf in model\.w"):
        load_checkpoint(out / CHECKPOINT_FILE)


# --- 2. one run per output directory ------------------------------------------------------------


def hold_lock(directory: Path) -> subprocess.Popen[str]:
    """Another process holding ``directory``'s lock until it is killed."""
    code = (
        "import sys, time\n"
        "from sgrld.experiments.base.files import DirectoryLock\n"
        f"with DirectoryLock({str(directory)!r}, 'sgrld sample'):\n"
        "    print('locked', flush=True)\n"
        "    time.sleep(120)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
    return holder


def test_second_sample_run_on_one_out_is_refused_until_the_holder_dies(
    tmp_path: Path,
    mnist_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "run"
    holder = hold_lock(out)
    try:
        with monkeypatch.context() as patch:
            forbid_work(patch)
            assert sample(mnist_dir, out, "--epochs", "1") == 2
        err = capsys.readouterr().err
        assert f"{out} is in use by another run (pid {holder.pid} on " in err
    finally:
        holder.kill()  # SIGKILL: the kernel releases the lock; its file stays behind
        holder.communicate()
    assert (out / _io.LOCK_FILE).exists()
    assert sample(mnist_dir, out, "--epochs", "1") == 0
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pt", "results.json"]


def test_second_funnel_run_on_one_out_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    holder = hold_lock(tmp_path)
    try:
        assert main(["funnel", "--out", str(tmp_path), "--steps", "10", "--no-plot"]) == 2
        assert f"(pid {holder.pid} on " in capsys.readouterr().err
    finally:
        holder.kill()
        holder.communicate()


def test_concurrent_writers_never_share_a_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "results.json"
    write_all = _io._write_all

    def interleaved(fd: int, data: bytes) -> None:
        write_all(fd, data[:5])
        if data == b"first writer":  # a second writer starts and ends in the middle
            _io.write_atomic(target, b"second writer")
        write_all(fd, data[5:])

    monkeypatch.setattr(_io, "_write_all", interleaved)
    _io.write_atomic(target, b"first writer")
    assert target.read_bytes() == b"first writer"
    assert list(tmp_path.iterdir()) == [target]


# --- 3. the funnel's workers and outputs --------------------------------------------------------


def descendants(pid: int) -> set[int]:
    """Live processes below ``pid`` (from /proc; zombies excluded)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parents[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    todo = [pid]
    while todo:
        pid = todo.pop()
        children = [child for child, parent in parents.items() if parent == pid]
        found.update(children)
        todo += children
    return found


def alive(pids: set[int]) -> set[int]:
    result = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            result.add(pid)
    return result


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads the process tree from /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_killing_the_funnel_parent_ends_its_workers(sig: signal.Signals, tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "sgrld.cli", "funnel", "--out", str(tmp_path / "out")]
    argv += ["--steps", "2000000", "--samplers", "identity,rmsprop", "--jobs", "2"]
    argv += ["--no-compile", "--no-plot", "--no-progress"]
    parent = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(descendants(parent.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)  # the resource tracker and two workers
        children = descendants(parent.pid)
        assert len(children) >= 3, "the workers never started"
        time.sleep(1.0)  # inside the samplers
        parent.send_signal(sig)
        _, err = parent.communicate(timeout=30)
        deadline = time.monotonic() + 10
        while alive(children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(children), f"survived their parent: {alive(children)}"
    finally:
        for pid in alive(descendants(parent.pid) | {parent.pid}):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        parent.wait()
    if sig != signal.SIGKILL:
        assert parent.returncode == {signal.SIGTERM: 143, signal.SIGINT: 130}[sig]
        assert err.splitlines()[-1] in (
            "interrupted",
            "sgrld funnel: terminated; workers stopped",
        )
    assert not (tmp_path / "out" / "funnel.json").exists()


FUNNEL = ["funnel", "--steps", "20", "--samplers", "identity", "--no-compile", "--jobs", "1"]
FUNNEL += ["--no-progress"]


def test_funnel_refuses_a_non_empty_out_without_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*FUNNEL, "--out", str(tmp_path), "--no-plot"]) == 0
    first = (tmp_path / "funnel.json").read_bytes()
    assert main([*FUNNEL, "--out", str(tmp_path), "--no-plot", "--seed", "2"]) == 2
    assert "is not empty (funnel.json, funnel_samples.npz); pass --force" in capsys.readouterr().err
    assert (tmp_path / "funnel.json").read_bytes() == first
    assert main([*FUNNEL, "--out", str(tmp_path), "--no-plot", "--seed", "2", "--force"]) == 0
    assert funnel.read_outputs(tmp_path)["config"]["seed"] == 2


def test_funnel_outputs_are_one_unit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert main([*FUNNEL, "--out", str(tmp_path)]) == 0
    record = funnel.read_outputs(tmp_path)
    assert set(record["files"]) == {"funnel_samples.npz", "funnel.png"}
    old_samples = (tmp_path / "funnel_samples.npz").read_bytes()

    # Killed between the files of a second run: no funnel.json of the first run stays beside
    # the second run's samples.
    write_atomic = funnel.write_atomic

    def killed_before_the_record(path: Path, data: bytes | str) -> None:
        if Path(path).name == "funnel.json":
            raise KeyboardInterrupt
        write_atomic(path, data)

    monkeypatch.setattr(funnel, "write_atomic", killed_before_the_record)
    assert main([*FUNNEL, "--out", str(tmp_path), "--seed", "5", "--force"]) == 130
    assert (tmp_path / "funnel_samples.npz").read_bytes() != old_samples
    assert not (tmp_path / "funnel.json").exists()
    with pytest.raises(ValueError, match="holds no complete funnel run"):
        funnel.read_outputs(tmp_path)

    # A file swapped after the fact is caught by the record's hashes.
    monkeypatch.setattr(funnel, "write_atomic", write_atomic)
    assert main([*FUNNEL, "--out", str(tmp_path), "--force"]) == 0
    (tmp_path / "funnel_samples.npz").write_bytes(old_samples[:-1] + b"x")
    with pytest.raises(ValueError, match=r"funnel_samples\.npz is not the file written with"):
        funnel.read_outputs(tmp_path)


# --- 7. disk full ------------------------------------------------------------------------------


def disk_fills_at(monkeypatch: pytest.MonkeyPatch, call: int, *, lasting: bool) -> None:
    """The ``call``-th file write (1-based) and, if ``lasting``, every later one hit ENOSPC."""
    write_all = _io._write_all
    calls = [0]

    def full(fd: int, data: bytes) -> None:
        calls[0] += 1
        if calls[0] == call or (lasting and calls[0] > call):
            write_all(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write_all(fd, data)

    monkeypatch.setattr(_io, "_write_all", full)


@pytest.mark.parametrize("lasting", [False, True])
def test_disk_full_keeps_the_last_checkpoint_and_says_so(
    lasting: bool,
    tmp_path: Path,
    mnist_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        disk_fills_at(patch, 3, lasting=lasting)  # epoch 1: checkpoint, results; epoch 2: ...
        assert sample(mnist_dir, out, "--epochs", "3") == 74
    err = capsys.readouterr().err
    reason = f"cannot write {out / CHECKPOINT_FILE}: no space left on device"
    assert err == f"sgrld sample: error: {reason}\n"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pt", "results.json"]
    assert load_checkpoint(out / CHECKPOINT_FILE)["epoch"] == 1
    results = json.loads((out / "results.json").read_text())
    if lasting:  # no room to say so: the last good results stay
        assert results["status"] == "running" and results["epochs_completed"] == 1
    else:
        assert results["status"] == "failed"
        assert "no space left on device" in results["failure"]
    # Space is back: resuming gives the uninterrupted run's results.
    assert sample(mnist_dir, out, "--epochs", "3", "--resume") == 0
    assert sample(mnist_dir, tmp_path / "straight", "--epochs", "3") == 0
    assert deterministic(out) == deterministic(tmp_path / "straight")


def test_exit_statuses_are_documented() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for status in ("0 done", "2 bad input", "3 a chain broke down", "74 an output", "130", "143"):
        assert status in (parser.epilog or "")
    parser = argparse.ArgumentParser()
    funnel_command.add_arguments(parser)
    for status in ("0 done", "2 bad input", "74 an output", "143 terminated"):
        assert status in (parser.epilog or "")


# --- 8. Ctrl-C during start-up -----------------------------------------------------------------


def test_the_command_line_imports_torch_only_inside_its_interrupt_handler() -> None:
    code = "import sys, sgrld.cli; print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout == "[]\n", result.stderr


def importing_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def reading_data(pid: int) -> bool:
    links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
    return any("-ubyte" in link for link in links)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="watches the process through /proc")
@pytest.mark.parametrize("moment", [importing_torch, reading_data])
def test_ctrl_c_during_start_up_exits_130(moment: Any, tmp_path: Path, mnist_dir: Path) -> None:
    # The console script's own start-up (the interpreter, `import sgrld.cli`: ~50 ms, no torch)
    # is before any of sgrld's code runs; from main() on, Ctrl-C is handled.
    argv = [sys.executable, "-c", "import sys, sgrld.cli; sys.exit(sgrld.cli.main())"]
    argv += [*RUN, "--epochs", "1", "--data-dir", str(mnist_dir), "--out", str(tmp_path / "run")]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sent = False
    while not sent and process.poll() is None:
        with contextlib.suppress(OSError):
            if moment(process.pid):
                process.send_signal(signal.SIGINT)
                sent = True
        time.sleep(0.01)
    _, err = process.communicate(timeout=60)
    if not sent:
        pytest.skip(f"the run ended before {moment.__name__} was seen")
    # one line, with the way to go on (a --resume without a checkpoint starts afresh)
    assert (process.returncode, err) == (130, f"interrupted; {RESUME_HINTS['sample']}\n")
