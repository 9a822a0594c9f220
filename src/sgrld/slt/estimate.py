"""The local learning coefficient (LLC) estimated with any sampler of the registry.

    λ̂(w₀) = nβ · (E_w[L_n(w)] − L_n(w₀)),   p(w) ∝ exp(−nβ·L_n(w) − γ/2·‖w − w₀‖²)

(Lau et al. 2023), E_w by the mean minibatch loss along K chains started at w₀, as devinterp
2.x does; devinterp's step is sgrld's SGRLD step with the options of :func:`devinterp_options`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from sgrld import build
from sgrld.chains import Chains
from sgrld.core.noise import keys_from_seeds
from sgrld.core.param_state import NOISE_KEY
from sgrld.core.sampler import Sampler
from sgrld.core.shards import is_sharded
from sgrld.optim.groups import masks_by_parameter
from sgrld.slt.calibration import calibrate_lr
from sgrld.tuning.data import bind, expanded

LossFn = Callable[[nn.Module, Any], Tensor]
#: the initial batches :func:`calibrate_lr` probes (its cost: 30 Hessian-vector products each)
PROBE_BATCHES = 16


@dataclass(frozen=True)
class LLCEstimate:
    """An LLC estimate and what it was computed from.

    Attributes:
        mean: λ̂, the mean of the per-chain estimates.
        std_error: their standard error, std/√K (NaN for one chain).
        std: their standard deviation over the chains (devinterp's ``llc_std``).
        per_chain: ``(K,)`` nβ·(mean of chain k's trace − init_loss).
        trace: ``(K, num_steps)`` the batch loss of every chain at every step, at the
            parameters the step started from (devinterp's ``loss_trace``).
        init_loss: L_n(w₀), the mean loss over the initial batches.
        lr: devinterp's ε used (given, or from :func:`~sgrld.slt.calibrate_lr`).
        calibrated: whether ``lr`` was calibrated.
        nbeta: nβ.
        localization: γ.
    """

    mean: float
    std_error: float
    std: float
    per_chain: np.ndarray
    trace: np.ndarray
    init_loss: float
    lr: float
    calibrated: bool
    nbeta: float
    localization: float


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
    adapt_until: int | None = 1000,
    vectorize: bool = True,
    masks: Mapping[Any, Tensor] | None = None,
    **metric_options: Any,
) -> LLCEstimate:
    """Estimate the LLC of ``model`` at its current parameters w₀ with a sampler of the registry.

    Args:
        model: the model at w₀; its parameters are as they were when this returns.
        loss: ``loss(model, batch)``: the batch-mean negative log-likelihood per datum.
        loader: an iterable of batches (a tensor, or a tuple, list or dict of tensors), iterated
            again whenever it runs out; every chain sees the same batches.
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
        adapt_until: steps during which the metric adapts (``sgrld.build``; ``None``: always,
            as devinterp's RMSprop-SGLD).
        vectorize: ``True``: the K chains in one vectorised :class:`sgrld.Chains`; ``False``:
            one after the other on the model's own parameters (no ``vmap``, less memory).
        masks: ``{parameter or its name: bool tensor of its (global) shape}``: only those
            elements are sampled, the rest stays at w₀ (devinterp's weight-restricted LLC).
            Given, or with parameters sharded by FSDP2 or below float32, the chains run one
            after the other through :class:`sgrld.SGRLDOptimizer` (every rank alike), and
            ``lr`` is needed.
        metric_options: the metric's options (e.g. ``alpha2=1.0``, ``decay=0.99``).

    Returns:
        The :class:`LLCEstimate`.

    References:
        Lau, Furman, Wang, Murfet, Wei: "The local learning coefficient: a singularity-aware
        complexity measure", 2023. ``docs/llc.md``.
    """
    if num_chains < 1 or num_steps < 1 or not 0 <= burnin < num_steps:
        raise ValueError(
            f"need num_chains >= 1, num_steps >= 1 and 0 <= burnin < num_steps, got "
            f"{num_chains}, {num_steps}, {burnin}"
        )
    if init_batches is None:
        init_batches = len(loader) if isinstance(loader, Sized) else 32
    if init_batches < 1:
        raise ValueError(f"init_batches: {init_batches} (expected >= 1)")
    nbeta = num_data / math.log(num_data) if nbeta is None else float(nbeta)
    if not nbeta > 0.0 or localization < 0.0:
        raise ValueError(f"need nbeta > 0 and localization >= 0, got {nbeta}, {localization}")
    # the parameters now: FSDP2's root module holds whole ones after a forward without grad
    named: dict[str, Tensor] = {n: p for n, p in model.named_parameters() if p.requires_grad}
    # keyed by parameter or by name (devinterp's convention)
    by_parameter = None if masks is None else masks_by_parameter(masks, named.items())
    batches = _cycle(loader)
    first = [next(batches) for _ in range(init_batches)]
    with torch.no_grad():
        init_loss = float(np.mean([float(loss(model, b)) for b in first]))
    calibrated = lr is None
    through_optimizer = masks is not None or any(
        is_sharded(p) or torch.finfo(p.dtype).bits < 32 for p in named.values()
    )
    if lr is None and through_optimizer:
        raise ValueError(
            "llc: masks, sharded (FSDP2) or low-precision parameters need lr (devinterp's ε): "
            "the calibration runs on whole float32/float64 parameters"
        )

    def make(eps: float) -> Sampler:
        options: dict[str, Any] = devinterp_options(
            eps, nbeta=nbeta, localization=localization, num_data=num_data
        )
        return build(sampler, **options, noise="philox", adapt_until=adapt_until, **metric_options)

    if lr is None:
        lr = calibrate_lr(
            model,
            loss,
            first[:PROBE_BATCHES],
            make(1.0),
            nbeta=nbeta,
            localization=localization,
            num_steps=num_steps - burnin,
            seed=seed,
        )
    built = make(lr)  # refuses bad options on either path
    seeds = [seed + k for k in range(num_chains)]
    if through_optimizer:
        settings: dict[str, Any] = {
            **devinterp_options(lr, nbeta=nbeta, localization=localization, num_data=num_data),
            **metric_options,
            "adapt_until": adapt_until,
        }
        trace = _optimized(
            model, named, loss, loader, sampler, settings, by_parameter, seeds, num_steps
        )
    else:
        run = _vectorized if vectorize else _sequential
        trace = run(model, loss, loader, built, seeds, num_steps)
    per_chain = nbeta * (trace[:, burnin:].mean(axis=1) - init_loss)
    std = float(per_chain.std(ddof=1)) if num_chains > 1 else math.nan
    return LLCEstimate(
        mean=float(per_chain.mean()),
        std_error=std / math.sqrt(num_chains),
        std=std,
        per_chain=per_chain,
        trace=trace,
        init_loss=init_loss,
        lr=float(lr),
        calibrated=calibrated,
        nbeta=nbeta,
        localization=float(localization),
    )


def _optimized(
    model: nn.Module,
    named: dict[str, Tensor],
    loss: LossFn,
    loader: Iterable[Any],
    metric: str,
    settings: dict[str, Any],
    masks: Mapping[Tensor, Tensor] | None,
    seeds: list[int],
    num_steps: int,
) -> np.ndarray:
    """The chains one after the other through :class:`sgrld.SGRLDOptimizer` on the model's
    own parameters (sharded, bfloat16, masked), restored afterwards; chain k keyed by
    ``seeds[k]`` as in :func:`_sequential`."""
    from sgrld.optim import SGRLDOptimizer

    params = list(named.values())
    if masks is not None:  # devinterp's weight restriction: the others stay at w₀
        named = {n: p for n, p in named.items() if any(p is q for q in masks)}
    trace = torch.empty(len(seeds), num_steps, dtype=torch.float64)
    try:
        with _restoring([*params, *model.buffers()]) as restore:
            for k, s in enumerate(seeds):
                opt = SGRLDOptimizer(list(named.items()), metric=metric, noise="philox",
                                     masks=masks, **settings)  # fmt: skip
                key = opt.state[next(iter(named.values()))][NOISE_KEY]
                key.copy_(keys_from_seeds([s], key.device).view_as(key))
                batches = _cycle(loader)
                for t in range(num_steps):
                    opt.zero_grad(set_to_none=True)
                    value = loss(model, next(batches))
                    value.backward()
                    trace[k, t] = float(value.detach())
                    opt.step()
                opt.check()
                restore()
    finally:
        for p in params:
            p.grad = None
    return trace.numpy()


@contextlib.contextmanager
def _restoring(tensors: list[Tensor]) -> Iterator[Callable[[], None]]:
    """A function putting ``tensors`` back at their values now, called on exit too."""
    saved = [t.detach().clone() for t in tensors]

    def restore() -> None:
        with torch.no_grad():
            for t, s in zip(tensors, saved, strict=True):
                t.copy_(s)

    try:
        yield restore
    finally:
        restore()


def _cycle(loader: Iterable[Any]) -> Iterator[Any]:
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ValueError("the loader yields no batch")


def _vectorized(
    model: nn.Module,
    loss: LossFn,
    loader: Iterable[Any],
    sampler: Sampler,
    seeds: list[int],
    num_steps: int,
) -> np.ndarray:
    """K chains in one process (:class:`sgrld.Chains` on copies of ``model``)."""
    chains = Chains(model, sampler, seeds)
    k = len(seeds)
    trace = torch.empty(k, num_steps, dtype=torch.float64)
    batches = _cycle(loader)
    for t in range(num_steps):
        # every chain the same batch: a stride-0 chain dim, no copy
        tensors, rebuild = expanded(next(batches), k)
        trace[:, t] = chains.step(bind(loss, rebuild), *tensors).double()
    chains.check()
    return trace.numpy()


def _sequential(
    model: nn.Module,
    loss: LossFn,
    loader: Iterable[Any],
    sampler: Sampler,
    seeds: list[int],
    num_steps: int,
) -> np.ndarray:
    """The chains one after the other on the model's own parameters, restored afterwards (its
    buffers too: a BatchNorm's running statistics move in train mode)."""
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    params: list[Tensor] = list(named.values())
    trace = torch.empty(len(seeds), num_steps, dtype=torch.float64)
    with _restoring(params + list(model.buffers())) as restore:
        for k, s in enumerate(seeds):
            state = sampler.init({n: p.detach() for n, p in named.items()}, seeds=[s])
            batches = _cycle(loader)
            for t in range(num_steps):
                value = loss(model, next(batches))
                grads = torch.autograd.grad(value, params)
                trace[k, t] = float(value.detach())
                sampler.step(state, dict(zip(named, grads, strict=True)))
            sampler.check(state)
            restore()
    return trace.numpy()
