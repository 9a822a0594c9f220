"""One chain runner: K chains of a model over a re-iterable loader, however they are stepped.

A stepper moves its chains by one batch: :class:`VectorizedChains` (an :class:`sgrld.Chains`,
the K chains in one ``vmap``), :class:`StateChains` (the functional sampler's state, ĝ from a
gradient function: :meth:`sgrld.Sampler.run`), :class:`FunctionalChain` (one chain, the
functional sampler on the model's own parameters) or :class:`OptimizerChain` (one chain through
an optimizer: masks, shards, low precision). :func:`run` takes them in turn over the same
batches, as numpyro's ``MCMC(chain_method=...)`` runs one loop whatever the method. Each rule
is written here once:

- the parameters sampled are those with ``requires_grad`` (:func:`sampled`);
- a loader is re-iterable and every pass ends (:func:`passes`), so a run is bounded by its steps;
- a chain whose loss or gradient is not finite stops there, the others go on: its gradient is
  made NaN (:func:`poisoned` before the backward, :func:`poison` after it), the engine's device
  flags freeze it (read by :func:`first_failures`), and :func:`stopped` is the one error naming it;
- every gradient element is clamped where a caller bounds it (:func:`clamp`);
- the gradient evaluations (one minibatch gradient of one chain) are counted where they are
  spent, into an :class:`Account` that refuses to overdraw its budget.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from sgrld.core.engine import NonFiniteGradientError

__all__ = [
    "Account",
    "FunctionalChain",
    "OptimizerChain",
    "Run",
    "StateChains",
    "Stepper",
    "VectorizedChains",
    "bind",
    "clamp",
    "expanded",
    "first_failures",
    "flatten",
    "passes",
    "poison",
    "poisoned",
    "restoring",
    "run",
    "sampled",
    "size",
    "stopped",
]

LossFn = Callable[[nn.Module, Any], Tensor]


# ------------------------------------------------------------------ the rules


def sampled(model: nn.Module) -> dict[str, Tensor]:
    """The parameters a chain samples, by name: those with ``requires_grad`` (a frozen one stays
    where it is on every path); none is refused."""
    named: dict[str, Tensor] = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not named:
        raise ValueError("the model has no parameter to sample: every one has requires_grad=False")
    return named


def passes(loader: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """``loader``'s batches pass after pass, each with whether it ends its pass. An iterator
    (a generator, ``itertools.cycle``) is refused: it is read once, or its pass never ends."""
    if isinstance(loader, Iterator):
        raise ValueError(
            f"the loader is an iterator ({type(loader).__name__}): its batches are read once, or "
            "its pass never ends; pass a DataLoader or a list of batches, which yield their "
            "batches every time they are iterated"
        )
    end = object()
    while True:
        batches = iter(loader)
        batch = next(batches, end)
        if batch is end:
            raise ValueError("the loader yielded no batch (it must yield some on every pass)")
        for following in batches:
            yield batch, False
            batch = following
        yield batch, True


def stopped(
    failures: Mapping[int, int], seeds: list[int] | None = None, *, went_on: bool = True
) -> NonFiniteGradientError:
    """The one error for chains that broke down: ``chain -> first step`` (1-based), each named
    with its seed where the caller knows it; ``went_on=False``: the run stopped with them (a
    compiled block runs every chain to the end of its chunk)."""
    where = ", ".join(
        f"chain {k}{'' if seeds is None else f' (seed {seeds[k]})'} at step {s}"
        for k, s in failures.items()
    )
    after = "the others went on" if went_on else "the run stopped at the end of that chunk"
    return NonFiniteGradientError(
        f"non-finite loss or gradient in {where}; those chains were stopped there, {after}"
    )


@dataclasses.dataclass
class Account:
    """Gradient evaluations spent (one minibatch gradient of one chain; a forward-only batch
    that a caller prices as one counts as one), refused beyond ``budget``."""

    budget: int | None = None
    spent: int = 0

    def spend(self, evaluations: int) -> None:
        if self.budget is not None and self.spent + evaluations > self.budget:
            raise RuntimeError(
                f"budget overdrawn: {self.spent} + {evaluations} gradient evaluations > "
                f"{self.budget}"
            )
        self.spent += evaluations


@contextlib.contextmanager
def restoring(tensors: list[Tensor]) -> Iterator[Callable[[], None]]:
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


# ------------------------------------------------------------------ batches as chains see them


def flatten(batch: Any) -> tuple[list[Tensor], Callable[[tuple[Tensor, ...]], Any]]:
    """The tensors of ``batch`` and a function rebuilding a batch of its structure from them."""
    if isinstance(batch, Tensor):
        return [batch], lambda ts: ts[0]
    if isinstance(batch, Mapping):
        keys = list(batch)
        return [batch[k] for k in keys], lambda ts: dict(zip(keys, ts, strict=True))
    if isinstance(batch, (tuple, list)):
        kind = type(batch) if isinstance(batch, list) else tuple
        return list(batch), lambda ts: kind(ts)
    name = type(batch).__name__
    raise TypeError(f"a batch must be a tensor, a tuple/list or a mapping of tensors, got {name}")


def expanded(
    batch: Any, k: int, device: torch.device | None = None
) -> tuple[tuple[Tensor, ...], Callable[[tuple[Tensor, ...]], Any]]:
    """``batch``'s tensors (on ``device``) expanded to ``(k, ...)`` without a copy: every
    chain sees the same batch (common random numbers); and the rebuild function."""
    tensors, rebuild = flatten(batch)
    tensors = [t if device is None else t.to(device) for t in tensors]
    return tuple(t.expand(k, *t.shape) for t in tensors), rebuild


def size(batch: Any) -> int:
    """The number of data in ``batch`` (the first dimension of its first tensor)."""
    return len(flatten(batch)[0][0])


def bind(
    fn: Callable[[Any, Any], Tensor], rebuild: Callable[[tuple[Tensor, ...]], Any]
) -> Callable[..., Tensor]:
    """``fn(model, batch)`` as a function ``(model, *tensors)`` of the batch's tensors."""

    def call(model: Any, *tensors: Tensor) -> Tensor:
        return fn(model, rebuild(tensors))

    return call


