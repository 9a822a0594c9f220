"""Checkpoints of a sampling run: read, checked for damage and fit before anything is restored."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from sgrld.experiments.base import files
from sgrld.experiments.base.files import CheckpointError
from sgrld.experiments.run.config import CHECKPOINT_FORMAT

#: The format of K chains' checkpoint (one run's is ``CHECKPOINT_FORMAT``).
CHAINS_CHECKPOINT_FORMAT = "sgrld-chains-checkpoint/1"
#: Top-level entries of one run's checkpoint and of K chains' (all checked before restoring).
CHECKPOINT_KEYS = (
    "format",
    "config",
    "epoch",
    "global_step",
    "status",
    "broken_down",
    "model",
    "optimizer",
    "data_order_generator",
    "curvature_generator",
    "ensembles",
    "curves",
    "curvature_means",
    "timing",
)
CHAINS_KEYS = ("configs", "epoch", "global_step", "chains", "records")


def load_checkpoint(path: str | os.PathLike[str], chains: bool = False) -> dict[str, Any]:
    """Read a run's checkpoint (``chains``: of K chains) onto the CPU, checking its SHA-256, its
    entries, and that no tensor holds NaN or Inf (but the accumulators' −Inf, and a broken-down
    run's model and sampler).

    Raises:
        CheckpointError: damaged, truncated, empty, foreign or incomplete (a ``ValueError``).
    """
    state = files.load_checkpoint(path)
    found = state.get("format") if isinstance(state, dict) else None
    if chains and found != CHAINS_CHECKPOINT_FORMAT:
        hint = "; it was made by a single run: resume it without --chains" if found else ""
        raise CheckpointError(f"checkpoint {path} is not a sgrld multi-chain checkpoint{hint}")
    if not chains and found != CHECKPOINT_FORMAT:
        hint = ""
        if str(found).startswith("sgrld-chains"):
            hint = " (a multi-chain run made it: resume it with its --chains, --lr and --alpha2)"
        raise CheckpointError(f"checkpoint {path} is not a sgrld sample checkpoint{hint}")
    missing = [key for key in (CHAINS_KEYS if chains else CHECKPOINT_KEYS) if key not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete: no {', '.join(missing)}")
    records = {f"records.{i}": r for i, r in enumerate(state["records"])} if chains else {"": state}
    bad: list[str] = []
    for name, record in records.items():
        bad += files.find_nonfinite(record["ensembles"], name or "ensembles", allow_minus_inf=True)
    if not chains and state["status"] != "broken_down":
        bad += files.find_nonfinite({"model": state["model"], "optimizer": state["optimizer"]})
    if bad:
        raise CheckpointError(f"checkpoint {path} is damaged: NaN or Inf in {', '.join(bad)}")
    return state


def tensor_mismatches(
    saved: Mapping[str, Any], expected: Mapping[str, Tensor], name: str
) -> list[str]:
    """What keeps ``saved`` from loading into tensors like ``expected`` (missing keys, shapes)."""
    if not isinstance(saved, Mapping):
        return [f"{name} is a {type(saved).__name__}, not a dict of tensors"]
    found = [f"{name} has no {key}" for key in expected if key not in saved]
    found += [f"{name} has an unexpected {key}" for key in saved if key not in expected]
    for key in [k for k in expected if k in saved]:
        got, want = saved[key], expected[key]
        if not isinstance(got, Tensor):
            found.append(f"{name}.{key} is a {type(got).__name__}, not a tensor")
        elif got.shape != want.shape or got.dtype != want.dtype:
            found.append(
                f"{name}.{key} is {got.dtype} {tuple(got.shape)}, this run needs "
                f"{want.dtype} {tuple(want.shape)}"
            )
    return found
