"""The step engine (sgrld.core.engine): one step on every path, device-resident checks and
scalars, capturable steps, per-chain keys and step sizes, and the facade's validation."""

from __future__ import annotations

import copy
import dataclasses
import io
import math
import warnings

import pytest
import torch

import sgrld
from conftest import SAMPLERS, SamplerSpec, quadratic_problem
from metric_cases import CASES
from sgrld.core import NonFiniteGradientError

N = 50
NAMES = ["w", "b", "c"]


def _grads(params: dict[str, torch.Tensor], t: int) -> dict[str, torch.Tensor]:
    out = {}
    for i, (k, v) in enumerate(params.items()):
        g = torch.Generator().manual_seed(1000 * t + i)
        out[k] = 0.5 * v + 0.1 * v**3 + 0.3 * torch.randn(v.shape, generator=g, dtype=v.dtype)
    return out


def _state(sampler: sgrld.Sampler, seed: int = 4) -> sgrld.SamplerState:
    params, _ = quadratic_problem(torch.float64)
    return sampler.init(
        {k: v.clone() for k, v in params.items()}, generator=torch.Generator().manual_seed(seed)
    )


def _copy(state: sgrld.SamplerState) -> dict[str, torch.Tensor]:
    return {**{f"p.{k}": v.clone() for k, v in state.params.items()}, **copy.deepcopy(state.stats)}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------- one engine, every path


@pytest.mark.parametrize("noise", ["torch", "philox"])
def test_run_equals_steps_and_facade(spec: SamplerSpec, noise: str) -> None:
    """Sampler.run, Sampler.step in a loop and the optimizer facade: bit-identical (float64)."""
    sampler = spec.make_sampler(lr=0.05, num_data=N, noise=noise)
    a, b = _state(sampler), _state(sampler)
    sampler.run(a, lambda p: _grads(p, a.step), 9)
    for _ in range(9):
        sampler.step(b, _grads(b.params, b.step))
    assert a.step == b.step == 9 and int(a.device_step) == 9
    assert _same(_copy(a), _copy(b))
    params, _ = quadratic_problem(torch.float64)
    ps = [torch.nn.Parameter(v.clone()) for v in params.values()]
    opt = spec.make_optimizer(
        list(zip(NAMES, ps, strict=True)),
        lr=0.05,
        num_data=N,
        noise=noise,
        generator=torch.Generator().manual_seed(4),
    )
    for t in range(9):
        for p, g in zip(ps, _grads(dict(zip(NAMES, ps, strict=True)), t).values(), strict=True):
            p.grad = g.detach()
        opt.step()
    assert all(torch.equal(p.detach(), a.params[n]) for n, p in zip(NAMES, ps, strict=True))


def test_run_validates_and_calls_back() -> None:
    sampler = sgrld.build("identity", lr=0.05, num_data=N)
    state = _state(sampler)
    seen: list[int] = []
    sampler.run(state, lambda p: _grads(p, 0), 3, callback=lambda s: seen.append(s.step))
    assert seen == [1, 2, 3]
    with pytest.raises(ValueError, match="num_steps"):
        sampler.run(state, lambda p: _grads(p, 0), -1)


# --------------------------------------------------------------------- non-finite gradients


def _poison(grads: dict[str, torch.Tensor], name: str = "b") -> dict[str, torch.Tensor]:
    grads = dict(grads)
    grads[name] = grads[name].clone()
    grads[name].view(-1)[1] = math.nan
    return grads


def test_sync_check_raises_at_once_and_changes_nothing(spec: SamplerSpec) -> None:
    sampler = spec.make_sampler(lr=0.05, num_data=N)
    state = _state(sampler)
    sampler.run(state, lambda p: _grads(p, state.step), 4)
    before, gen = _copy(state), state.generator.get_state()
    with pytest.raises(NonFiniteGradientError, match="'b'"):
        sampler.step(state, _poison(_grads(state.params, 4)))
    assert _same(before, _copy(state)) and state.step == 4
    assert torch.equal(gen, state.generator.get_state())


