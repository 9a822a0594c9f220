"""Faults of the third round (issue 33): a foreign checkpoint, links and special files, one-line
errors and options that silently won (items 5 to 12; items 1 to 4 are in ``tests/test_health.py``,
``tests/test_warmup.py`` and ``tests/test_precision.py``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sgrld.cli import main
from sgrld.experiments.base import exits
from test_faults import TINY, code_of, one_line_error


def test_resume_refuses_a_checkpoint_of_another_run_naming_both(
    mnist_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # item 5: a Shampoo or ℓ = 0.02 checkpoint copied into a Monge run's folder (a width-32 one
    # differs in a field as ℓ does: the same comparison of every config field)
    data = ["--data-dir", str(mnist_dir.parent), "--no-plot"]
    monge = tmp_path / "monge"
    base = ["sample", "--sampler", "monge", "--lr", "0.01", "--alpha2", "1", *TINY, *data]
    assert main([*base, "--out", str(monge)]) == 0
    precious = (monge / "results.json").read_text()
    foreign = {
        "shampoo": ["--sampler", "shampoo", "--lr", "0.01"],
        "lr": ["--sampler", "monge", "--lr", "0.02", "--alpha2", "1"],
    }
    for name, flags in foreign.items():
        other = tmp_path / name
        argv = ["sample", *TINY, *flags, *data, "--out", str(other)]
        assert main(argv) == 0
        shutil.copy(other / "checkpoint.pt", monge / "checkpoint.pt")
        capsys.readouterr()
        code = code_of(["sample", "--resume", "--out", str(monge), "--epochs", "2", *data])
        assert code == exits.USAGE, name
        err = capsys.readouterr().err
        one_line_error(err, "checkpoint.pt is not the run of results.json", "monge")
        assert err.count("cannot resume") == 1, err
        assert (monge / "results.json").read_text() == precious


# --- item 6-9: no write, read or code execution through a link or a special file --------------
# One case per path a command writes or reads under --out: plant a link to an outside folder or
# file (or a FIFO, a device, a hard link) and check that the command refuses with one line and a
# documented status and that nothing outside --out changed. A new writer: one more line here.


def _sweep(out: Path, data: Path, *extra: str) -> list[str]:
    return ["sweep", "--sampler", "identity", "--lr", "0.05", *TINY, "--data-dir", str(data),
            "--out", str(out), *extra]  # fmt: skip


def _lock_digest() -> str:
    import hashlib

    from test_faults import RUN

    return hashlib.sha256(RUN.encode()).hexdigest()[:16]


LINK, SPECIAL = "symbolic link", "not a regular file"
PLANTS = {
    # name: (path under OUT, what is planted, command, exit statuses, what the error says)
    "sweep .locks/<digest>": (f".locks/{_lock_digest()}", "dir-link", "sweep", (1,), LINK),
    "sweep submitit folder": (".submitit", "dir-link", "sweep-submitit", (74,), LINK),
    "sweep submitit controllers.log": (
        ".submitit/controllers.log", "file-link", "sweep-submitit", (74,), LINK),
    "sample --chains 2 run folder": (
        "mnist-fc8-gaussian-identity-lr0.05-sub200-seed1", "dir-link", "chains", (74,), LINK),
    "sample --resume checkpoint, a FIFO": ("checkpoint.pt", "fifo", "resume", (2,), SPECIAL),
    "sample --resume checkpoint, /dev/zero": ("checkpoint.pt", "dev-zero", "resume", (2,), LINK),
    "table results.json, a FIFO": ("run/results.json", "fifo", "table", (2,), SPECIAL),
    "report results.json, a link to /dev/zero": (
        "run/results.json", "dev-zero", "report", (2,), LINK),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PLANTS))
def test_no_command_reads_or_writes_through_a_planted_link_or_special_file(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest
) -> None:
    import os
    import signal

    where, kind, command, statuses, said = PLANTS[name]
    out, outside, victim = tmp_path / "out", tmp_path / "outside", tmp_path / "victim"
    outside.mkdir()
    victim.write_text("precious\n")
    path = out / where
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "dir-link":
        path.symlink_to(outside, target_is_directory=True)
    elif kind == "file-link":
        path.symlink_to(victim)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    data = tmp_path / "data"
    data.mkdir()  # no MNIST: a command that got past its refusals fails later, visibly
    if command == "chains":  # the chains' folders are written after the first epoch
        data = request.getfixturevalue("mnist_dir").parent
    argv = {
        "sweep": _sweep(out, data),
        "sweep-submitit": _sweep(out, data, "--engine", "submitit-local"),
        "sample": ["sample", "--sampler", "identity", "--lr", "0.05", *TINY,
                   "--data-dir", str(data), "--out", str(out)],
        "chains": ["sample", "--sampler", "identity", "--lr", "0.05", "--chains", "2", *TINY,
                   "--data-dir", str(data), "--out", str(out), "--no-plot"],
        "resume": ["sample", "--resume", "--out", str(out), "--sampler", "identity",
                   "--lr", "0.05", *TINY, "--data-dir", str(data)],
        "table": ["table", str(out)],
        "report": ["report", str(out), "--out", str(tmp_path / "report"), "--no-figures"],
    }[command]  # fmt: skip

    def hung(*_: object) -> None:
        raise TimeoutError(f"{name}: blocked (a FIFO opened for reading)")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(300 if command == "chains" else 60)  # a loaded machine; a FIFO: forever
    try:
        code = code_of(argv)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    err = capsys.readouterr().err
    assert code in statuses, (code, err)
    assert "Traceback" not in err and said in err, err
    assert victim.read_text() == "precious\n"
    assert list(outside.iterdir()) == []


def test_a_hard_linked_lock_file_is_replaced_never_written_through(tmp_path: Path) -> None:
    # a folder snapshotted with hard links (cp -al, rsync --link-dest) shares its lock file's
    # inode with the snapshot: the lock writes a file of its own instead of refusing the folder
    import os

    from sgrld.experiments.base.files import LOCK_FILE, DirectoryLock

    victim, out = tmp_path / "victim", tmp_path / "out"
    victim.write_text("precious\n")
    out.mkdir()
    os.link(victim, out / LOCK_FILE)
    with DirectoryLock(out, "sample"):
        assert os.stat(out / LOCK_FILE).st_ino != os.stat(victim).st_ino
        assert "pid" in (out / LOCK_FILE).read_text()
    assert victim.read_text() == "precious\n" and os.stat(victim).st_nlink == 1


# --- items 11 and 12: options that silently won, one-line errors with the fix -----------------


def test_a_repeated_option_key_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sample", "--sampler", "rmsprop", "--option", "decay=0.9", "--option", "decay=0.5"]
    assert code_of([*argv, "--out", "unused"]) == exits.USAGE
    one_line_error(capsys.readouterr().err.splitlines()[-1], "decay given twice", "once")


def test_tasks_per_node_beyond_this_machine_is_refused_for_a_local_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sweep", "--sampler", "identity", "--lr", "0.05", *TINY, "--out", str(tmp_path)]
    argv += ["--engine", "submitit-local", "--parallel", "ddp", "--tasks-per-node", "1000"]
    assert code_of(argv) == exits.USAGE
    one_line_error(capsys.readouterr().err, "--tasks-per-node 1000", "CPU cores")


def test_library_options_are_checked_with_did_you_mean_and_the_list() -> None:
    import torch

    import sgrld

    p = [torch.nn.Parameter(torch.zeros(3))]
    cases = [
        (lambda: sgrld.MongeSGLD(p, lr=0.1, num_data=10, alpha=1.0), "did you mean 'alpha2'?"),
        (lambda: sgrld.ShampooSGLD(p, lr=0.1, num_data=10, block_sze=8), "block_size"),
        (lambda: sgrld.build("rmsprop", lr=0.1, num_data=10, dcay=0.9), "'decay'?"),
        (lambda: sgrld.SGLD(p, lr=0.1, num_data=10, adapt_untl=5), "'adapt_until'?"),
    ]
    for make, words in cases:
        with pytest.raises(TypeError) as caught:
            make()
        message = str(caught.value)
        assert words in message and "the options of" in message, message
        assert "Metric instance" not in message  # no Metric was passed
    with pytest.raises(TypeError, match="given with a MongeMetric instance; set them on"):
        sgrld.SGRLDOptimizer(p, lr=0.1, num_data=10, metric=sgrld.MongeMetric(), alpha2=0.5)
    with pytest.raises(ValueError, match="num_data >= 1"):
        sgrld.SGLD(p, lr=0.1, num_data=0.5)


def test_a_rank_that_lost_its_peers_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # item 10: a killed rank under torchrun left the survivor with a whole gloo traceback
    import torch

    from sgrld.experiments.run import launch
    from sgrld.experiments.run.parallel import DataParallel

    def lost(*args: object, **kwargs: object) -> int:
        raise torch.distributed.DistBackendError(
            "[../gloo/transport/tcp/pair.cc:534] Connection reset by peer\n  frames ..."
        )

    monkeypatch.setattr(launch, "join_parallel", lambda *a: DataParallel(1, 2))
    monkeypatch.setattr(launch, "run_locked", lost)
    argv = ["sample", "--sampler", "identity", "--lr", "0.05", *TINY, "--out", str(tmp_path)]
    assert code_of([*argv, "--data-dir", str(tmp_path)]) == exits.FAILED
    one_line_error(capsys.readouterr().err, "rank 1 lost the other ranks", "Connection reset")
