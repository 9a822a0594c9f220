"""Tests of sgrld.models: architectures, prior attachment, He init and the potential."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import distributions as D
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from sgrld.models import BayesianModel, FullyConnected, ResNet20, build_model, potential
from sgrld.priors import ConvCorrelatedNormal, GaussianPrior, PriorConfig


def numel(module: nn.Module, kind: type[nn.Module] | None = None) -> int:
    if kind is None:
        return sum(p.numel() for p in module.parameters())
    return sum(
        p.numel()
        for m in module.modules()
        if isinstance(m, kind)
        for n, p in m.named_parameters(recurse=False)
    )


@pytest.fixture(scope="module")
def resnet() -> BayesianModel:
    return build_model(
        "resnet20", prior="convcorrnormal", generator=torch.Generator().manual_seed(0)
    )


@pytest.mark.parametrize(("width", "count"), [(400, 478_410), (800, 1_276_810), (1200, 2_395_210)])
def test_fc_parameter_counts(width: int, count: int) -> None:
    assert numel(FullyConnected(width)) == count
    horseshoe = build_model("fc", width=width, prior="horseshoe")
    assert numel(horseshoe) == count + 6
    scales = [n for n, p in horseshoe.named_parameters() if p.dim() == 0]
    assert scales == [
        f"net.fc{i}.{w}_prior.raw_scale" for i in (1, 2, 3) for w in ("weight", "bias")
    ]


def test_resnet20_parameter_counts(resnet: BayesianModel) -> None:
    assert numel(resnet) == 272_474
    assert numel(resnet, nn.Conv2d) == 270_256
    assert numel(resnet, nn.BatchNorm2d) == 1_568
    assert numel(resnet, nn.Linear) == 650
    assert resnet(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_fc_prior_scales_and_log_prior_oracle() -> None:
    model = build_model("fc", width=400, prior="gaussian")
    priors = dict(model.named_priors())
    assert priors["net.fc1.weight"].scale == pytest.approx(1.41 / 28)  # type: ignore[union-attr]
    assert priors["net.fc2.weight"].scale == pytest.approx(0.0705)  # type: ignore[union-attr]
    assert priors["net.fc3.bias"].scale == 1.0  # type: ignore[union-attr]
    expected = torch.zeros((), dtype=torch.float64)
    for layer in (model.net.fc1, model.net.fc2, model.net.fc3):
        w, b = layer.weight.double(), layer.bias.double()
        expected += D.Normal(0.0, 1.41 / math.sqrt(layer.in_features)).log_prob(w).sum()
        expected += D.Normal(0.0, 1.0).log_prob(b).sum()
    torch.testing.assert_close(model.log_prior().double(), expected, rtol=1e-5, atol=0)


def test_horseshoe_fc_log_prior_oracle() -> None:
    for jacobian in (False, True):
        config = PriorConfig(horseshoe_jacobian=jacobian)
        model = BayesianModel(FullyConnected(20), "horseshoe", config).double()
        with torch.no_grad():
            model.net.fc2.weight_prior.raw_scale.fill_(-1.5)
        expected = torch.zeros((), dtype=torch.float64)
        for layer in (model.net.fc1, model.net.fc2, model.net.fc3):
            for name, sigma in (("weight", 1.41 / math.sqrt(layer.in_features)), ("bias", 1.0)):
                raw = getattr(layer, f"{name}_prior").raw_scale.detach()
                lam = F.softplus(raw)
                expected += D.Normal(0.0, sigma * lam).log_prob(getattr(layer, name)).sum()
                if jacobian:
                    expected += D.HalfCauchy(1.0).log_prob(lam) + F.logsigmoid(raw)
                else:
                    expected += D.HalfCauchy(1.0).log_prob(sigma * lam)
        torch.testing.assert_close(model.log_prior(), expected)


def test_resnet_priors(resnet: BayesianModel) -> None:
    priors = dict(resnet.named_priors())
    convs = [n for n, m in resnet.named_modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 21  # stem + 18 block convs + 2 shortcuts
    for name in convs:
        assert isinstance(priors[f"{name}.weight"], ConvCorrelatedNormal)
    assert not any(".bn" in n or "shortcut.1" in n for n in priors)  # BatchNorm is flat
    assert set(priors) == {f"{n}.weight" for n in convs} | {"net.head.2.weight", "net.head.2.bias"}
    assert priors["net.stem.0.weight"].scale == pytest.approx(0.814, abs=1e-3)  # type: ignore[union-attr]
    assert priors["net.stages.2.1.conv1.weight"].scale == pytest.approx(0.1763, abs=1e-4)  # type: ignore[union-attr]
    head = priors["net.head.2.weight"]
    assert isinstance(head, GaussianPrior) and head.scale == pytest.approx(1.41 / 8)
    # log p(θ) against MultivariateNormal / Normal oracles, summed over every prior
    expected = torch.zeros((), dtype=torch.float64)
    for name, prior in priors.items():
        value = resnet.get_parameter(name).detach().double()
        if isinstance(prior, ConvCorrelatedNormal):
            cov = prior.scale_tril.double() @ prior.scale_tril.double().T
            mvn = D.MultivariateNormal(torch.zeros(len(cov), dtype=torch.float64), cov)
            expected += mvn.log_prob(value.reshape(-1, len(cov))).sum()
        else:
            expected += D.Normal(0.0, prior.scale).log_prob(value).sum()  # type: ignore[arg-type]
    torch.testing.assert_close(resnet.log_prior().double(), expected, rtol=1e-5, atol=0)


def test_conv_fan_in_option() -> None:
    model = BayesianModel(ResNet20(), "gaussian", PriorConfig(conv_scale="fan_in"))
    priors = dict(model.named_priors())
    assert priors["net.stem.0.weight"].scale == pytest.approx(1.41 / math.sqrt(27))  # type: ignore[union-attr]
    assert priors["net.stages.1.0.shortcut.0.weight"].scale == pytest.approx(1.41 / 4)  # type: ignore[union-attr]


def test_potential_is_per_datum() -> None:
    g = torch.Generator().manual_seed(1)
    model = build_model("fc", width=16, prior="horseshoe", generator=g)
    x, y = torch.rand(8, 784, generator=g), torch.randint(0, 10, (8,), generator=g)
    nll = -D.Categorical(logits=model(x)).log_prob(y).mean()
    expected = nll - model.log_prior() / 50_000
    torch.testing.assert_close(potential(model, x, y, 50_000), expected)
    potential(model, x, y, 50_000).backward()
    assert all(p.grad is not None for p in model.parameters())  # horseshoe scales included
    with pytest.raises(ValueError, match="num_data"):
        potential(model, x, y, 0)


def test_he_init(resnet: BayesianModel) -> None:
    model = build_model(
        "fc", width=800, prior="horseshoe", generator=torch.Generator().manual_seed(3)
    )
    fc2 = model.net.fc2
    assert fc2.weight.std().item() == pytest.approx(math.sqrt(2 / 800), rel=0.01)
    assert fc2.bias.abs().max().item() <= 1 / math.sqrt(800)
    assert fc2.bias.abs().max().item() > 0.9 / math.sqrt(800)
    assert fc2.weight_prior.raw_scale.item() == pytest.approx(math.log(math.e - 1))
    stage3 = resnet.net.stages[2][1].conv1.weight
    assert stage3.std().item() == pytest.approx(math.sqrt(2 / (64 * 9)), rel=0.02)
    bn = resnet.net.stem[1]
    assert torch.equal(bn.weight, torch.ones(16)) and torch.equal(bn.bias, torch.zeros(16))


def test_init_is_reproducible_and_order_stable() -> None:
    a = build_model("resnet20", generator=torch.Generator().manual_seed(7))
    b = build_model("resnet20", generator=torch.Generator().manual_seed(7))
    names_a = [n for n, _ in a.named_parameters()]
    assert names_a == [n for n, _ in b.named_parameters()]
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_train_and_eval_modes(resnet: BayesianModel) -> None:
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    bn = resnet.net.stem[1]
    resnet.train()
    before = bn.running_mean.clone()
    train_out = resnet(x)
    assert not torch.equal(bn.running_mean, before)  # sampling updates running stats
    resnet.eval()
    frozen = bn.running_mean.clone()
    eval_out = resnet(x)
    assert torch.equal(bn.running_mean, frozen)
    torch.testing.assert_close(resnet(x), eval_out)
    assert not torch.allclose(train_out, eval_out)
    resnet.train()


class PotentialModule(nn.Module):
    def __init__(self, model: BayesianModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return potential(self.model, x, y, 1_000)


def test_potential_under_functional_call() -> None:
    """torch.func.functional_call substitutes parameters in the likelihood *and* the prior."""
    model = build_model(
        "fc", width=8, prior="horseshoe", generator=torch.Generator().manual_seed(4)
    )
    x, y = torch.rand(5, 784), torch.arange(5)
    params = {f"model.{n}": p.detach() * 1.5 + 0.1 for n, p in model.named_parameters()}
    got = functional_call(PotentialModule(model), params, (x, y))
    with torch.no_grad():
        for name, value in params.items():
            model.get_parameter(name.removeprefix("model.")).copy_(value)
    torch.testing.assert_close(got, potential(model, x, y, 1_000))


def test_argument_validation() -> None:
    with pytest.raises(ValueError, match="width"):
        FullyConnected(0)
    with pytest.raises(ValueError, match="width"):
        build_model("fc", width=-3)
    with pytest.raises(
        ValueError, match=r"unknown prior 'cauchy'; valid names: \['convcorrnormal'"
    ):
        build_model("fc", prior="cauchy")
    with pytest.raises(ValueError, match="valid names"):
        BayesianModel(FullyConnected(4), "laplace")
    with pytest.raises(ValueError, match="valid names"):
        build_model("vgg16")
    with pytest.raises(ValueError, match="num_classes"):
        ResNet20(num_classes=0)


def test_deepcopy_keeps_priors_attached() -> None:
    model = build_model("fc", width=4, prior="horseshoe")
    clone = copy.deepcopy(model)
    with torch.no_grad():
        clone.net.fc1.weight.mul_(3.0)
        clone.net.fc3.bias_prior.raw_scale.fill_(2.0)
    assert clone.log_prior() != model.log_prior()
    fresh = BayesianModel(FullyConnected(4), "horseshoe", init=False)
    fresh.load_state_dict(clone.state_dict())
    torch.testing.assert_close(fresh.log_prior(), clone.log_prior())