@pytest.mark.parametrize("noise", ["torch", "philox"])
def test_deferred_check_masks_the_bad_chain_and_names_step_and_tensor(
    spec: SamplerSpec, noise: str
) -> None:
    """A NaN in chain 1 at step 5: chain 1 untouched from then on, chains 0 and 2 go on exactly
    as without it; check() names step 5, the tensor and the chain."""
    k = 3
    params, _ = quadratic_problem(torch.float64)
    stacked = {n: torch.stack([v + 0.1 * i for i in range(k)]) for n, v in params.items()}
    sampler = spec.make_sampler(lr=0.05, num_data=N, noise=noise, sync_checks=False)
    ref_sampler = spec.make_sampler(lr=0.05, num_data=N, noise=noise)
    runs = []
    for s, poison in ((sampler, True), (ref_sampler, False)):
        state = s.init(
            {n: v.clone() for n, v in stacked.items()},
            num_chains=k,
            generator=torch.Generator().manual_seed(3),
            seeds=[7, 8, 9] if noise == "philox" else None,
        )
        frozen = None
        for t in range(8):
            grads = _grads(state.params, t)
            if poison and t == 4:
                grads["c"] = grads["c"].clone()
                grads["c"][1, 0, 1, 0] = math.inf
                frozen = {n: v[1].clone() for n, v in state.params.items()}
                frozen_stats = {n: v[1].clone() for n, v in state.stats.items()}
            s.step(state, grads)
        runs.append((state, frozen, frozen_stats if poison else None))
    (bad, frozen, frozen_stats), (good, _, _) = runs
    for n in NAMES:
        assert torch.equal(bad.params[n][1], frozen[n])  # type: ignore[index]
        if noise == "philox":  # the other chains are exactly the clean run's
            assert torch.equal(bad.params[n][0], good.params[n][0])
            assert torch.equal(bad.params[n][2], good.params[n][2])
    for key, v in bad.stats.items():
        if spec.name != "shampoo":  # shampoo's roots are refreshed on schedule from the factors
            assert torch.equal(v[1], frozen_stats[key]), key  # type: ignore[index]
    with pytest.raises(NonFiniteGradientError, match=r"'c' of chain 1 .* at step 5"):
        sampler.check(bad)
    ref_sampler.check(good)


def test_facade_deferred_check_raises_at_check_and_state_dict(spec: SamplerSpec) -> None:
    params, _ = quadratic_problem(torch.float64)
    ps = [torch.nn.Parameter(v.clone()) for v in params.values()]
    opt = spec.make_optimizer(list(zip(NAMES, ps, strict=True)), lr=0.05, num_data=N)
    opt.sync_checks = False
    for t in range(5):
        for p, g in zip(ps, _grads(dict(zip(NAMES, ps, strict=True)), t).values(), strict=True):
            p.grad = g.detach()
        if t == 3:
            ps[2].grad[0, 0, 0] = math.nan  # type: ignore[index]
            snapshot = [p.detach().clone() for p in ps]
        opt.step()  # no raise: the check is deferred
    assert all(torch.equal(p.detach(), q) for p, q in zip(ps, snapshot, strict=True))
    with pytest.raises(NonFiniteGradientError, match=r"'c'.*step 4"):
        opt.check()
    with pytest.raises(NonFiniteGradientError):
        opt.state_dict()


def test_nan_in_second_group_changes_no_group(spec: SamplerSpec) -> None:
    params, _ = quadratic_problem(torch.float64)
    ps = [torch.nn.Parameter(v.clone()) for v in params.values()]
    opt = spec.make_optimizer(
        [{"params": ps[:2]}, {"params": ps[2:]}],
        lr=0.05,
        num_data=N,
        generator=torch.Generator().manual_seed(0),
    )
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    before = [p.detach().clone() for p in ps]
    gen = opt.generator.get_state()
    stats = copy.deepcopy([s.stats for s in opt.sampler_states])
    ps[2].grad[0, 0, 0] = math.nan  # type: ignore[index]
    with pytest.raises(NonFiniteGradientError):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(ps, before, strict=True))
    assert torch.equal(gen, opt.generator.get_state())
    after = [s.stats for s in opt.sampler_states]
    assert all(_same(a, b) for a, b in zip(stats, after, strict=True))


# --------------------------------------------------------------------- gradients and params


