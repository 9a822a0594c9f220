"""K chains of any ``nn.Module`` in one process, each the single run of its own seed.

Parameters and buffers are stacked over a leading chain dim, the forward passes run
under ``torch.vmap`` and one sampler call on ``(K, ...)`` state moves every chain; chain k is
``model(s_k)`` with its own Philox key, minibatches and BatchNorm statistics (``docs/chains.md``).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils._pytree import tree_map

from sgrld.chain_health import Health, judge
from sgrld.core.contract import check_int
from sgrld.core.engine import NonFiniteGradientError, telemetry_figures
from sgrld.core.runner import clamp, first_failures, stopped
from sgrld.core.sampler import Sampler
from sgrld.core.state import SamplerState
from sgrld.core.warmup import drawn_while_adapting

__all__ = ["Chains", "chain_batches"]

ModelFactory = Callable[[int], nn.Module]
LossFn = Callable[..., Tensor]


@dataclasses.dataclass
class _Group:
    """A run of chains ``[start, stop)`` that share one metric: one sampler call per step."""

    start: int
    stop: int
    sampler: Sampler
    state: SamplerState
    unchecked: Sampler  # the same sampler without checks: CPU steps whose host check passed
    broken: bool = False  # host-check mode: a chain of the group broke down (checked from then)
    telemetry: Tensor | None = None  # (chains, 4) float64 sums of per-step figures


class _Bound(nn.Module):
    """``fn(model, *args)`` as a module, so that ``functional_call`` substitutes the model's
    tensors in any function of the model (e.g. a potential with a log-prior)."""

    def __init__(self, model: nn.Module, fn: Callable[..., Tensor]) -> None:
        super().__init__()
        self.model = model
        self._fn = [fn]  # in a list: never registered as a submodule, even if it is a module

    def forward(self, *args: Any) -> Tensor:
        return self._fn[0](self.model, *args)


#: torch's note that ``vmap`` runs an operator chain by chain (printed at every call otherwise)
_NO_BATCHING_RULE = re.compile(r"not yet implemented the batching rule for (\S+?)\.")

#: what to do when ``vmap`` meets a branch on a tensor's value
_CONTROL_FLOW_HINT = (
    "Chains: torch.vmap cannot run the model's forward for all chains at once: the forward "
    "branches on a tensor's value (transformers' attention-mask code does so with "
    "attn_implementation='sdpa' and a padded batch's attention_mask). Ways out: a Hugging Face "
    "model with eager attention (from_config(config, attn_implementation='eager') or "
    "model.set_attn_implementation('eager'); the same chains), or no vmap: sgrld.llc(..., "
    "vectorize=False) runs the chains one after the other (docs/huggingface.md)"
)


def _stackable(out: Any) -> Any:
    """``out`` as ``vmap`` can stack it: a mapping (a Hugging Face ``ModelOutput``) without the
    entries that are not tensors (a key-value cache); anything else unchanged."""
    if not isinstance(out, Mapping):
        return out

    def tensors(v: Any) -> bool:
        return isinstance(v, Tensor) or (
            isinstance(v, (tuple, list)) and all(isinstance(t, Tensor) for t in v)
        )

    kept = {k: v for k, v in out.items() if tensors(v)}
    return out if len(kept) == len(out) else type(out)(**kept)


def _check_seeds(seeds: Sequence[int], bits: int = 63) -> list[int]:
    out = list(seeds)
    if not out:
        raise ValueError("seeds is empty: give one seed per chain")
    for s in out:
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 2**bits:
            raise ValueError(f"invalid seed: {s!r} (expected an int in [0, 2**{bits}))")
    return out


def _per_chain(name: str, values: Sequence[float] | Tensor, k: int) -> list[float]:
    out = [float(v) for v in (values.tolist() if isinstance(values, Tensor) else values)]
    if len(out) != k:
        raise ValueError(f"{name}: {len(out)} values for {k} chains (give one per chain)")
    return out


class Chains:
    """K chains of a model sampled together; chain k is the single run with seed ``seeds[k]``.

    Args:
        model: a factory ``seed -> nn.Module`` building chain k's model from its seed, or a
            module whose copies start every chain at the same point (same structure for all).
        sampler: the sampler (:func:`sgrld.build`) with ``noise="philox"``; its ``lr`` a float,
            a 0-d or a ``(K,)`` tensor. ``sync_checks=True``: a non-finite gradient raises and
            moves no chain; ``check_finite=False``: no check; default: see *Checks*.
        seeds: one seed per chain (int in [0, 2⁶³)): the chain's Philox key and the argument of
            ``model``.
        lr: ℓ per chain, overriding ``sampler.lr`` (``docs/conventions.md``).
        noise_seeds: the chains' Philox seeds (ints in [0, 2⁶⁴)) where they differ from
            ``seeds``.
        chain_batch: at most this many chains per vmapped forward/backward and sampler call
            (default: all); on CPU a few at a time keep the working set in cache.
        device: where the stacked tensors live (default: where ``model`` builds them).
        sample: ``name -> bool``: sample only the parameters it selects (e.g. ``lambda n:
            "lora" in n``); the others are frozen, held once (chain 0's) and must be built alike.
        telemetry: sum each chain's per-step figures on the device (:meth:`telemetry`).
        **options: per chain values of the metric's tuned options (:attr:`Metric.tuned`, e.g.
            ``alpha2=[1.0, 2.0]``); each run of equal consecutive values is one sampler call.

    **Checks.** By default a chain whose gradient holds NaN/Inf is frozen from that step on
    (parameters and buffers) and reported by :meth:`failures`, the others go on: on CUDA by
    the engine's deferred check; on CPU one sum per chain is read each step and the step runs
    unchecked (cheaper) while every chain is finite.

    Attributes:
        params: ``name -> (K, ...)`` stacked parameters (updated in place by :meth:`step`).
        buffers: ``name -> (K, ...)`` stacked buffers (BatchNorm running statistics, ...).
        seeds: the chains' seeds.

    References:
        The engine (per-chain keys, ℓ and deferred checks): :mod:`sgrld.core.engine`; an
        example: ``docs/chains.md``.
    """

    def __init__(
        self,
        model: nn.Module | ModelFactory,
        sampler: Sampler,
        seeds: Sequence[int],
        *,
        lr: Sequence[float] | Tensor | None = None,
        noise_seeds: Sequence[int] | None = None,
        chain_batch: int | None = None,
        device: torch.device | str | None = None,
        sample: Callable[[str], bool] | None = None,
        telemetry: bool = False,
        **options: Sequence[float],
    ) -> None:
        if not isinstance(sampler, Sampler):
            raise TypeError(f"sampler must be a sgrld.Sampler, got {type(sampler).__name__}")
        if sampler.noise != "philox":
            raise ValueError(
                "Chains needs noise='philox' (sgrld.build(..., noise='philox')): with torch's "
                "generator all chains share one stream and chain k's noise depends on K"
            )
        self.seeds = _check_seeds(seeds)
        k = self.num_chains = len(self.seeds)
        # chain 0's module is the template of the forward: its own tensors are not used
        self.model, self.params, self.buffers, self.frozen = _stack(
            model, self.seeds, sample, device
        )
        if not self.params:
            raise ValueError("the model has no parameters" + (" selected by sample" * bool(sample)))
        self._host_checks = False  # see *Checks* in the class docstring
        self._unbatched: set[str] = set()  # operators vmap ran chain by chain (warned once)
        keys = self.seeds if noise_seeds is None else _check_seeds(noise_seeds, bits=64)
        if len(keys) != k:
            raise ValueError(f"noise_seeds: {len(keys)} for {k} chains (give one per chain)")
        if chain_batch is not None:
            check_int("chain_batch", chain_batch, 1)
        self.chain_batch = chain_batch or k
        self.groups = self._make_groups(sampler, lr, options, keys, telemetry)

    def _make_groups(
        self,
        sampler: Sampler,
        lr: Sequence[float] | Tensor | None,
        options: dict[str, Sequence[float]],
        keys: list[int],
        telemetry: bool,
    ) -> list[_Group]:
        k = self.num_chains
        like = next(iter(self.params.values()))
        if lr is None and isinstance(sampler.lr, Tensor) and sampler.lr.dim() == 1:
            lr = sampler.lr
        lrs = None
        if lr is not None:
            lrs = torch.tensor(_per_chain("lr", lr, k), dtype=like.dtype, device=like.device)
        per_chain: list[dict[str, float]] = [{} for _ in range(k)]
        for name, values in options.items():
            if name not in sampler.metric.tuned:
                cls = type(sampler.metric).__name__
                raise ValueError(f"{name} per chain needs a metric that tunes {name}, not {cls}")
            for chain, value in zip(per_chain, _per_chain(name, values, k), strict=True):
                chain[name] = value
        if sampler.check_finite and sampler.sync_checks is None:
            sampler = dataclasses.replace(sampler, sync_checks=False)  # a bad chain stops alone
            self._host_checks = like.device.type == "cpu"
        groups, start = [], 0
        for stop in range(1, k + 1):
            if stop < k and per_chain[stop] == per_chain[start] and stop - start < self.chain_batch:
                continue
            metric = sampler.metric
            if per_chain[start]:
                metric = dataclasses.replace(metric, **per_chain[start])  # type: ignore[type-var]
            lr_g = sampler.lr if lrs is None else lrs[start:stop].clone()
            s = dataclasses.replace(sampler, metric=metric, lr=lr_g)
            view = {n: p[start:stop] for n, p in self.params.items()}  # contiguous views
            state = s.init(view, num_chains=stop - start, seeds=keys[start:stop])
            unchecked = dataclasses.replace(s, check_finite=False, sync_checks=None)
            sums = torch.zeros(stop - start, 4, dtype=torch.float64, device=state.keys.device)
            groups.append(
                _Group(start, stop, s, state, unchecked, telemetry=sums if telemetry else None)
            )
            start = stop
        return groups

    def train(self, mode: bool = True) -> Chains:
        """Train mode (BatchNorm: batch statistics, running statistics updated per chain)."""
        self.model.train(mode)
        return self

    def eval(self) -> Chains:
        """Eval mode (BatchNorm: each chain's running statistics)."""
        return self.train(False)

    def map(self, fn: Callable[..., Any], *args: Tensor, shared: bool = False) -> Any:
        """``fn(model_k, *args_k)`` for every chain k, stacked on a leading K dim; ``args`` are
        ``(K, ...)``, or shared by every chain (``shared=True``, e.g. a test set). ``fn`` returns
        a tensor, or a mapping of them (a Hugging Face ``ModelOutput``, whose entries that are
        not tensors, a cache, are left out)."""
        outs = []
        for g in self.groups:  # one vmapped call per group (chain_batch bounds the working set)
            part = slice(g.start, g.stop)
            params = {n: p[part] for n, p in self.params.items()}
            inputs = args if shared else tuple(a[part] for a in args)
            outs.append(self._vmap(fn, params, part, inputs, shared))
        if len(outs) == 1:
            return outs[0]
        if isinstance(outs[0], Mapping):  # a ModelOutput: its tensors chain-concatenated
            return tree_map(lambda *parts: torch.cat(parts), *outs)
        return torch.cat(outs)

    def _vmap(
        self,
        fn: Callable[..., Tensor],
        params: Mapping[str, Tensor],
        part: slice,
        args: tuple[Tensor, ...],
        shared: bool,
    ) -> Tensor:
        bound = _Bound(self.model, fn)
        tensors = {f"model.{n}": p for n, p in params.items()}
        # views: BatchNorm's in-place running-statistics updates land in the stacked buffers
        buffers = {f"model.{n}": b[part] for n, b in self.buffers.items()}
        frozen = {f"model.{n}": t for n, t in self.frozen.items()}  # one copy, every chain's

        def one(
            p: dict[str, Tensor], f: dict[str, Tensor], b: dict[str, Tensor], *a: Tensor
        ) -> Tensor:
            return _stackable(functional_call(bound, (p, f, b), a, strict=True))

        in_dims = (0, None, 0, *([None if shared else 0] * len(args)))
        with warnings.catch_warnings(record=True) as caught:
            # torch's note that an operator runs chain by chain comes at every call: once
            warnings.filterwarnings("always", message=".*batching rule", category=UserWarning)
            try:
                # "different": a random layer (dropout) draws independently per chain (from
                # torch's global generator, so such a model is not keyed by the chains' seeds)
                out = torch.vmap(one, in_dims=in_dims, randomness="different")(
                    tensors, frozen, buffers, *args
                )
            except RuntimeError as exc:
                if "data-dependent control flow" not in str(exc):
                    raise
                raise RuntimeError(_CONTROL_FLOW_HINT) from exc
        self._pass_on(caught)
        return out

    def _pass_on(self, caught: list[warnings.WarningMessage]) -> None:
        """Show the warnings of a vmapped call; torch's "no batching rule" once per operator."""
        for w in caught:
            found = _NO_BATCHING_RULE.search(str(w.message))
            if found is None:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno, w.file, w.line)
            elif found.group(1) not in self._unbatched:
                self._unbatched.add(found.group(1))
                warnings.warn(
                    f"sgrld.Chains: torch.vmap has no batching rule for {found.group(1)}, so it "
                    "runs chain by chain (the same result, slower; shown once). A Hugging Face "
                    "model's attention: attn_implementation='eager' is batched",
                    UserWarning,
                    stacklevel=4,
                )

    def __call__(self, x: Tensor, *, shared: bool = False) -> Any:
        """Every chain's forward pass: ``x`` is ``(K, B, ...)`` (or ``(B, ...)`` if shared).

        The model's output stacked on a leading K dim; a Hugging Face model's ``ModelOutput``
        (its ``.logits`` ``(K, B, T, V)``), run with ``use_cache=False``: a key-value cache is
        not stacked (:meth:`map` passes other arguments).
        """
        if getattr(getattr(self.model, "config", None), "use_cache", False):  # Hugging Face's
            return self.map(lambda m, v: m(v, use_cache=False), x, shared=shared)
        return self.map(lambda m, v: m(v), x, shared=shared)

    def _group_grads(
        self, g: _Group, loss_fn: LossFn, args: tuple[Tensor, ...], grad_clip: float | None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        part = slice(g.start, g.stop)
        leaves = {n: p[part].detach().requires_grad_() for n, p in self.params.items()}
        with torch.enable_grad():
            losses = self._vmap(loss_fn, leaves, part, tuple(a[part] for a in args), False)
            if losses.shape != (g.stop - g.start,):
                raise ValueError(f"loss_fn must return a 0-d tensor, got {tuple(losses.shape[1:])}")
            # the chains share no parameter: the sum's gradient is each chain's own gradient
            found = torch.autograd.grad(losses.sum(), list(leaves.values()), allow_unused=True)
        pairs = zip(leaves.items(), found, strict=True)
        grads = {name: torch.zeros_like(p) if g is None else g for (name, p), g in pairs}
        clamp(grads.values(), grad_clip)
        return losses.detach(), grads

    def grads(
        self, loss_fn: LossFn, *args: Tensor, grad_clip: float | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Per-chain losses ``(K,)`` of ``loss_fn(model, *args_k)`` and their gradients
        ``name -> (K, ...)``, each element clamped to ±``grad_clip``."""
        parts = [self._group_grads(g, loss_fn, args, grad_clip) for g in self.groups]
        if len(parts) == 1:
            return parts[0]
        losses = torch.cat([loss for loss, _ in parts])
        return losses, {n: torch.cat([gr[n] for _, gr in parts]) for n in self.params}

    def apply(self, grads: Mapping[str, Tensor], *, adapt: bool = True) -> None:
        """One sampler step of every chain from stacked gradients (one call per group)."""
        parts = [{n: grads[n][g.start : g.stop] for n in self.params} for g in self.groups]
        self._apply(parts, adapt)

    def _apply(self, parts: list[dict[str, Tensor]], adapt: bool) -> None:
        if self.groups[0].sampler.sync_checks:
            for g, part in zip(self.groups, parts, strict=True):
                self._refuse(g, part)  # before any group moves
        for g, part in zip(self.groups, parts, strict=True):
            self._apply_group(g, part, adapt)

    def _apply_group(self, g: _Group, grads: dict[str, Tensor], adapt: bool) -> None:
        with torch.no_grad():
            checked = not self._host_checks or g.broken or not self._all_finite(grads)
            (g.sampler if checked else g.unchecked).step(
                g.state, grads, adapt=adapt, telemetry=g.telemetry
            )
            if self._host_checks and checked:
                g.broken = bool((g.state.flags[..., 0] != 0).any())

    def _refuse(self, g: _Group, grads: Mapping[str, Tensor]) -> None:
        """Sync checks: raise naming the chains with a non-finite gradient."""
        if self._all_finite(grads):
            return
        bad = [
            g.start + i
            for i in range(g.stop - g.start)
            if not all(bool(torch.isfinite(t[i]).all()) for t in grads.values())
        ]
        if bad:
            where = ", ".join(f"chain {k} (seed {self.seeds[k]})" for k in bad)
            raise NonFiniteGradientError(f"non-finite gradient in {where}; no chain was moved")

    @staticmethod
    def _all_finite(grads: Mapping[str, Tensor]) -> bool:
        """One sum per tensor and chain, read on the host (an overflowing sum only sends the
        step down the exact path)."""
        sums = torch.stack([t.reshape(t.shape[0], -1).sum(1) for t in grads.values()])
        return bool(torch.isfinite(sums).all())

    def step(
        self, loss_fn: LossFn, *args: Tensor, grad_clip: float | None = None, adapt: bool = True
    ) -> Tensor:
        """Gradients (:meth:`grads`) and one step of every chain (:meth:`apply`), group by
        group; the losses. A chain whose gradient is non-finite is frozen, buffers included."""
        sampler = self.groups[0].sampler
        sync = bool(sampler.sync_checks)
        saved = {}  # with deferred checks, a frozen chain's buffers are put back after the step
        if sampler.check_finite and not sync and self.model.training:
            saved = {n: b.clone() for n, b in self.buffers.items()}
        losses, pending = [], []
        for g in self.groups:
            loss, grads = self._group_grads(g, loss_fn, args, grad_clip)
            losses.append(loss)
            if sync:  # all gradients first: a bad one anywhere moves no chain
                pending.append(grads)
            else:
                self._apply_group(g, grads, adapt)
        if sync:
            self._apply(pending, adapt)
        if saved:
            frozen = torch.cat([g.state.flags[..., 0] != 0 for g in self.groups])
            for n, b in self.buffers.items():
                keep = frozen.reshape(-1, *([1] * (b.dim() - 1)))
                b.copy_(torch.where(keep, saved[n], b))
        return losses[0] if len(losses) == 1 else torch.cat(losses)

    def refresh(self) -> None:
        """Recompute the explicitly scheduled part of the metric (Wenzel: at each epoch end)."""
        for g in self.groups:
            g.sampler.refresh(g.state)

    def telemetry(self, reset: bool = True) -> list[dict[str, float]]:
        """Every chain's per-step figures since the last read (``telemetry=True``), as
        :meth:`sgrld.SGRLDOptimizer.telemetry` gives a single run's."""
        if self.groups[0].telemetry is None:
            raise RuntimeError("telemetry is off: build the Chains with telemetry=True")
        out = []
        for g in self.groups:
            assert g.telemetry is not None
            diagnostics = g.sampler.metric.diagnostics(g.state.stats, g.state.layout)
            extra = {key: value.reshape(-1).tolist() for key, value in diagnostics.items()}
            out += [
                telemetry_figures(sums, {key: float(v[i]) for key, v in extra.items()})
                for i, sums in enumerate(g.telemetry.tolist())
            ]
            if reset:
                g.telemetry.zero_()
        return out

    @property
    def adapting(self) -> bool:
        """Whether the last step adapted the metric (the warm-up of ``adapt_until`` steps)."""
        return any(  # each group's warm-up waited for its own chains (core.warmup)
            drawn_while_adapting(
                g.sampler.metric, self.step_count, g.sampler.adapt_until, arrival=g.state.warmup
            )
            for g in self.groups
        )

    def health(self) -> list[Health]:
        """Every chain's :func:`sgrld.health` from its telemetry since the last read (not
        reset); a chain frozen on a non-finite gradient has broken down."""
        temperature = self.groups[0].sampler.temperature
        failed = self.failures()
        return [
            Health("broken_down", "gradient", math.nan, math.inf, int(f["steps"]))
            if k in failed
            else judge([f], temperature)
            for k, f in enumerate(self.telemetry(reset=False))
        ]

    def state_bytes(self) -> int:
        """Bytes of sampler state (statistics, keys, flags) per chain."""
        total = 0
        for g in self.groups:
            tensors = [*g.state.stats.values(), g.state.keys, g.state.flags]
            total += sum(t.numel() * t.element_size() for t in tensors) // (g.stop - g.start)
        return total // len(self.groups)

    def failures(self) -> dict[int, int]:
        """Chains that broke down: ``chain index -> first step with a non-finite gradient``
        (one host read)."""
        return {k: step for k, (step, _) in self.failure_details().items()}

    def failure_details(self) -> dict[int, tuple[int, str]]:
        """Chains that broke down: ``chain index -> (first bad step, name of the first parameter
        whose gradient was non-finite)`` (one host read)."""
        names = self.groups[0].state.layout.names  # every group's: views of the same tensors
        found = first_failures(g.state.flags for g in self.groups)
        return {k: (step, names[tensor]) for k, (step, tensor) in found.items()}

    def check(self) -> None:
        """Raise :class:`~sgrld.NonFiniteGradientError` naming every chain that broke down (the
        chain runner's message: :func:`sgrld.core.runner.stopped`)."""
        failed = self.failures()
        if failed:
            raise stopped(failed, self.seeds)

    @property
    def step_count(self) -> int:
        """Steps taken (the same for every chain)."""
        return self.groups[0].state.step

    def stats(self) -> dict[str, Tensor]:
        """The metric's statistics, stacked over all chains (``name -> (K, ...)``)."""
        keys = self.groups[0].state.stats
        return {key: torch.cat([g.state.stats[key] for g in self.groups]) for key in keys}

    def module(self, chain: int) -> nn.Module:
        """A standalone copy of chain ``chain``'s model (e.g. for a single-run evaluation)."""
        if not 0 <= chain < self.num_chains:
            raise IndexError(f"chain {chain} of {self.num_chains}")
        module = copy.deepcopy(self.model)
        tensors = {n: t[chain] for n, t in {**self.params, **self.buffers}.items()}
        tensors |= self.frozen
        with torch.no_grad():  # each tensor once: tied weights (an LM head's) stay tied
            for name, t in [*module.named_parameters(), *module.named_buffers()]:
                t.copy_(tensors[name])
        return module

    def state_dict(self) -> dict[str, Any]:
        """Everything to continue exactly: parameters, buffers and each group's sampler state."""
        return {
            "seeds": list(self.seeds),
            "params": {n: p.clone() for n, p in self.params.items()},
            "buffers": {n: b.clone() for n, b in self.buffers.items()},
            "samplers": [g.state.state_dict() for g in self.groups],
        }

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` in place; a dict of other chains is refused unchanged."""
        if list(sd.get("seeds", [])) != self.seeds or len(sd["samplers"]) != len(self.groups):
            raise ValueError("state dict is for other chains (seeds or α² groups differ)")
        for kind in ("params", "buffers"):
            mine = getattr(self, kind)
            theirs = sd[kind]
            if set(theirs) != set(mine) or any(
                theirs[n].shape != t.shape or theirs[n].dtype != t.dtype for n, t in mine.items()
            ):
                raise ValueError(f"state dict: {kind} do not match these chains")
        for g, s in zip(self.groups, sd["samplers"], strict=True):
            g.state.validate_state_dict(s)
        for kind in ("params", "buffers"):
            for n, t in getattr(self, kind).items():
                t.copy_(sd[kind][n])
        for g, s in zip(self.groups, sd["samplers"], strict=True):
            g.state.apply_state_dict(s)
            g.broken = bool((g.state.flags[..., 0] != 0).any())  # frozen chains stay frozen


def _stack(
    model: nn.Module | ModelFactory,
    seeds: list[int],
    sample: Callable[[str], bool] | None,
    device: torch.device | str | None,
) -> tuple[nn.Module, dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]:
    """The template module, the stacked sampled parameters and buffers, and the parameters
    ``sample`` leaves out: one frozen copy (chain 0's). The models are built one at a time."""
    template: nn.Module | None = None
    sampled: dict[str, list[Tensor]] = {}
    buffers: dict[str, list[Tensor]] = {}
    frozen: dict[str, Tensor] = {}
    for s in seeds:
        if isinstance(model, nn.Module):
            m = copy.deepcopy(model)  # every chain starts at the same point
        elif callable(model):
            m = model(s)
        else:
            raise TypeError("model must be an nn.Module or a callable seed -> nn.Module")
        if device is not None:
            m = m.to(device)
        for name, p in m.named_parameters():
            if sample is None or sample(name):
                sampled.setdefault(name, []).append(p.detach().clone())
            elif template is None:
                frozen[name] = p.detach()
            elif not torch.equal(p.detach(), frozen[name]):
                raise ValueError(
                    f"the parameter {name!r} is not sampled but differs between chains: the "
                    "frozen parameters are shared, so the model must build them alike for every "
                    "seed (e.g. load the same pretrained weights)"
                )
        for name, b in m.named_buffers():
            buffers.setdefault(name, []).append(b.detach().clone())
        if template is None:
            template = m
    assert template is not None
    stack = {n: torch.stack(ts) for n, ts in sampled.items()}
    return template, stack, {n: torch.stack(ts) for n, ts in buffers.items()}, frozen


def chain_batches(
    num_data: int,
    batch_size: int,
    generators: Sequence[torch.Generator],
    device: torch.device | str | None = None,
) -> Iterator[Tensor]:
    """One epoch of minibatch indices per chain, shape ``(K, B)`` per step: chain k's
    ``torch.randperm(num_data, generator=generators[k])`` cut into batches, as a single run's.
    """
    if batch_size < 1 or num_data < 1:
        raise ValueError(f"need num_data >= 1 and batch_size >= 1, got {num_data}, {batch_size}")
    order = torch.stack([torch.randperm(num_data, generator=g) for g in generators])
    order = order.to(device) if device is not None else order
    for start in range(0, num_data, batch_size):
        yield order[:, start : start + batch_size]
