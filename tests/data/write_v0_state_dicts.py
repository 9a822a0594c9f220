"""Write ``v0_state_dicts.pt``: optimizer state dicts in the format of sgrld before issue 18.

Run once with that revision checked out (``.venv/bin/python tests/data/write_v0_state_dicts.py``);
the file is committed, so that ``tests/test_conformance.py`` checks that such dicts still load.
For every sampler of the registry (default option set, temperature 0, so that the continuation
depends on the converted statistics and step count only, not on how noise is drawn) it holds
the model and optimizer state after 4 steps and the parameters after 4 more.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from optim_db import OPTIMIZERS, Net, snapshot, train  # noqa: E402

SPLIT, TOTAL = 4, 8


def main() -> None:
    out = {}
    for info in OPTIMIZERS:
        model = Net()
        opt = info.make(model.parameters(), temperature=0.0)
        train(opt, model, range(SPLIT))
        saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
        train(opt, model, range(SPLIT, TOTAL))
        out[info.metric] = {**saved, "after": snapshot(model)}
    torch.save({"split": SPLIT, "total": TOTAL, "samplers": out}, HERE / "v0_state_dicts.pt")


if __name__ == "__main__":
    main()
