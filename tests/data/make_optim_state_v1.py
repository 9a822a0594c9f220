"""Writes ``optim_state_v1.pt``: each sampler's optimizer state dict in sgrld's first format
(the sampler state in a top-level ``"sgrld"`` entry beside an empty torch ``state``), as main
wrote it at commit 3b5f9eb, with the parameters and where three more steps take them.

Run from the repository root with that revision installed; ``tests/test_optim_state.py`` loads
the file with today's optimizers and checks that they continue bit-identically.
"""

import torch

import sgrld

OPTIONS = {
    "sgld": (sgrld.SGLD, {}),
    "rmsprop": (sgrld.RMSpropSGLD, {}),
    "wenzel": (sgrld.WenzelSGLD, {"refresh_every": 2}),
    "monge": (sgrld.MongeSGLD, {"alpha2": 0.5}),
    "shampoo": (sgrld.ShampooSGLD, {"block_size": 4, "update_interval": 2}),
}


def make(name: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    cls, options = OPTIONS[name]
    generator = torch.Generator().manual_seed(1)
    return cls(params, lr=0.01, num_data=100, generator=generator, **options)


def set_grads(params: list[torch.Tensor], t: int) -> None:
    g = torch.Generator().manual_seed(100 + t)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)


def main() -> None:
    torch.manual_seed(0)
    out = {}
    for name in OPTIONS:
        params = [torch.randn(6, 5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)]
        opt = make(name, params)
        for t in range(3):
            set_grads(params, t)
            opt.step()
        saved = {"params": [p.clone() for p in params], "optimizer": opt.state_dict()}
        for t in range(3, 6):
            set_grads(params, t)
            opt.step()
        saved["after"] = [p.clone() for p in params]
        out[name] = saved
    torch.save(out, "tests/data/optim_state_v1.pt")


if __name__ == "__main__":
    main()