def test_wrong_gradients_are_refused_with_the_parameter_name() -> None:
    sampler = sgrld.build("identity", lr=0.1, num_data=N)
    state = sampler.init({"w": torch.zeros(20, 30)})
    with pytest.raises(ValueError, match=r"'w' has shape \(30, 20\)"):
        sampler.step(state, {"w": torch.zeros(30, 20)})
    with pytest.raises(ValueError, match=r"'w' is torch.int64"):
        sampler.step(state, {"w": torch.zeros(20, 30, dtype=torch.int64)})
    with pytest.raises(TypeError, match="mapping"):
        sampler.step(state, [torch.zeros(20, 30)])  # type: ignore[arg-type]
    w = torch.nn.Parameter(torch.zeros(20, 30))
    opt = sgrld.SGLD([("layer.weight", w)], lr=0.1, num_data=N)
    w.grad = torch.zeros(20, 30)
    w.grad.data = torch.zeros(30, 20)  # torch's setter checks shapes, .data does not
    with pytest.raises(ValueError, match=r"'layer\.weight'"):
        opt.step()
    assert torch.equal(w.detach(), torch.zeros(20, 30))


def test_named_parameters_name_the_errors() -> None:
    model = torch.nn.Linear(3, 2)
    opt = sgrld.SGLD(model.named_parameters(), lr=0.1, num_data=N)
    model(torch.ones(1, 3)).sum().backward()
    model.bias.grad[0] = math.inf  # type: ignore[index]
    with pytest.raises(NonFiniteGradientError, match="'bias'"):
        opt.step()


def test_mixed_dtypes_in_a_group_are_refused() -> None:
    a = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    b = torch.nn.Parameter(torch.zeros(3, dtype=torch.float32))
    with pytest.raises(ValueError, match="share dtype"):
        sgrld.SGLD([a, b], lr=0.1, num_data=N)
    opt = sgrld.SGLD([{"params": [a]}, {"params": [b]}], lr=0.1, num_data=N, temperature=0.0)
    a.grad = torch.full((3,), -(1.0 + 1e-12), dtype=torch.float64)
    b.grad = torch.ones(3)
    opt.step()  # each dtype in its own group: exact
    assert float(a.detach()[0]) == 0.1 * (1.0 + 1e-12)


def test_build_and_init_refuse_a_bad_generator_clearly() -> None:
    with pytest.raises(TypeError, match=r"sampler.init\(params, generator="):
        sgrld.build("identity", lr=0.1, num_data=N, generator=torch.Generator())
    sampler = sgrld.build("identity", lr=0.1, num_data=N)
    with pytest.raises(TypeError, match=r"torch\.Generator"):
        sampler.init({"w": torch.zeros(2)}, generator=3)  # type: ignore[arg-type]


# --------------------------------------------------------------------- device-resident scalars


def test_tensor_lr_and_per_chain_lr(spec: SamplerSpec) -> None:
    """ℓ as a 0-d tensor equals the float; ℓ per chain equals single runs with those ℓ."""
    lrs = [0.02, 0.05, 0.08]
    params, grad_fn = quadratic_problem(torch.float64)
    stacked = {n: torch.stack([v] * 3) for n, v in params.items()}
    many = spec.make_sampler(lr=torch.tensor(lrs, dtype=torch.float64), num_data=N, noise="philox")
    state = many.init(stacked, num_chains=3, seeds=[0, 1, 2])
    singles = []
    for i, lr in enumerate(lrs):
        s = spec.make_sampler(lr=torch.tensor(lr, dtype=torch.float64), num_data=N, noise="philox")
        f = spec.make_sampler(lr=lr, num_data=N, noise="philox")
        a = s.init({n: v.clone() for n, v in params.items()}, seeds=[i])
        b = f.init({n: v.clone() for n, v in params.items()}, seeds=[i])
        for _ in range(6):
            s.step(a, grad_fn(a.params))
            f.step(b, grad_fn(b.params))
        for n in NAMES:
            torch.testing.assert_close(a.params[n], b.params[n], rtol=1e-12, atol=1e-14)
        singles.append(a)
    for _ in range(6):
        many.step(state, grad_fn(state.params))
    for i, single in enumerate(singles):
        for n in NAMES:
            torch.testing.assert_close(state.params[n][i], single.params[n], rtol=1e-10, atol=1e-12)


def test_lr_tensor_shape_is_checked() -> None:
    sampler = sgrld.build("identity", lr=torch.tensor([0.1, 0.2]), num_data=N)
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        sampler.init({"w": torch.zeros(3, 4)}, num_chains=3)
    with pytest.raises(ValueError, match="lr"):
        sgrld.build("identity", lr=torch.tensor(-0.1), num_data=N)
    with pytest.raises(ValueError, match="floating-point"):
        sgrld.build("identity", lr=torch.tensor(1), num_data=N)