# ------------------------------------------------------------------ the steppers


class Stepper(Protocol):
    """Chains moved together by one batch."""

    num_chains: int

    def step(self, batch: Any) -> Tensor | None:
        """One step of every chain; their losses ``(K,)`` at the parameters it started from
        (``None``: a gradient function gives none)."""
        ...

    def end_pass(self) -> None:
        """The loader's pass ended (a metric refreshed per epoch refreshes)."""
        ...

    def failures(self) -> dict[int, int]:
        """Chains that broke down: ``chain -> first bad step``."""
        ...


def first_failures(flags: Iterable[Tensor]) -> dict[int, tuple[int, int]]:
    """Chains that broke down, from the engine's device flags ``(..., 2)`` (one host read):
    ``chain -> (first bad step, index of the first tensor whose gradient was not finite)``."""
    rows = torch.cat([f.reshape(-1, 2) for f in flags]).tolist()
    return {k: (int(s), int(t)) for k, (s, t) in enumerate(rows) if s != 0}


def poison(grads: Iterable[Tensor | None], bad: Tensor) -> None:
    """NaN into the gradients of the chains ``bad`` ``(K,)`` selects: the engine stops them
    (no host read: a captured step may do it). One chain's 0-d gradient takes ``bad`` ``(1,)``."""
    for g in grads:
        if g is not None:
            mask = bad.reshape(-1, *[1] * (g.dim() - 1)) if g.dim() else bad.reshape(())
            g.masked_fill_(mask, math.nan)


