"""Passes over the parameters that one optimizer step makes, per sampler: what ``opt.step()``
reads and writes, counted kernel by kernel (no timing, so a loaded machine does not matter).

Every ATen call inside one ``opt.step()`` (the 5th, after the warm-up of buffers) is seen through
a ``TorchDispatchMode``; a call that reads or writes at least half of D elements (D = the number
of parameters) counts as one *pass*, and its reads and writes are summed in units of D (a foreach
call over every parameter is one pass). Views, metadata and small tensors (ℓ, σ, per-tensor sums)
do not count. MLP 784-400-400-10 (D = 478,410), float32, CPU, the default options of each
optimizer (``noise="torch"``, sync checks) and, with ``--compare``, another ``src`` tree run the
same way in a subprocess (``PYTHONPATH``)::

    .venv/bin/python benchmarks/step_passes.py [--only SGLD,RMSprop] [--ops] [--compare DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import sgrld

SAMPLERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.05, foreach=True),
    "SGLD": lambda ps: sgrld.SGLD(ps, lr=0.05, num_data=50_000),
    "RMSprop": lambda ps: sgrld.RMSpropSGLD(ps, lr=2.5e-4, num_data=50_000),
    "Adam": lambda ps: sgrld.SGRLDOptimizer(ps, lr=2.5e-4, num_data=50_000, metric="adam"),
    "Wenzel": lambda ps: sgrld.WenzelSGLD(ps, lr=0.05, num_data=50_000),
    "Monge": lambda ps: sgrld.MongeSGLD(ps, lr=0.05, num_data=50_000, alpha2=1.25),
}


class Passes(TorchDispatchMode):
    """Records (op, reads/D, writes/D) of every call on a parameter-sized tensor."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
        self.calls: list[tuple[str, float, float, int]] = []  # op, reads/D, writes/D, numel

    @property
    def rows(self) -> list[tuple[str, float, float]]:
        """The passes: calls (merged over segments) that read or write at least D/2."""
        return [(op, r, w) for op, r, w, _ in self.calls if r + w >= 0.5]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            return out  # a view
        written: list[torch.Tensor] = []
        read: list[torch.Tensor] = []
        named = dict(zip((a.name for a in schema.arguments), args, strict=False)) | kwargs
        for arg in schema.arguments:
            value = named.get(arg.name)
            tensors = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
            if arg.alias_info is not None and arg.alias_info.is_write:
                written += tensors
                if arg.name != "out":  # an in-place op reads what it writes
                    read += tensors
            else:
                read += tensors
        if not any(r.alias_info is not None for r in schema.returns):
            written += [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        big = self.size // 1000  # a parameter tensor of the MLP or more; not ℓ, σ or sums
        first = max((t.numel() for t in read + written), default=0)
        if first < big:
            return out
        reads = sum(t.numel() for t in read if t.numel() >= big) / self.size
        writes = sum(t.numel() for t in written if t.numel() >= big) / self.size
        # one op over the parameters' segments in turn (a sum or dot per tensor) is one pass
        last = self.calls[-1] if self.calls else None
        if last and last[0] == func.overloadpacket.__name__ and last[3] + first <= self.size:
            self.calls[-1] = (last[0], last[1] + reads, last[2] + writes, last[3] + first)
            return out
        self.calls.append((str(func.overloadpacket.__name__), reads, writes, first))
        return out


def count(name: str) -> list[tuple[str, float, float]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 400), nn.ReLU(), nn.Linear(400, 400), nn.ReLU())
    model.append(nn.Linear(400, 10))
    opt = SAMPLERS[name](list(model.parameters()))
    size = sum(p.numel() for p in model.parameters())
    x, y = torch.randn(100, 784), torch.randint(0, 10, (100,))
    for step in range(5):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if step < 4:
            opt.step()
    mode = Passes(size)
    with mode:
        opt.step()
    return mode.rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(SAMPLERS))
    parser.add_argument("--ops", action="store_true", help="list each pass's op")
    parser.add_argument("--compare", metavar="SRC", help="another src/ tree, counted alike")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n]
    counts = {n: count(n) for n in names}
    if args.json:
        print(json.dumps(counts))
        return
    other: dict[str, list[tuple[str, float, float]]] = {}
    if args.compare:
        env = {**os.environ, "PYTHONPATH": args.compare}
        cmd = [sys.executable, os.path.abspath(__file__), "--only", args.only, "--json"]
        other = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True).stdout)
    head = "sampler | passes | D read | D written"
    print(head + (" | passes (--compare) | D read | D written" if other else ""))
    for name, rows in counts.items():
        line = (
            f"{name} | {len(rows)} | {sum(r[1] for r in rows):.1f} | {sum(r[2] for r in rows):.1f}"
        )
        if name in other:
            o = other[name]
            line += f" | {len(o)} | {sum(r[1] for r in o):.1f} | {sum(r[2] for r in o):.1f}"
        print(line)
        if args.ops:
            print("    " + ", ".join(r[0] for r in rows))
            if name in other:
                print("    (compare) " + ", ".join(r[0] for r in other[name]))


if __name__ == "__main__":
    main()