def test_chain_s_of_a_k_chain_run_is_the_single_run_with_seed_s(spec: SamplerSpec) -> None:
    params, grad_fn = quadratic_problem(torch.float64)
    sampler = spec.make_sampler(lr=0.05, num_data=N, noise="philox")
    seeds = [11, 5, 2**40 + 3]
    many = sampler.init(
        {n: torch.stack([v] * 3) for n, v in params.items()}, num_chains=3, seeds=seeds
    )
    for _ in range(7):
        sampler.step(many, grad_fn(many.params))
    for i, seed in enumerate(seeds):
        one = sampler.init({n: v.clone() for n, v in params.items()}, seeds=[seed])
        for _ in range(7):
            sampler.step(one, grad_fn(one.params))
        for n in NAMES:
            torch.testing.assert_close(many.params[n][i], one.params[n], rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------- capturable


def test_capturable_needs_counter_based_noise() -> None:
    """capturable=True alone chooses it; asking for torch's generator as well is refused."""
    opt = sgrld.SGLD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, num_data=N, capturable=True)
    assert opt.noise == "philox"
    with pytest.raises(ValueError, match="noise='philox'"):
        sgrld.SGLD(
            [torch.nn.Parameter(torch.zeros(2))], lr=0.1, num_data=N, capturable=True, noise="torch"
        )
    with pytest.raises(ValueError, match="sync_checks"):
        sgrld.build(
            "identity", lr=0.1, num_data=N, noise="philox", capturable=True, sync_checks=True
        )


