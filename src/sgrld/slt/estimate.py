"""The local learning coefficient (LLC) estimated with any sampler of the registry.

    λ̂(w₀) = nβ · (E_w[L_n(w)] − L_n(w₀)),   p(w) ∝ exp(−nβ·L_n(w) − γ/2·‖w − w₀‖²)

(Lau et al. 2023), E_w by the mean minibatch loss along K chains started at w₀, as devinterp
2.x does; devinterp's step is sgrld's SGRLD step with the options of :func:`devinterp_options`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import numbers
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any, Literal, NoReturn

import numpy as np
import torch
from torch import Tensor, nn

from sgrld.chains import Chains
from sgrld.core.engine import NonFiniteGradientError
from sgrld.core.noise import keys_from_seeds
from sgrld.core.param_state import NOISE_KEY
from sgrld.core.runner import (
    FunctionalChain,
    LossFn,
    OptimizerChain,
    Stepper,
    VectorizedChains,
    passes,
    run,
    sampled,
    stopped,
)
from sgrld.core.sampler import Sampler
from sgrld.core.shards import is_sharded
from sgrld.core.state import SamplerState
from sgrld.core.warmup import DEFAULT_WARMUP, Arrival, warmup_length
from sgrld.metrics import get_metric
from sgrld.optim import SGRLDOptimizer, build
from sgrld.optim.groups import masks_by_parameter
from sgrld.slt.calibration import DoubleBackwardError, Spectrum, lr_from_spectrum, spectrum
from sgrld.slt.result import LLCEstimate
from sgrld.slt.verdict import LLCWarning, judge

#: :func:`llc`'s default ``adapt_until``: no warm-up in the trace; G frozen from the first step at
#: the statistics the step-size calibration built from the gradients at w₀ (``docs/llc.md``)
AT_CALIBRATION: Literal["calibration"] = "calibration"
Warmup = int | None | Literal["calibration"]
#: the initial batches :func:`calibrate_lr` probes (its cost: 30 Hessian-vector products each)
PROBE_BATCHES = 16


def devinterp_options(
    lr: float, *, nbeta: float, localization: float, num_data: float
) -> dict[str, float]:
    """sgrld's ``build`` options for devinterp's step ε, inverse temperature nβ and γ.

    devinterp: Δw = −(ε/2)(nβ∇L_B + γ(w − w₀)) + √ε·G^{-1/2}ξ (G⁻¹ on the drift as well).
    sgrld: Δθ = −ℓG⁻¹(ĝ + c(θ − θ₀)) + √(2ℓτ/n)·G^{-1/2}ξ with ĝ = ∇L_B. Equal drifts and
    noises: ℓ = ε·nβ/2, 2ℓτ/n = ε ⇒ τ = n/nβ, ℓc = εγ/2 ⇒ c = γ/nβ.
    """
    return {
        "lr": lr * nbeta / 2.0,
        "num_data": num_data,
        "temperature": num_data / nbeta,
        "localization": localization / nbeta,
    }


def llc(
    model: nn.Module,
    loss: LossFn,
    loader: Iterable[Any],
    *,
    num_data: int,
    sampler: str = "identity",
    nbeta: float | None = None,
    localization: float = 100.0,
    num_chains: int = 4,
    num_steps: int = 1000,
    seed: int = 0,
    lr: float | None = None,
    burnin: int = 0,
    init_batches: int | None = None,
    adapt_until: Warmup = AT_CALIBRATION,
    vectorize: bool = True,
    masks: Mapping[Any, Tensor] | None = None,
    train: bool | None = None,
    warn: bool = True,
    check_sgld: bool | None = None,
    **metric_options: Any,
) -> LLCEstimate:
    """Estimate the LLC of ``model`` at its current parameters w₀ with a sampler of the registry.

    Args:
        model: the model at w₀; its parameters are as they were when this returns.
        loss: ``loss(model, batch)``: the batch-mean negative log-likelihood per datum.
        loader: an iterable of batches (a tensor, or a tuple, list or dict of tensors), iterated
            again whenever it runs out; every chain sees the same batches. Use whole passes
            (a list, or ``DataLoader(shuffle=True)``): one drawing with replacement makes
            L_n(w₀) a sample, and the verdict says so (``docs/llc.md``).
        num_data: n, the number of training data.
        sampler: a metric name of the registry (``identity`` is devinterp's SGLD, ``rmsprop``
            its RMSprop-SGLD with ``decay=alpha, eps=eps``).
        nbeta: the inverse temperature nβ (default n/log n).
        localization: γ, the pull towards w₀.
        num_chains: K.
        num_steps: steps per chain, each one gradient evaluation.
        seed: chain k's noise is keyed by ``seed + k`` (``noise="philox"``).
        lr: devinterp's ε (so that devinterp settings carry over); ``None`` calibrates it
            (:func:`~sgrld.slt.calibrate_lr`).
        burnin: leading steps of every trace left out of the mean (devinterp: 0).
        init_batches: batches whose mean loss is L_n(w₀); default: one pass over ``loader``
            where it has a length, else 32 (a count that is not whole passes biases λ̂).
        adapt_until: ``"calibration"`` (default): where ``lr`` is calibrated, G frozen from
            the first step at the metric's statistics of the gradients at w₀ that the
            calibration's spectrum is computed with (the G its ε and the verdict's figures are
            about), so no kept step adapts; with ``lr`` given (an ε chosen for another G) or no
            spectrum (masks, FSDP2, bfloat16), ``DEFAULT_WARMUP``. An integer or ``Windows``:
            the warm-up after which G is frozen (``sgrld.build``); ``None``: always adapt, as
            devinterp's RMSprop-SGLD.
        vectorize: ``True``: the K chains in one vectorised :class:`sgrld.Chains`; ``False``:
            one after the other on the model's own parameters (no ``vmap``, less memory).
        masks: ``{parameter or its name: bool tensor of its (global) shape}``: only those
            elements are sampled, the rest stays at w₀ (devinterp's weight-restricted LLC).
            Given, or with parameters sharded by FSDP2 or below float32, the chains run one
            after the other through :class:`sgrld.SGRLDOptimizer` (every rank alike), and
            ``lr`` is needed.
        train: ``None`` (default): every module in the mode it is in (``model.train()`` or
            ``model.eval()``, as the caller left it); ``True``: ``train()`` mode throughout
            (dropout on; devinterp's choice); ``False``: ``eval()`` mode. The modes are
            restored on return.
        warn: warn (:class:`~sgrld.slt.LLCWarning`) when the verdict finds a problem.
        check_sgld: run SGLD (``identity``, at ``lr`` if given, else at its own calibrated ε;
            the same chains, steps and batches) next to the metric and add to the verdict
            where the two disagree beyond 3 standard errors and 5 % (every correct sampler of
            one posterior gives one λ̂). ``None`` (default): for every metric but ``identity``
            (it doubles the cost; ``False`` skips it). Not on the optimizer path (masks, FSDP2,
            bfloat16), nor where SGLD itself breaks down.
        metric_options: the metric's options (e.g. ``alpha2=1.0``, ``decay=0.99``).

    Returns:
        The :class:`LLCEstimate`, with its :class:`~sgrld.slt.LLCVerdict`.

    Raises:
        ValueError: an argument out of range, a loss that is not a finite 0-d tensor at w₀,
            masks that select nothing.
        DoubleBackwardError: ``lr`` is not given and the model has no second derivative
            (e.g. a Hugging Face model with CPU's fused attention): pass ``lr``.

    References:
        Lau, Furman, Wang, Murfet, Wei: "The local learning coefficient: a singularity-aware
        complexity measure", 2023. ``docs/llc.md``.
    """
    if init_batches is None:
        init_batches = len(loader) if isinstance(loader, Sized) else 32
    nbeta = _check_arguments(locals())
    modes = {m: m.training for m in model.modules()}
    if train is not None:
        model.train(train)
    # the metric's chains and SGLD's (check_sgld) on the same loader, steps and seeds
    estimate = functools.partial(
        _estimate, model, loss, loader, num_data=num_data, nbeta=nbeta,
        localization=localization, num_chains=num_chains, num_steps=num_steps, seed=seed, lr=lr,
        burnin=burnin, init_batches=init_batches, adapt_until=adapt_until, vectorize=vectorize,
    )  # fmt: skip
    try:
        est = estimate(sampler=sampler, masks=masks, metric_options=metric_options)
        check = get_metric(sampler).preconditions if check_sgld is None else check_sgld
        if check and masks is None and math.isfinite(est.verdict.inflation if est.verdict else 0):
            # SGLD at the ε given (devinterp compares metrics so), else at its own; where SGLD
            # breaks down there is nothing to compare with
            with contextlib.suppress(NonFiniteGradientError):
                est = against_sgld(est, estimate(sampler="identity", masks=None, metric_options={}))
    finally:
        for module, mode in modes.items():
            module.training = mode
    est = dataclasses.replace(est, training=model.training if train is None else train)
    if warn and not est.ok:
        assert est.verdict is not None
        warnings.warn(f"sgrld.llc: {est.verdict}", LLCWarning, stacklevel=2)
    return est


def against_sgld(est: LLCEstimate, reference: LLCEstimate) -> LLCEstimate:
    """``est`` with a problem added to its verdict where it and SGLD's ``reference`` (the same
    posterior) disagree beyond 3 combined standard errors and 5 % of the reference."""
    if est.verdict is None:
        return est
    gap = est.mean - reference.mean
    se = math.hypot(est.std_error, reference.std_error)
    if not (abs(gap) > 3.0 * se and abs(gap) > 0.05 * abs(reference.mean)):
        return est
    problem = (
        f"disagrees with SGLD on the same posterior ({reference.mean:.4g} ± "
        f"{reference.std_error:.2g} at ε {reference.lr:.3g}): this metric's chains have not "
        f"mixed or its step biases them; more steps, or sampler='identity'"
    )
    verdict = dataclasses.replace(est.verdict, ok=False, problems=(*est.verdict.problems, problem))
    return dataclasses.replace(est, verdict=verdict)


def _check_arguments(args: dict[str, Any]) -> float:
    """Every argument of :func:`llc` in its range (a ValueError naming it); returns nβ."""

    def refuse(name: str, expected: str) -> NoReturn:
        raise ValueError(f"llc: invalid {name}: {args[name]!r} (expected {expected})")

    def integral(value: object) -> bool:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)

    for name, low in (("num_data", 1), ("num_chains", 1), ("num_steps", 1), ("init_batches", 1),
                      ("burnin", 0), ("seed", 0)):  # fmt: skip
        if not integral(args[name]) or args[name] < low:
            refuse(name, f"an integer >= {low}")
    for name, high in (("burnin", args["num_steps"] - 1), ("seed", 2**63 - args["num_chains"])):
        if args[name] > high:
            refuse(name, f"an integer <= {high}")
    warmup = args["adapt_until"]
    if warmup is not None and warmup != AT_CALIBRATION and not (integral(warmup) and warmup >= 0):
        refuse("adapt_until", f"{AT_CALIBRATION!r}, the default, None, to adapt at every step, "
               "or an integer >= 0: the steps of warm-up")  # fmt: skip
    for name, optional in (("vectorize", 0), ("warn", 0), ("check_sgld", 1), ("train", 1)):
        if not isinstance(args[name], bool) and not (optional and args[name] is None):
            refuse(name, "None, True or False" if optional else "True or False")
    for name, bound in (("localization", ">= 0"), ("lr", "> 0"), ("nbeta", "> 0")):
        x = args[name]
        if x is None and name != "localization":  # lr and nbeta have defaults
            continue
        real = isinstance(x, numbers.Real) and not isinstance(x, bool)
        if not real or not math.isfinite(x) or x < 0 or (bound == "> 0" and x == 0):
            refuse(name, f"a finite number {bound}")
    if args["nbeta"] is not None:
        return float(args["nbeta"])
    if args["num_data"] < 2:
        raise ValueError(
            f"llc: num_data {args['num_data']} needs nbeta (the default n/log n needs n >= 2)"
        )
    return args["num_data"] / math.log(args["num_data"])


def _adapting(
    sampler: str,
    adapt_until: int | None,
    burnin: int,
    num_steps: int,
    arrivals: Sequence[Arrival | None] = (),
) -> int:
    """Steps after burn-in during which the metric's G still moved (every metric but
    ``identity`` adapts until ``adapt_until``, as long as the slowest chain's warm-up waited;
    ``None``: throughout); with ``burnin`` 0 and no ``arrivals``, the step from which G is
    nominally frozen."""
    if not get_metric(sampler).preconditions:  # G = I: nothing adapts
        return 0
    lengths = [warmup_length(adapt_until, a) for a in arrivals] or [adapt_until]
    ends = [num_steps if n is None else min(int(n), num_steps) for n in lengths]  # not a Windows
    return max(0, max(ends) - burnin)


def _check_masks(masks: Mapping[Tensor, Tensor], named: dict[str, Tensor]) -> None:
    params = {id(p) for p in named.values()}
    selected = 0
    for p, mask in masks.items():
        if id(p) not in params:
            raise ValueError("llc: a mask's key is not a parameter of the model that needs grad")
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.shape != p.shape:
            raise ValueError(
                f"llc: a mask must be a bool tensor of its parameter's shape {tuple(p.shape)}, "
                f"got {getattr(mask, 'dtype', type(mask).__name__)} "
                f"{tuple(getattr(mask, 'shape', ()))}"
            )
        selected += int(mask.sum())
    if selected == 0:
        raise ValueError("llc: the masks select no element (every mask is all False)")


def _loss_at_start(model: nn.Module, loss: LossFn, batches: list[Any]) -> list[float]:
    """The batch losses at w₀ (L_n(w₀) their mean), refusing a loss that is not a finite 0-d
    tensor."""
    values = []
    with torch.no_grad():
        for i, b in enumerate(batches):
            value = loss(model, b)
            if not isinstance(value, Tensor) or value.ndim != 0:
                shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise ValueError(
                    f"llc: loss must return a 0-d tensor (the batch mean), got {shape}"
                )
            values.append(float(value))
            if not math.isfinite(values[-1]):
                raise ValueError(f"llc: the loss at w₀ is {values[-1]} on batch {i}")
    return values


def _estimate(
    model: nn.Module,
    loss: LossFn,
    loader: Iterable[Any],
    *,
    num_data: int,
    sampler: str,
    nbeta: float,
    localization: float,
    num_chains: int,
    num_steps: int,
    seed: int,
    lr: float | None,
    burnin: int,
    init_batches: int,
    adapt_until: Warmup,
    vectorize: bool,
    masks: Mapping[Any, Tensor] | None,
    metric_options: dict[str, Any],
) -> LLCEstimate:
    # the parameters now: FSDP2's root module holds whole ones after a forward without grad
    named = sampled(model)
    batches = passes(loader)
    first = [next(batches)[0] for _ in range(init_batches)]
    at_start = _loss_at_start(model, loss, first)
    init_loss = float(np.mean(at_start))
    # a DataLoader whose sampler draws with replacement makes no pass over the data: L_n(w₀)
    # and the trace's mean are sample means of batches that every chain shares, one batch's
    # spread (in λ̂'s units) gives their error
    drawn = getattr(getattr(loader, "sampler", None), "replacement", False) is True
    batch_spread = nbeta * float(np.std(at_start, ddof=1)) if drawn and len(at_start) > 1 else 0.0
    if masks is not None:  # keyed by parameter or by name (devinterp's convention)
        masks = masks_by_parameter(masks, named.items())
        _check_masks(masks, named)
    calibrated = lr is None
    through_optimizer = masks is not None or any(
        is_sharded(p) or torch.finfo(p.dtype).bits < 32 for p in named.values()
    )
    if lr is None and through_optimizer:
        raise ValueError(
            "llc: masks, sharded (FSDP2) or low-precision parameters need lr (devinterp's ε): "
            "the calibration runs on whole float32/float64 parameters"
        )

    def options(eps: float) -> dict[str, Any]:
        """The chains' options at devinterp's ε (either path: ``build`` or the optimizer)."""
        setting = devinterp_options(eps, nbeta=nbeta, localization=localization, num_data=num_data)
        return setting | {"adapt_until": warmup}

    def make(eps: float) -> Sampler:  # a metric option named as one of these: a TypeError
        return build(sampler, **options(eps), noise="philox", **metric_options)

    spec: Spectrum | None = None
    at_calibration = adapt_until == AT_CALIBRATION
    warmup: int | None = DEFAULT_WARMUP if at_calibration else adapt_until  # type: ignore[assignment]
    if not through_optimizer:  # the quadratic model: ε's rule, or the verdict on a given ε
        try:
            spec = spectrum(model, loss, first[:PROBE_BATCHES], make(1.0), nbeta=nbeta,
                            localization=localization, seed=seed)  # fmt: skip
        except DoubleBackwardError:
            if lr is None:
                raise
    frozen_at = None  # a given ε was chosen for some other G (devinterp's): that one warms up
    if lr is None:
        assert spec is not None
        lr = lr_from_spectrum(spec, num_steps - burnin)
        if at_calibration:  # no warm-up: G as the spectrum has it (seeded below)
            frozen_at, warmup = spec.stats, 0
    built = make(lr)  # refuses bad options on either path
    seeds = [seed + k for k in range(num_chains)]
    arrivals: list[Arrival | None] = []  # the warm-up each chain waited for (core.warmup)

    def noted(stepper: Stepper, states: list[SamplerState]) -> Stepper:
        """``stepper``, its chains' warm-ups noted, and with ``frozen_at`` their statistics
        (``(*batch, ...)``) set to the calibration's G (unbatched)."""
        arrivals.extend(s.warmup for s in states)
        if frozen_at is not None:
            for key, value in (kv for s in states for kv in s.stats.items()):
                source = frozen_at[key]
                if value.shape[value.dim() - source.dim() :] != source.shape:
                    raise RuntimeError(
                        f"llc: the calibration's statistic {key!r} does not fit the chains"
                    )
                value.copy_(source.expand_as(value))
        return stepper

    def steppers() -> Iterator[Stepper]:  # sequential chains built as they run: less memory
        if vectorize and not through_optimizer:
            chains = Chains(model, built, seeds, sample=named.__contains__)
            yield noted(VectorizedChains(chains, loss), [g.state for g in chains.groups])
            return
        # masked: only the masked parameters go to the optimizer (devinterp's weight restriction)
        params = [(n, p) for n, p in named.items() if masks is None or any(p is q for q in masks)]
        for chain_seed in seeds:
            if not through_optimizer:
                one = FunctionalChain(model, named, loss, built, chain_seed)
                yield noted(one, [one.state])
                continue
            opt = SGRLDOptimizer(params, metric=sampler, noise="philox", masks=masks,
                                 sync_checks=False, **(options(lr) | metric_options))  # fmt: skip
            key = opt.state[params[0][1]][NOISE_KEY]  # keyed as the functional chain's
            key.copy_(keys_from_seeds([chain_seed], key.device).view_as(key))
            yield noted(OptimizerChain(model, loss, opt), opt.sampler_states)

    try:
        done = run(steppers(), loader, num_steps, restore=[*named.values(), *model.buffers()])
    finally:
        for p in named.values():
            p.grad = None
    if done.failures:
        raise stopped(done.failures, seeds)
    trace = done.trace.numpy()
    per_chain = nbeta * (trace[:, burnin:].mean(axis=1) - init_loss)
    std = float(per_chain.std(ddof=1)) if num_chains > 1 else math.nan
    verdict, std_error = judge(
        trace, init_loss=init_loss, nbeta=nbeta, burnin=burnin, window=init_batches,
        pass_length=len(loader) if isinstance(loader, Sized) else None,
        inflation=spec.inflation(lr) if spec else math.nan,
        step_bias=spec.step_bias(lr) if spec else math.nan,
        adapting=_adapting(sampler, warmup, burnin, num_steps, arrivals),
        relaxations=spec.relaxations(lr, num_steps) if spec else math.nan,
        batch_spread=batch_spread,
        frozen_from=_adapting(sampler, warmup, 0, num_steps),  # the warm-up's nominal end
    )  # fmt: skip
    return LLCEstimate(
        mean=float(per_chain.mean()),
        std_error=std_error,
        std=std,
        per_chain=per_chain,
        trace=trace,
        init_loss=init_loss,
        lr=float(lr),
        calibrated=calibrated,
        nbeta=nbeta,
        localization=float(localization),
        verdict=verdict,
        sampler=sampler,
        burnin=burnin,
    )
