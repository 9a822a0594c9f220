"""Writes tests/data/optim_state_v1.pt with sgrld's first optimizer state-dict format
(sampler state under a top-level "sgrld" entry), as main wrote it at 3b5f9eb."""
import torch, sgrld
torch.manual_seed(0)
out = {}
kinds = {
    "sgld": lambda ps: sgrld.SGLD(ps, lr=0.01, num_data=100, generator=torch.Generator().manual_seed(1)),
    "rmsprop": lambda ps: sgrld.RMSpropSGLD(ps, lr=0.01, num_data=100, generator=torch.Generator().manual_seed(1)),
    "wenzel": lambda ps: sgrld.WenzelSGLD(ps, lr=0.01, num_data=100, refresh_every=2, generator=torch.Generator().manual_seed(1)),
    "monge": lambda ps: sgrld.MongeSGLD(ps, lr=0.01, num_data=100, alpha2=0.5, generator=torch.Generator().manual_seed(1)),
    "shampoo": lambda ps: sgrld.ShampooSGLD(ps, lr=0.01, num_data=100, block_size=4, update_interval=2, generator=torch.Generator().manual_seed(1)),
}
def grads(params, t):
    g = torch.Generator().manual_seed(100 + t)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
for name, make in kinds.items():
    params = [torch.randn(6, 5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)]
    opt = make(params)
    for t in range(3):
        grads(params, t); opt.step()
    saved = {"params": [p.clone() for p in params], "optimizer": opt.state_dict()}
    for t in range(3, 6):
        grads(params, t); opt.step()
    saved["after"] = [p.clone() for p in params]
    out[name] = saved
torch.save(out, "tests/data/optim_state_v1.pt")
print({k: list(v["optimizer"]) for k, v in out.items()})