def test_capturable_eager_steps_refresh_and_traced_ones_leave_it_to_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eagerly a capturable Shampoo step is the plain one; traced, it never refreshes, and the
    host's refresh_if_due after a due step makes the new roots act from the next step on (the
    eager step uses them one step earlier; GraphedStep runs due steps eagerly for that reason)."""
    kw = {"lr": 0.05, "num_data": N, "noise": "philox", "update_interval": 3, "block_size": 4}
    eager = sgrld.build("shampoo", **kw)
    capt = sgrld.build("shampoo", capturable=True, **kw)
    a, b, c = _state(eager), _state(capt), _state(capt)
    b.keys.copy_(a.keys)
    c.keys.copy_(a.keys)
    for t in range(7):
        eager.step(a, _grads(a.params, t))
        capt.step(b, _grads(b.params, t))
    import sgrld.core.sampler as sampler_mod

    monkeypatch.setattr(sampler_mod, "in_graph", lambda: True)  # as under torch.compile
    for t in range(7):
        capt.step(c, _grads(c.params, t))
        assert capt.refresh_if_due(c) == (c.step % 3 == 0)
    lagged = sgrld.build("shampoo", **{**kw, "update_interval": 10**9})
    d = _state(lagged)
    d.keys.copy_(a.keys)
    for t in range(7):
        lagged.step(d, _grads(d.params, t))
        if d.step % 3 == 0:
            lagged.metric.refresh(d.stats, d.layout)
    for n in NAMES:
        assert torch.equal(a.params[n], b.params[n])
        torch.testing.assert_close(d.params[n], c.params[n], rtol=1e-12, atol=1e-14)


def _compiled_graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _compiled_training(make: SamplerSpec, steps: int = 7) -> tuple[int, list[float]]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    opt = make.make_optimizer(
        model.named_parameters(),
        lr=torch.tensor(0.01),
        num_data=N,
        noise="philox",
        capturable=True,
        generator=torch.Generator().manual_seed(0),
    )
    x, y = torch.randn(8, 4), torch.tensor([0, 1] * 4)

    def grads() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()

    grads()
    opt.step()  # the first step creates the state eagerly
    lrs = []
    compiled = torch.compile(opt.step, fullgraph=True)  # no graph break inside a step
    graphs = 0
    for t in range(steps):
        grads()
        compiled()
        for group in opt.param_groups:  # a scheduler on the device: ℓ changes, no recompile
            group["lr"].mul_(0.9)
        lrs.append(float(opt.param_groups[0]["lr"]))
        if t == 2:
            graphs = _compiled_graphs()
        opt.refresh_if_due()
    return _compiled_graphs() - graphs, lrs


def test_capturable_step_compiles_fullgraph_without_recompiling() -> None:
    from sgrld.core._compile import quiet_compile

    with quiet_compile():
        extra, lrs = _compiled_training(SAMPLERS[0])
    assert extra == 0
    assert lrs[-1] < lrs[0]


@pytest.mark.slow
@pytest.mark.parametrize("spec_", SAMPLERS[1:], ids=[s.name for s in SAMPLERS[1:]])
def test_every_capturable_step_compiles_fullgraph_without_recompiling(spec_: SamplerSpec) -> None:
    from sgrld.core._compile import quiet_compile

    with quiet_compile():
        extra, _ = _compiled_training(spec_)
    assert extra == 0


# --------------------------------------------------------------------- facade: groups, state


def test_group_metric_options_are_honoured(spec: SamplerSpec) -> None:
    """A group's own metric options (decay, alpha2, ...) equal a separate optimizer's."""
    if not spec.options:
        pytest.skip("the identity metric has no options")
    key, value = next(iter(spec.options.items()))
    other = value * 0.5
    params, _ = quadratic_problem(torch.float64)
    a = [torch.nn.Parameter(v.clone()) for v in params.values()]
    b = [torch.nn.Parameter(v.clone()) for v in params.values()]
    kw = {"lr": 0.05, "num_data": N, "temperature": 0.0}
    grouped = spec.make_optimizer([{"params": a[:2]}, {"params": a[2:], key: other}], **kw)
    first = spec.make_optimizer(b[:2], **kw)
    second = spec.make_optimizer(b[2:], **{key: other, **kw})
    assert getattr(grouped.group_metrics[1], key) == other
    for t in range(5):
        for ps in (a, b):
            for i, p in enumerate(ps):
                p.grad = 0.5 * p.detach() + 0.1 * p.detach() ** 3 + 0.01 * (t + i)
        grouped.step()
        first.step()
        second.step()
    assert all(torch.equal(x.detach(), y.detach()) for x, y in zip(a, b, strict=True))


def test_bad_group_metric_option_is_refused() -> None:
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="alpha2"):
        sgrld.MongeSGLD([{"params": p, "alpha2": -1.0}], lr=0.1, num_data=N)


def _trained(spec: SamplerSpec) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    params, _ = quadratic_problem(torch.float64)
    ps = [torch.nn.Parameter(v.clone()) for v in params.values()]
    opt = spec.make_optimizer(ps, lr=0.05, num_data=N)
    for t in range(4):
        for i, p in enumerate(ps):
            p.grad = torch.sin(p.detach() + t + i)
        opt.step()
    return opt, ps


def _mutate(sd: dict, fault: str) -> dict:
    def edit(fn: object) -> dict:
        new = copy.deepcopy(sd)
        fn(new)  # type: ignore[operator]
        return new

    def first_stat(new: dict) -> tuple[dict, str]:
        entry = new["state"][0]
        return entry, next(k for k, v in entry.items() if v.is_floating_point())

    def nan(new: dict) -> None:
        entry, k = first_stat(new)
        entry[k] = entry[k].clone()
        entry[k].view(-1)[0] = math.nan

    def dtype(new: dict) -> None:  # floating point is cast as torch does; integers are refused
        entry, k = first_stat(new)
        entry[k] = entry[k].round().long()

    def shapes(new: dict) -> None:
        entry, k = first_stat(new)
        entry[k] = entry[k].reshape(-1)[:-1].clone() if entry[k].numel() > 1 else entry[k][None]

    def params(new: dict) -> None:
        new["param_groups"][0]["params"].pop()

    edits = {
        "step": lambda n: n["state"][0].__setitem__("step", "abc"),
        "negative_step": lambda n: n["state"][1].__setitem__("step", torch.tensor(-1)),
        "generator": lambda n: n["state"][0].__setitem__("generator", torch.zeros(3)),
        "nan": nan,
        "dtype": dtype,
        "shapes": shapes,
        "params": params,
        "missing": lambda n: n["state"][0].pop(first_stat(n)[1]),
        "unknown": lambda n: n["state"][1].__setitem__("foreign", torch.zeros(1)),
        "foreign": lambda n: n.pop("state"),
        "no_state": lambda n: n["state"].pop(2),
    }
    return edit(edits[fault])


FAULTS = ["step", "negative_step", "generator", "nan", "dtype", "shapes", "params", "missing"]
FAULTS += ["unknown", "foreign", "no_state"]


@pytest.mark.parametrize("fault", FAULTS)
def test_load_state_dict_is_atomic(spec: SamplerSpec, fault: str) -> None:
    """A refused dict leaves the optimizer byte-identical (state, groups, generator)."""
    if spec.name == "identity" and fault in ("nan", "dtype", "missing", "shapes"):
        pytest.skip("the identity metric has no statistics")
    source, _ = _trained(spec)
    target, _ = _trained(spec)
    for _ in range(2):
        target.step()
    before = target.state_dict()
    buf = io.BytesIO()
    torch.save(before, buf)
    with pytest.raises(ValueError):
        target.load_state_dict(_mutate(source.state_dict(), fault))
    after = target.state_dict()
    buf2 = io.BytesIO()
    torch.save(after, buf2)
    assert buf.getvalue() == buf2.getvalue()


def test_state_of_other_sizes_is_refused_naming_the_shapes() -> None:
    """Element-wise statistics fit only parameters of their shape. (Wenzel's per-tensor
    scalars fit any shape: its state, like torch's, carries no parameter shapes.)"""
    a = sgrld.RMSpropSGLD([torch.nn.Parameter(torch.zeros(4, 5))], lr=0.1, num_data=N)
    b = sgrld.RMSpropSGLD([torch.nn.Parameter(torch.zeros(3, 5))], lr=0.1, num_data=N)
    for opt in (a, b):
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad = torch.ones_like(p)
        opt.step()
    with pytest.raises(ValueError, match=r"shape \(4, 5\), expected \(3, 5\)"):
        b.load_state_dict(a.state_dict())


# --------------------------------------------------------------------- Wenzel's schedule


def test_wenzel_refreshes_once_per_epoch_from_the_batch_size() -> None:
    params, _ = quadratic_problem(torch.float64)
    a = [torch.nn.Parameter(v.clone()) for v in params.values()]
    b = [torch.nn.Parameter(v.clone()) for v in params.values()]
    kw = {"lr": 0.05, "num_data": N, "decay": 0.9}
    auto = sgrld.WenzelSGLD(a, batch_size=20, generator=torch.Generator().manual_seed(1), **kw)
    manual = sgrld.WenzelSGLD(b, generator=torch.Generator().manual_seed(1), **kw)
    assert auto.refresh_every == 3  # ⌈50 / 20⌉ steps per epoch
    for t in range(9):
        for ps in (a, b):
            for i, p in enumerate(ps):
                p.grad = 0.5 * p.detach() + 0.2 * math.cos(t + i)
        auto.step()
        manual.step()
        if (t + 1) % 3 == 0:
            manual.update_preconditioner()
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    scale = auto.sampler_states[0].stats["scale"]
    assert not torch.equal(scale, torch.ones_like(scale))


def test_wenzel_without_a_schedule_warns_once() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    opt = sgrld.WenzelSGLD([p], lr=0.01, num_data=5)
    p.grad = torch.ones(3)
    with pytest.warns(RuntimeWarning, match="update_preconditioner"):
        for _ in range(6):
            opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(6):
            opt.step()
    with pytest.raises(ValueError, match="refresh_every"):
        sgrld.WenzelSGLD([p], lr=0.01, num_data=5, refresh_every=0)


def test_deferred_checks_handle_parameters_without_gradient(spec: SamplerSpec) -> None:
    """A step where one parameter has no gradient: deferred = sync, and a NaN in a later
    parameter is named by its own name (not its index among those with gradients)."""
    runs = []
    for sync in (True, False):
        sampler = spec.make_sampler(lr=0.05, num_data=N, noise="philox", sync_checks=sync)
        state = _state(sampler)
        state.keys.fill_(3)
        for t in range(6):
            grads: dict[str, torch.Tensor | None] = dict(_grads(state.params, t))
            if t % 2:
                grads["b"] = None
            sampler.step(state, grads)
        runs.append(state)
    assert _same(_copy(runs[0]), _copy(runs[1]))
    sampler = spec.make_sampler(lr=0.05, num_data=N, noise="philox", sync_checks=False)
    state = _state(sampler)
    grads = dict(_poison(_grads(state.params, 0), "c"))
    grads["b"] = None  # type: ignore[assignment]
    before = _copy(state)
    sampler.step(state, grads)
    assert _same(before, _copy(state))
    with pytest.raises(NonFiniteGradientError, match="'c'"):
        sampler.check(state)


def test_deferred_checks_with_rmsprop_bias_correction() -> None:
    """RMSprop's 1 − λᵗ is the same whether the step count is an int (sync checks) or a 0-d
    device tensor (deferred checks, as compiled and captured steps have it)."""
    case = CASES["rmsprop"]
    options = {**case.options, "bias_correction": True}
    spec = SamplerSpec("rmsprop", dataclasses.replace(case, options=options))
    test_deferred_checks_handle_parameters_without_gradient(spec)


# --------------------------------------------------------------------- SGLD's direct path

# sizes that are not multiples of any vector width, so the kernels' vector bodies and scalar
# tails both run on every tensor
_SHAPES = {"w": (37, 29), "b": (29,), "c": (3, 5, 7)}


def _sgld_problem(
    dtype: torch.dtype, num_chains: int | None
) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor | None]]]:
    """Parameters and 8 steps of gradients; "b" has none at steps 2 and 5 (a group with some
    gradients None)."""
    gen = torch.Generator().manual_seed(7)
    lead = () if num_chains is None else (num_chains,)
    params = {k: torch.randn(*lead, *s, generator=gen, dtype=dtype) for k, s in _SHAPES.items()}
    steps: list[dict[str, torch.Tensor | None]] = []
    for t in range(8):
        grads: dict[str, torch.Tensor | None] = {
            k: torch.randn(*lead, *s, generator=gen, dtype=dtype) for k, s in _SHAPES.items()
        }
        if t in (2, 5):
            grads["b"] = None
        steps.append(grads)
    return params, steps