def poisoned(loss: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``loss`` whose value, and so its gradient, is NaN where it is not finite (no host read;
    under ``vmap`` too: ``Chains.step``)."""

    def call(*args: Any) -> Tensor:
        u = loss(*args)
        return u * torch.where(torch.isfinite(u), 1.0, math.nan)  # NaN·∂u is NaN everywhere

    return call


def clamp(grads: Iterable[Tensor | None], bound: float | None) -> None:
    """Every gradient element to ±``bound`` (``None``: left as it is)."""
    if bound is not None:
        for g in grads:
            if g is not None:
                g.clamp_(-bound, bound)


class _ChainsLike(Protocol):  # sgrld.Chains, as the runner uses it
    num_chains: int
    params: dict[str, Tensor]

    def map(self, fn: Callable[..., Tensor], *args: Tensor, shared: bool = False) -> Tensor: ...
    def grads(
        self, fn: Callable[..., Tensor], *args: Tensor, grad_clip: float | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]: ...
    def step(
        self, fn: Callable[..., Tensor], *args: Tensor, grad_clip: float | None = None
    ) -> Tensor: ...
    def apply(self, grads: Mapping[str, Tensor]) -> None: ...
    def refresh(self) -> None: ...
    def failures(self) -> dict[int, int]: ...


class VectorizedChains:
    """K chains of an :class:`sgrld.Chains` in one vmapped step.

    Every chain sees the same batch, or (``per_chain``) batches whose tensors are ``(K, B, ...)``,
    chain k's rows its own minibatch. ``rule(start, now) -> (K,) bool``: chains stopped from the
    losses at their first step and now; without it a non-finite loss stops its chain inside the
    step (:meth:`sgrld.Chains.step`: a frozen chain's buffers are put back, one call group at a
    time). ``grad_clip``: each gradient element to ± it. ``refresh``: refresh the metric at the
    end of each pass.
    """

    def __init__(
        self,
        chains: _ChainsLike,
        loss: LossFn,
        *,
        rule: Callable[[Tensor, Tensor], Tensor] | None = None,
        refresh: bool = False,
        per_chain: bool = False,
        grad_clip: float | None = None,
    ) -> None:
        self.chains, self.loss, self.rule, self.refresh = chains, loss, rule, refresh
        self.per_chain, self.grad_clip = per_chain, grad_clip
        self.num_chains = chains.num_chains
        self.device = next(iter(chains.params.values())).device
        self.start: Tensor | None = None

    def step(self, batch: Any) -> Tensor:
        if self.per_chain:
            listed, rebuild = flatten(batch)
            tensors = tuple(t.to(self.device) for t in listed)
        else:
            tensors, rebuild = expanded(batch, self.num_chains, self.device)
        fn = bind(self.loss, rebuild)
        if self.rule is None:
            return self.chains.step(poisoned(fn), *tensors, grad_clip=self.grad_clip)
        if self.start is None:
            with torch.no_grad():
                self.start = self.chains.map(fn, *tensors)
        losses, grads = self.chains.grads(fn, *tensors, grad_clip=self.grad_clip)
        poison(grads.values(), self.rule(self.start, losses))
        self.chains.apply(grads)
        return losses

    def end_pass(self) -> None:
        if self.refresh:
            self.chains.refresh()

    def failures(self) -> dict[int, int]:
        return self.chains.failures()


class StateChains:
    """The chains of a functional ``state`` of ``sampler`` (checks deferred: a bad step
    freezes its chain), ĝ = ``grad_fn(state.params)`` under autograd (no loss reported);
    ``adapt=False`` freezes the metric."""

    def __init__(
        self,
        sampler: Any,
        state: Any,
        grad_fn: Callable[[dict[str, Tensor]], Mapping[str, Tensor | None]] | None = None,
        *,
        adapt: bool = True,
    ) -> None:
        self.sampler, self.state, self.grad_fn = sampler.deferred(), state, grad_fn
        self.adapt = adapt
        self.num_chains = max(1, math.prod(state.layout.batch_shape))

    def gradients(self, batch: Any) -> tuple[Tensor | None, Mapping[str, Tensor | None]]:
        """The chains' losses on ``batch`` (or ``None``) and ĝ by parameter name."""
        assert self.grad_fn is not None
        with torch.enable_grad():
            return None, self.grad_fn(self.state.params)

    def step(self, batch: Any) -> Tensor | None:
        losses, grads = self.gradients(batch)
        self.sampler.step(self.state, grads, adapt=self.adapt)
        return losses

    def end_pass(self) -> None:
        pass

    def failures(self) -> dict[int, int]:
        return {k: s for k, (s, _) in first_failures([self.state.flags]).items()}


class FunctionalChain(StateChains):
    """One chain of the functional ``sampler`` on the model's own parameters ``named`` (moved
    in place: :func:`run` restores them), keyed by ``seed``; ĝ from ``loss`` on each batch."""

    def __init__(
        self, model: nn.Module, named: dict[str, Tensor], loss: LossFn, sampler: Any, seed: int
    ) -> None:
        state = sampler.init({n: p.detach() for n, p in named.items()}, seeds=[seed])
        super().__init__(sampler, state)
        self.model, self.named, self.loss = model, named, loss

    def gradients(self, batch: Any) -> tuple[Tensor, dict[str, Tensor]]:
        value = self.loss(self.model, batch)
        grads = torch.autograd.grad(value, list(self.named.values()))
        value = value.detach().reshape(1)
        poison(grads, ~torch.isfinite(value))
        return value, dict(zip(self.named, grads, strict=True))


class OptimizerChain:
    """One chain through ``optimizer`` (an :class:`sgrld.SGRLDOptimizer` over the model's own
    parameters, built with ``sync_checks=False``: a bad step stops the chain, its loss
    :func:`poisoned`). A step reads nothing on the host, so a CUDA graph may capture it;
    ``grad_clip``: each gradient element to ± it; ``keep_grads``: the gradients zeroed, not
    freed (a captured step writes the same tensors every replay). ``ranks``: the processes that
    step the chain together (``sum``, ``sum_gradients``; the optimizer checks at once): their
    summed loss is read, a non-finite one refused, and their gradients summed after the backward."""

    num_chains = 1

    def __init__(
        self,
        model: nn.Module,
        loss: LossFn,
        optimizer: Any,
        *,
        grad_clip: float | None = None,
        keep_grads: bool = False,
        ranks: Any = None,
    ) -> None:
        self.model, self.loss, self.optimizer = model, loss, optimizer
        self.grad_clip, self.keep_grads, self.ranks = grad_clip, keep_grads, ranks

    def step(self, batch: Any) -> Tensor:
        self.optimizer.zero_grad(set_to_none=not self.keep_grads)
        if self.ranks is None:
            value = poisoned(self.loss)(self.model, batch)
        else:
            value = self.loss(self.model, batch)
            total = self.ranks.sum(value)  # every rank checks the same total
            if not bool(torch.isfinite(total)):
                raise NonFiniteGradientError(f"potential is {total.item()}")
        value.backward()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if self.ranks is not None:
            self.ranks.sum_gradients(params)
        clamp((p.grad for p in params), self.grad_clip)
        self.optimizer.step()
        return value.detach().reshape(1)

    def end_pass(self) -> None:
        pass

    def failures(self) -> dict[int, int]:
        found = first_failures(s.flags for s in self.optimizer.sampler_states).values()
        return {0: min(s for s, _ in found)} if found else {}


# ------------------------------------------------------------------ the loop


@dataclasses.dataclass
class Run:
    """What :func:`run` returns.

    Attributes:
        trace: ``(K, steps)`` float64: chain k's loss at each step, at the parameters the step
            started from (NaN from a stepper that reports none).
        failures: chains that broke down: ``chain -> first bad step`` (they stopped there).
        spent: the gradient evaluations of this run.
    """

    trace: Tensor
    failures: dict[int, int]
    spent: int


def run(
    steppers: Iterable[Stepper],
    loader: Iterable[Any],
    num_steps: int,
    *,
    account: Account | None = None,
    each: Callable[[Stepper, int], None] | None = None,
    restore: list[Tensor] | None = None,
) -> Run:
    """Every stepper in turn for ``num_steps`` batches of ``loader``, each from its first
    batch; ``each(stepper, step)`` after each step (``step`` from 1: a caller's thinned
    points); ``restore``: tensors put back after each stepper (the model's parameters and
    buffers, which a sequential chain moves). The chain index of the failures runs over all
    the steppers' chains."""
    account = account if account is not None else Account()
    before = account.spent
    rows: list[Tensor] = []
    failures: dict[int, int] = {}
    with restoring(restore or []) as put_back:
        for stepper in steppers:
            trace: Tensor | None = None  # on the losses' device: no host read in a step
            batches = passes(loader)
            for t in range(num_steps):
                batch, last = next(batches)
                account.spend(stepper.num_chains)
                losses = stepper.step(batch)
                if losses is not None:
                    if trace is None:
                        shape, like = (stepper.num_chains, num_steps), losses.device
                        trace = torch.full(shape, math.nan, dtype=torch.float64, device=like)
                    trace[:, t] = losses
                if last:
                    stepper.end_pass()
                if each is not None:
                    each(stepper, t + 1)
            offset = sum(len(r) for r in rows)
            failures |= {offset + k: s for k, s in stepper.failures().items()}
            empty = torch.full((stepper.num_chains, num_steps), math.nan, dtype=torch.float64)
            rows.append(empty if trace is None else trace.cpu())
            put_back()
    return Run(torch.cat(rows), failures, account.spent - before)
