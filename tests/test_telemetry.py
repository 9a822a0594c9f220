"""Per-step telemetry: summed on the device, read once; its figures and its cost."""

from __future__ import annotations

import math

import pytest
import torch

import sgrld
from conftest import SAMPLERS, SamplerSpec

N = 100


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [
        torch.nn.Parameter(torch.randn(8, 6, dtype=torch.float64)),
        torch.nn.Parameter(torch.randn(6, dtype=torch.float64)),
    ]


def test_steps_read_nothing_on_the_host(spec: SamplerSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    """With deferred checks a step with telemetry makes no host read: any item/tolist/bool
    of a tensor inside the steps would raise here."""
    params = _params()
    opt = spec.make_optimizer(params, lr=0.01, num_data=N, telemetry=True, sync_checks=False)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()  # first step: lazily built buffers

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("host read inside a step")

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__"):
            m.setattr(torch.Tensor, name, refuse)
        for _ in range(2):  # not on a Shampoo refresh step (update_interval 3)
            opt.step()
    figures = opt.telemetry()
    assert figures["steps"] == 3.0
    assert opt.telemetry()["steps"] == 0.0  # reset by the read


def test_sgld_figures_are_exact() -> None:
    params = _params()
    lr, temperature = 0.01, 1.0
    opt = sgrld.SGLD(params, lr=lr, num_data=N, telemetry=True)
    theta_sq = []
    for _ in range(5):
        for p in params:
            p.grad = torch.full_like(p, 2.0)
        theta_sq.append(sum(float(p.detach().square().sum()) for p in params))
        opt.step()
    d = sum(p.numel() for p in params)
    f = opt.telemetry()
    assert f["drift_rms"] == pytest.approx(lr * 2.0 * math.sqrt(d), rel=1e-12)
    assert f["theta_norm"] == pytest.approx(math.sqrt(sum(theta_sq) / 5), rel=1e-12)
    sigma = math.sqrt(2 * lr * temperature / N)
    # ‖ξ‖² ~ χ²_D: 5 steps of D = 54 — within 5 of its standard deviations
    assert abs(f["noise_rms"] ** 2 / sigma**2 - d) < 5 * math.sqrt(2 * d / 5)


def test_one_mapping_for_the_chain_and_one_per_group_on_request() -> None:
    # issue 31 item 4: one optimizer gave a one-element list; θ's figure is a norm, named so
    a, b = _params(), _params()
    opt = sgrld.SGLD([{"params": a}, {"params": b, "lr": 0.02}], lr=0.01, num_data=N,
                     telemetry=True)  # fmt: skip
    for p in (*a, *b):
        p.grad = torch.ones_like(p)
    opt.step()
    groups = opt.telemetry(reset=False, per_group=True)
    whole = opt.telemetry()
    assert len(groups) == 2 and whole["steps"] == 1.0 and "theta_rms" not in whole
    for key in ("drift_rms", "noise_rms", "theta_norm"):
        assert whole[key] ** 2 == pytest.approx(sum(g[key] ** 2 for g in groups), rel=1e-12)
    norm = math.sqrt(sum(float(p.detach().square().sum()) for p in (*a, *b)))
    assert whole["theta_norm"] == pytest.approx(norm, rel=1e-3)  # θ before the move


def test_metric_figures() -> None:
    params = _params()
    monge = sgrld.MongeSGLD(  # the paper's fixed α²: stretch α²|m|²
        params, lr=0.01, num_data=N, alpha2=0.5, alpha2_rule="fixed", telemetry=True
    )
    for p in params:
        p.grad = torch.ones_like(p)
    monge.step()
    m_sq = sum(float((0.1 * torch.ones_like(p)).square().sum()) for p in params)  # m = (1−λ)g
    assert monge.telemetry()["stretch"] == pytest.approx(0.5 * m_sq, rel=1e-12)
    shampoo = sgrld.ShampooSGLD(
        _params(), lr=0.01, num_data=N, telemetry=True, eps=1e-4, block_size=4
    )
    assert shampoo.telemetry()["factor_condition"] == pytest.approx(1.0)  # ε·I
    with pytest.raises(RuntimeError, match="telemetry=True"):
        sgrld.SGLD(_params(), lr=0.01, num_data=N).telemetry()


def test_telemetry_does_not_change_the_chain(spec: SamplerSpec) -> None:
    runs = []
    for on in (False, True):
        params = _params()
        opt = spec.make_optimizer(
            params, lr=0.01, num_data=N, telemetry=on, generator=torch.Generator().manual_seed(1)
        )
        for t in range(4):
            for i, p in enumerate(params):
                p.grad = torch.sin(p.detach() + t + i)
            opt.step()
        runs.append(params)
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


assert [s.name for s in SAMPLERS]  # the registry fixture drives the parametrised tests


@pytest.mark.parametrize("metric", ["identity", "monge", "shampoo"])
def test_chains_telemetry_is_each_chains_own(metric: str) -> None:
    """K chains' figures, one row per chain, equal those of each chain run alone."""

    def make(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Linear(6, 4, dtype=torch.float64)

    options = {"block_size": 4} if metric == "shampoo" else {}
    sampler = sgrld.build(metric, lr=0.01, num_data=N, noise="philox", **options)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 8, 6, generator=gen, dtype=torch.float64)
    y = torch.randn(4, 3, 8, 4, generator=gen, dtype=torch.float64)

    def loss(m: torch.nn.Module, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        return ((m(xs) - ys) ** 2).mean()

    together = sgrld.Chains(make, sampler, [0, 1, 2], telemetry=True)
    alone = [sgrld.Chains(make, sampler, [s], telemetry=True) for s in (0, 1, 2)]
    for t in range(4):
        together.step(loss, x[t], y[t])
        for k, chain in enumerate(alone):
            chain.step(loss, x[t, k : k + 1], y[t, k : k + 1])
    figures = together.telemetry()
    assert len(figures) == 3
    for k, chain in enumerate(alone):
        (own,) = chain.telemetry()
        assert own.keys() == figures[k].keys()
        for key, value in own.items():
            assert figures[k][key] == pytest.approx(value, rel=1e-9), key