def _engine_step(
    sampler: sgrld.Sampler,
    state: sgrld.SamplerState,
    grads: dict[str, torch.Tensor | None],
    direct: bool,
) -> None:
    from sgrld.core.engine import advance

    advance(
        sampler.metric,
        state,
        [grads.get(n) for n in state.params],
        lr=sampler.lr,
        num_data=sampler.num_data,
        temperature=sampler.temperature,
        direct=direct,
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    ("num_chains", "lr", "temperature"),
    [(None, 0.05, 1.0), (None, 0.05, 0.0), (3, 0.05, 1.0), (3, "per-chain", 1.0)],
)
def test_sgld_direct_path_is_the_flat_path_bit_for_bit(
    dtype: torch.dtype, num_chains: int | None, lr: float | str, temperature: float
) -> None:
    """SGLD moves θ by its gradients directly (no flat copy): the same numbers as the general
    path through the flat buffers, with some gradients None, K chains, a per-chain ℓ, τ = 0."""
    step_size = torch.tensor([0.05, 0.02, 0.01], dtype=dtype) if lr == "per-chain" else lr
    sampler = sgrld.build("identity", lr=step_size, num_data=N, temperature=temperature)
    params, steps = _sgld_problem(dtype, num_chains)
    states = [
        sampler.init(
            {k: v.clone() for k, v in params.items()},
            num_chains=num_chains,
            generator=torch.Generator().manual_seed(3),
        )
        for _ in range(3)
    ]
    for grads in steps:
        _engine_step(sampler, states[0], grads, direct=True)
        _engine_step(sampler, states[1], grads, direct=False)
        sampler.step(states[2], grads)
    assert _same(_copy(states[0]), _copy(states[1])) and _same(_copy(states[0]), _copy(states[2]))
    assert not _same(_copy(states[0]), {f"p.{k}": v for k, v in params.items()})
    gens = [s.generator.get_state() for s in states]
    assert torch.equal(gens[0], gens[1]) and torch.equal(gens[0], gens[2])


def test_sgld_steps_take_the_direct_path_unless_a_gradient_is_not_contiguous(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The public step never copies contiguous gradients into the flat buffer; a strided one
    goes through it (the direct path is bit-identical for contiguous gradients only)."""
    from sgrld.core.state import Workspace

    sampler = sgrld.build("identity", lr=0.05, num_data=N)
    params, steps = _sgld_problem(torch.float32, None)
    a, b = (
        sampler.init({k: v.clone() for k, v in params.items()}, generator=torch.Generator())
        for _ in range(2)
    )
    gather = Workspace.gather
    calls = []
    monkeypatch.setattr(Workspace, "gather", lambda self, ts: calls.append(1) or gather(self, ts))
    sampler.step(a, steps[0])
    assert not calls
    strided = dict(steps[0])
    strided["w"] = torch.empty(29, 37).t().copy_(steps[0]["w"])  # type: ignore[arg-type]
    assert not strided["w"].is_contiguous()  # type: ignore[union-attr]
    sampler.step(b, strided)
    assert calls and _same(_copy(a), _copy(b))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sgld_direct_path_refuses_nan_at_once_and_moves_nothing(dtype: torch.dtype) -> None:
    """An eager CPU step with a NaN (or Inf) gradient raises at once naming the tensor, and no
    parameter, step count or generator state changes, also with a gradient None beside it."""
    sampler = sgrld.build("identity", lr=0.05, num_data=N)
    params, steps = _sgld_problem(dtype, None)
    state = sampler.init(params, generator=torch.Generator().manual_seed(1))
    sampler.step(state, steps[0])
    for bad, value in (("w", math.nan), ("c", math.inf), ("c", -math.inf)):
        grads = dict(steps[2])  # "b" is None
        poisoned = grads[bad].clone()  # type: ignore[union-attr]
        poisoned.view(-1)[5] = value
        grads[bad] = poisoned
        before, gen = _copy(state), state.generator.get_state()
        with pytest.raises(NonFiniteGradientError, match=f"'{bad}'"):
            sampler.step(state, grads)
        assert _same(before, _copy(state)) and state.step == 1 and int(state.device_step) == 1
        assert torch.equal(gen, state.generator.get_state())
    # a sum that overflows although every entry is finite refuses nothing
    huge = {k: torch.full_like(v, torch.finfo(dtype).max) for k, v in state.params.items()}
    sampler.step(state, huge)
    assert state.step == 2


def test_sgld_facade_with_unused_parameters_equals_the_flat_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Facade steps of a group where one parameter never gets a gradient (grad None), float32:
    the direct path and the general path give the same parameters bit for bit."""
    import functools

    import sgrld.core.engine
    from sgrld.core.engine import advance

    runs = []
    for direct in (True, False):  # the one caller of advance reads it from the engine module
        monkeypatch.setattr(sgrld.core.engine, "advance", functools.partial(advance, direct=direct))
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(13, 11), torch.nn.Tanh(), torch.nn.Linear(11, 3)
        )
        unused = torch.nn.Parameter(torch.ones(5))
        opt = sgrld.SGLD(
            [*model.parameters(), unused],
            lr=0.01,
            num_data=N,
            generator=torch.Generator().manual_seed(2),
        )
        gen = torch.Generator().manual_seed(5)
        for _ in range(6):
            opt.zero_grad()
            x = torch.randn(8, 13, generator=gen)
            model(x).square().mean().backward()
            opt.step()
        assert unused.grad is None and torch.equal(unused.detach(), torch.ones(5))
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_the_plan_is_decided_once_per_state_and_again_when_the_caller_changes_it() -> None:
    """A state keeps the plan of its first step (no per-step decisions from flags); a caller
    that changes the configuration (a traced facade step: deferred checks) gets a new one, and
    SGLD moves by its gradients only on the eager path with checks it can take at once."""
    from sgrld.core.engine import Plan, advance

    sampler = sgrld.build("identity", lr=0.05, num_data=N)
    params, steps = _sgld_problem(torch.float32, None)
    state = sampler.init(params, generator=torch.Generator().manual_seed(0))
    sampler.step(state, steps[0])
    plan = state.plan
    assert isinstance(plan, Plan) and plan.by_gradient and plan.fused is None
    sampler.step(state, steps[1])
    assert state.plan is plan
    grads = [steps[3].get(n) for n in state.params]
    advance(sampler.metric, state, grads, lr=0.05, num_data=N, temperature=1.0, checks="deferred")
    assert isinstance(state.plan, Plan) and state.plan is not plan
    assert state.plan.checks == "deferred" and not state.plan.by_gradient


def test_one_function_calls_the_step_engine() -> None:
    """The facade is a shell over the functional step: ``Sampler.move`` is the one caller of
    ``engine.advance`` in the library (an optimizer's groups and ``sampler.step`` both go
    through it), so an option added there reaches every path."""
    import ast
    from pathlib import Path

    callers = []
    root = Path(sgrld.__file__).parent
    for path in sorted(root.rglob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef):
                continue
            calls = [n.func for n in ast.walk(fn) if isinstance(n, ast.Call)]
            names = [
                c.attr if isinstance(c, ast.Attribute) else getattr(c, "id", "") for c in calls
            ]
            if "advance" in names:
                callers.append(f"{path.relative_to(root)}:{fn.name}")
    assert callers == ["core/sampler.py:move"]
