"""The one step engine: every path that moves a chain goes through :func:`advance`.

The optimizer facade (:mod:`sgrld.optim`), the functional :class:`~sgrld.core.sampler.Sampler`,
its multi-step :meth:`~sgrld.core.sampler.Sampler.run` and the compiled and captured steps all
call the same function, so an option either works on every path or is refused on all of them.

One step (paper eq. 4 with h = ℓ/n, Γ dropped; ``docs/conventions.md``):

1. validate the gradients against the parameters (shape, dtype, device: host metadata only);
2. gather them into the flat buffer and check them (see *checks* below); SGLD (G = I) skips the
   copy: its check and move read the gradients themselves (the same numbers, bit for bit);
3. draw ξ (:mod:`sgrld.core.noise`);
4. :func:`body`: ``metric.update`` → ``metric.inverse`` → ``metric.inverse_sqrt`` → the
   Euler–Maruyama move (:func:`~sgrld.core.integrator.euler_maruyama`);
5. count the step on the host and on the device, and refresh a scheduled metric part (Shampoo's
   roots) when it is due — on the host, outside the hot step.

**Checks** (``NaN``/``Inf`` in a gradient), three modes:

* ``"sync"`` (default on CPU, where reading a flag is free): one reduction, read at once; a bad
  gradient raises :class:`NonFiniteGradientError` before anything changes.
* ``"deferred"`` (default on CUDA and for ``capturable=True``): no host read in the step. The
  first bad step and tensor of each chain are recorded in device flags; that chain's step is
  masked (gradient and noise zeroed, so the move is exactly zero, and every statistic restored),
  so the parameters and statistics are untouched exactly as in ``"sync"`` mode; the chain stays
  frozen from then on. The error is raised at the next host read: :func:`check`
  (``opt.check()``, the runner's epoch end) and ``state_dict()`` (checkpoints).
* ``"off"`` (``check_finite=False``): nothing.

**Device-resident scalars.** ``state.device_step`` is the step count as a 0-d int64 tensor on the
parameters' device; ℓ may be a 0-d (or per-chain ``(K,)``) tensor, and σ = √(2ℓτ/n) is then
computed on the device, so a scheduler that changes ℓ neither syncs nor recompiles.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import Tensor

from sgrld.core.contract import Metric, Stats
from sgrld.core.integrator import euler_maruyama
from sgrld.core.layout import FlatLayout
from sgrld.core.noise import NoiseSource
from sgrld.core.shards import SumsAhead
from sgrld.core.state import SamplerState, Workspace

CheckMode = Literal["sync", "deferred", "off"]
Scalar = float | Tensor


class NonFiniteGradientError(FloatingPointError):
    """A gradient holds NaN or ±Inf; the step was refused and nothing was changed."""


def check_mode(
    check_finite: bool, sync_checks: bool | None, device: torch.device, capturable: bool
) -> CheckMode:
    """The check mode of a sampler (see the module docstring)."""
    if not check_finite:
        return "off"
    if capturable:
        if sync_checks:
            raise ValueError(
                "sync_checks=True reads a flag on the host every step, which a captured step "
                "cannot do; use capturable=False, or read the flag with check()"
            )
        return "deferred"
    if sync_checks is None:
        return "sync" if device.type == "cpu" else "deferred"
    return "sync" if sync_checks else "deferred"


def validate_grads(state: SamplerState, grads: Sequence[Tensor | None]) -> None:
    """Refuse gradients that do not fit their parameter (metadata only: no host sync)."""
    for name, p, g in zip(state.params, state.params.values(), grads, strict=True):
        if g is None:
            continue
        if not isinstance(g, Tensor):
            raise TypeError(f"gradient of parameter {name!r} is a {type(g).__name__}, not a tensor")
        if g.layout != torch.strided:
            raise RuntimeError(
                f"gradient of parameter {name!r} is {g.layout}: SGRLD samplers do not support "
                "sparse gradients (the metric's statistics and the noise are dense)"
            )
        if g.shape != p.shape:
            raise ValueError(
                f"gradient of parameter {name!r} has shape {tuple(g.shape)}, the parameter "
                f"{tuple(p.shape)}: a gradient must have exactly its parameter's shape"
            )
        if g.dtype != p.dtype:
            raise ValueError(
                f"gradient of parameter {name!r} is {g.dtype}, the parameter {p.dtype}: "
                "a gradient must have its parameter's dtype"
            )
        if g.device != p.device:
            raise ValueError(
                f"gradient of parameter {name!r} is on {g.device}, the parameter on {p.device}"
            )


def _refuse_nonfinite(total: Tensor, named: Callable[[], Sequence[tuple[str, Tensor]]]) -> None:
    """The ``"sync"`` check: one host read of ``total`` (a sum over the gradients: NaN/Inf
    anywhere makes it non-finite); only then each tensor of ``named()`` is looked at, to name the
    first bad one. A sum that overflowed although every element is finite refuses nothing."""
    # one ``item`` (free on CPU) instead of isfinite → all → bool, five small kernels
    if math.isfinite(total.item()):
        return
    for name, g in named():
        if not bool(torch.isfinite(g).all()):
            raise NonFiniteGradientError(f"gradient of parameter {name!r} contains NaN or Inf")


def check_finite_now(state: SamplerState, grads: Sequence[Tensor | None]) -> None:
    """The ``"sync"`` check on a group's gradients as given (before any group moves)."""
    present = [(n, g) for n, g in zip(state.layout.names, grads, strict=True) if g is not None]
    if present:
        _check_each(present, state.layout)


def _check_each(named: list[tuple[str, Tensor]], layout: FlatLayout) -> None:
    """The ``"sync"`` check on parameter-shaped gradients: one sum each, one host read."""
    sums = torch.stack([g.sum() for _, g in named])
    if layout.shards is not None:
        _check_shards(sums, [n for n, _ in named], layout)
        return
    _refuse_nonfinite(sums.sum(), lambda: named)


def _check_now(names: Sequence[str], layout: FlatLayout, flat: Tensor) -> None:
    """The ``"sync"`` check on the gathered flat gradient: one reduction, one host read."""
    if layout.shards is not None:
        sums = torch.stack([seg.sum() for seg in layout.segments(flat)])
        _check_shards(sums, names, layout)
        return
    _refuse_nonfinite(flat.sum(), lambda: list(zip(names, layout.segments(flat), strict=True)))


def _check_shards(sums: Tensor, names: Sequence[str], layout: FlatLayout) -> None:
    """The ``"sync"`` check of sharded gradients: the per-tensor sums of every rank's shard,
    summed over the ranks (one all-reduce), so that every rank refuses the same step naming the
    same tensor, whichever rank holds the bad element."""
    _refuse_shards(layout.sum_(sums), names)


def _refuse_shards(total: Tensor, names: Sequence[str]) -> None:
    """Refuse unless every tensor's gradient sum over the ranks (``total``) is finite."""
    finite = torch.isfinite(total)
    if bool(finite.all()):
        return
    name = names[int((~finite).to(torch.int8).argmax())]
    raise NonFiniteGradientError(f"gradient of parameter {name!r} contains NaN or Inf")


def _record_bad(
    state: SamplerState, layout: FlatLayout, grad: Tensor, active: list[int] | None = None
) -> Tensor:
    """Device-side check: per chain, whether it may move this step, shape (*batch, 1).

    Records the first bad step and tensor of each chain in ``state.flags``; a chain moves only if
    its gradient is finite and it had no bad step before. No host read. ``active`` maps the
    tensors of ``layout`` (a step's subset with gradients) to the state's tensor indices.
    """
    # max |g| per tensor and chain (NaN propagates through amax); abs + amax is ~15x faster
    # than the inf-norm kernel on CPU (4 x 478k float32: 0.4 ms against 5.6 ms)
    peaks = torch.stack(
        [s.abs().amax(dim=-1) if s.shape[-1] else s.sum(-1) for s in layout.segments(grad)],
        dim=-1,
    )  # an empty shard (a rank FSDP2 gave no rows) has peak 0
    if layout.shards is not None:  # each rank's peaks summed: NaN/Inf on any rank shows on all
        peaks = layout.sum_(peaks)
    finite = torch.isfinite(peaks)  # (*batch, P)
    ok = finite.all(dim=-1)
    flags = state.flags
    first = flags[..., 0] == 0
    new = first & ~ok
    step = state.device_step + 1
    flags[..., 0] = torch.where(new, step, flags[..., 0])
    # index of the first non-finite tensor (argmax of the first False)
    bad_tensor = (~finite).to(torch.int8).argmax(dim=-1)
    if active is not None:
        bad_tensor = torch.tensor(active, device=bad_tensor.device)[bad_tensor]
    flags[..., 1] = torch.where(new, bad_tensor, flags[..., 1])
    # a chain stays frozen from its first bad step on (the error is raised at the next read)
    return (ok & first).unsqueeze(-1)


def _sum_ahead(
    metric: Metric | None,
    stats: Stats,
    layout: FlatLayout,
    grad: Tensor,
    xi: Tensor | None,
    adapt: bool,
    check: bool,
) -> None:
    """Sharded parameters: the finite check's per-tensor sums and the metric's sums of this
    step (:class:`~sgrld.core.shards.SumsAhead`) in one all-reduce, before anything changes; a
    bad gradient is refused here, on every rank alike; the metric takes its sums by name
    (``metric=None``: the check alone)."""
    shards = layout.shards
    assert shards is not None
    shards.ahead.clear()
    ahead: dict[str, Tensor] = {}
    if isinstance(metric, SumsAhead):
        ahead = metric.sums_ahead(stats, layout, grad, xi, adapt)
    parts = [torch.stack([seg.sum() for seg in layout.segments(grad)])] if check else []
    parts += [v.reshape(-1) for v in ahead.values()]
    if not parts:
        return
    total = shards.sum_(torch.cat(parts))
    if check:
        _refuse_shards(total[: len(layout.names)], layout.names)
        total = total[len(layout.names) :]
    sizes = [v.numel() for v in ahead.values()]
    for (name, v), part in zip(ahead.items(), total.split(sizes), strict=True):
        shards.ahead[name] = part.view_as(v)


def check(state: SamplerState, label: str = "") -> None:
    """Raise :class:`NonFiniteGradientError` if a deferred check recorded a bad gradient.

    The one host read of the deferred flags; it names the first bad step and parameter (and
    the chain where there are several).
    """
    flags = state.flags
    bad = flags[..., 0]
    if not bool((bad != 0).any()):
        return
    flat = flags.reshape(-1, 2).tolist()
    chains = [i for i, (s, _) in enumerate(flat) if s != 0]
    chain = min(chains, key=lambda i: flat[i][0])
    step, tensor = flat[chain]
    where = f" of chain {chain}" if state.layout.batch_shape else ""
    others = f" ({len(chains)} chains affected)" if len(chains) > 1 else ""
    raise NonFiniteGradientError(
        f"{label}gradient of parameter {state.layout.names[tensor]!r}{where} contains NaN or "
        f"Inf at step {step}{others}; that step and those after it were not applied to the "
        "affected chains"
    )


def sigma_of(lr: Scalar, num_data: float, temperature: float) -> Scalar:
    """σ = √(2ℓτ/n), on the device when ℓ is a tensor."""
    if isinstance(lr, Tensor):
        return torch.sqrt(lr * (2.0 * temperature / num_data))
    return math.sqrt(2.0 * lr * temperature / num_data)


def _per_chain(value: Scalar, layout: FlatLayout, like: Tensor) -> Scalar:
    """A per-chain ℓ or σ of shape (K,) as (K, 1): broadcast over the flat (K, D) buffers."""
    if isinstance(value, Tensor) and value.dim() > 0:
        return value.to(like.dtype).reshape(*layout.batch_shape, 1)
    return value


def body(
    metric: Metric,
    stats: Stats,
    layout: FlatLayout,
    grad: Tensor,
    xi: Tensor | None,
    params: list[Tensor],
    step: int | Tensor,
    lr: Scalar,
    sigma: Scalar,
    adapt: bool,
    refresh: bool = False,
    views: Callable[[Tensor], list[Tensor]] | None = None,
    telemetry: Tensor | None = None,
    pull: Callable[[Tensor], None] | None = None,
) -> None:
    """The step's maths, the one place it is composed: update G, then θ ← θ − ℓG⁻¹ĝ + σG^{-½}ξ.

    ``grad`` and ``xi`` are private flat buffers (the metric may overwrite them). ``lr`` and
    ``sigma`` are Python floats (eager) or tensors: 0-d, or per chain ``(*batch, 1)``. With
    ``refresh`` the metric's scheduled part (Shampoo's roots) is recomputed after the update,
    so that this step already uses it (as the paper's code does). ``pull`` adds the
    localisation's gradient to ``grad`` after the statistics have seen the loss's alone
    (:func:`localization_pull`).
    """
    if adapt:
        metric.update(stats, layout, grad, step)
        if refresh:
            metric.refresh(stats, layout)
    if pull is not None:
        pull(grad)
    shape = layout.views if views is None else views  # eager steps reuse the buffers' views
    drift = shape(metric.inverse(stats, layout, grad))
    noise = None if xi is None else shape(metric.inverse_sqrt(stats, layout, xi))
    if telemetry is not None:
        record_telemetry(telemetry, params, drift, noise, lr, sigma)
    move(layout, params, drift, noise, lr, sigma)


#: what :func:`record_telemetry` sums per step, in this order (then the step count)
TELEMETRY = ("drift_sq", "noise_sq", "theta_sq")


def telemetry_figures(sums: Sequence[float], extra: dict[str, float]) -> dict[str, float]:
    """One chain's figures from its :func:`record_telemetry` sums (drift², noise², θ², steps)
    and the metric's own (``extra``): the step count, the root-mean-square over the steps of
    the norms of the drift, the noise and θ (``theta_norm``: a norm of every element, not a
    per-element RMS), and the drift-to-noise ratio (inf without noise)."""
    drift_sq, noise_sq, theta_sq, steps = sums
    n = max(steps, 1.0)
    return {
        "steps": steps,
        "drift_rms": math.sqrt(drift_sq / n),
        "noise_rms": math.sqrt(noise_sq / n),
        "theta_norm": math.sqrt(theta_sq / n),
        "drift_to_noise": math.sqrt(drift_sq / noise_sq) if noise_sq > 0 else math.inf,
        **extra,
    }


def record_telemetry(
    acc: Tensor,
    params: Sequence[Tensor],
    drift: Sequence[Tensor],
    noise: Sequence[Tensor] | None,
    lr: Scalar,
    sigma: Scalar,
) -> None:
    """Add this step's ‖ℓG⁻¹ĝ‖², ‖σG^{-½}ξ‖², ‖θ‖² (before the move) and 1 to the device
    accumulator ``acc`` (float64, ``(*batch, 4)``: one row per chain): three reductions, no
    host read."""
    batch = acc.shape[:-1]
    nb = len(batch)

    def sq(xs: Sequence[Tensor]) -> Tensor:
        if nb == 0:  # one chain: the fused foreach norms
            return torch.stack(torch._foreach_norm(list(xs))).to(torch.float64).square().sum()
        per = [x.reshape(*x.shape[:nb], -1).to(torch.float64).square().sum(-1) for x in xs]
        return torch.stack(per).sum(0)

    def per_chain(value: Scalar) -> Tensor:
        t = torch.as_tensor(value, dtype=torch.float64, device=acc.device)
        return t.reshape(batch) if nb and t.numel() == math.prod(batch) else t

    zero = acc.new_zeros(batch)
    parts = [
        sq(drift) * per_chain(lr).square(),
        zero if noise is None else sq(noise) * per_chain(sigma).square(),
        sq(params).expand(batch) if nb else sq(params),
        acc.new_ones(batch),
    ]
    acc.add_(torch.stack([p.expand(batch) for p in parts], dim=-1))


def move(
    layout: FlatLayout,
    params: list[Tensor],
    drift: Sequence[Tensor],
    noise: Sequence[Tensor] | None,
    lr: Scalar,
    sigma: Scalar,
) -> None:
    """θ ← θ − ℓ·drift + σ·noise per tensor (drift = G⁻¹ĝ, noise = G^{-½}ξ, parameter-shaped)."""
    if isinstance(lr, Tensor) and lr.dim() > 0:  # per chain: (K, 1) → (K, 1, ..., 1) per tensor
        nb = len(layout.batch_shape)
        lrs = [lr.reshape(*lr.shape[:nb], *([1] * (d.dim() - nb))) for d in drift]
        sig = sigma if isinstance(sigma, Tensor) else torch.as_tensor(sigma)
        sigs = [sig.reshape(*lr.shape[:nb], *([1] * (d.dim() - nb))) for d in drift]
        if noise is None:
            moves = [-d * r for d, r in zip(drift, lrs, strict=True)]
        else:
            moves = [n * s - d * r for d, n, r, s in zip(drift, noise, lrs, sigs, strict=True)]
        torch._foreach_add_(params, moves)
        return
    euler_maruyama(params, drift, noise, lr, sigma)


def advance(
    metric: Metric,
    state: SamplerState,
    grads: Sequence[Tensor | None],
    *,
    lr: Scalar,
    num_data: float,
    temperature: float,
    checks: CheckMode = "sync",
    adapt: bool = True,
    noise_source: NoiseSource = "torch",
    compiled: object | None = None,
    refresh: bool = True,
    direct: bool = True,
    telemetry: Tensor | None = None,
    closes_warmup: bool = False,
    localization: float = 0.0,
) -> None:
    """One SGRLD step of ``state`` in place; parameters whose gradient is ``None`` are skipped.

    ``lr`` is a float or a tensor (0-d, or ``(K,)`` for one ℓ per chain); ``checks`` is the
    check mode (module docstring); with ``adapt=False`` the metric's statistics are not updated
    (a frozen G); ``compiled`` is a :class:`~sgrld.core.compiled.CompiledMove` that runs the
    body as one compiled call; ``refresh=False`` leaves a due scheduled refresh (Shampoo's
    roots) to the caller (captured steps: see :func:`refresh_due`). ``direct=False`` sends
    SGLD (G = I) through the flat buffers like every other metric instead of its direct path
    (the same numbers, bit for bit; tests compare the two). ``telemetry``: a float64
    ``(*batch, 4)`` device accumulator that :func:`record_telemetry` adds this step's figures to.
    ``localization`` c > 0 adds c·(θ − θ₀) (θ₀ = ``state.center``) to the drift's gradient
    only: the metric's statistics see ĝ alone (:func:`localization_pull`).
    """
    layout = state.layout
    params = list(state.params.values())
    active = [i for i, g in enumerate(grads) if g is not None]
    if not active:
        return
    validate_grads(state, grads)
    present = [g for g in grads if g is not None]
    if len(active) == len(params):
        if state.workspace is None:
            state.workspace = Workspace.for_layout(layout, params[0])
        work, stats, sub_layout = state.workspace, state.stats, layout
    else:  # rare: a subset of the group has gradients this step
        stats, sub_layout = _restrict(metric, state.stats, layout, active)
        work = Workspace.for_layout(sub_layout, params[0])
        params = [params[i] for i in active]
    ok: Tensor | None = None
    if localization and state.center is None:
        raise ValueError(
            "localization needs a state with a centre (init by a sampler with localization > 0)"
        )
    if (
        direct
        and not localization
        and not metric.preconditions
        and checks != "deferred"
        and compiled is None
        and all(g.is_contiguous() for g in present)
    ):
        # G = I: the drift is the gradient itself, so no flat copy of it (one read and one
        # write of D saved). Contiguous gradients only: the move's kernels then iterate them
        # exactly as the flat buffer's views, so every number is the general path's.
        grad = None
        if checks == "sync":
            _check_each(list(zip(sub_layout.names, present, strict=True)), sub_layout)
    else:
        grad = work.gather(present)
        if checks == "sync" and sub_layout.shards is None:  # sharded: with the sums, below
            _check_now(sub_layout.names, sub_layout, grad)
        elif checks == "deferred":
            ok = _record_bad(state, sub_layout, grad, None if sub_layout is layout else active)
            grad.masked_fill_(~ok, 0.0)  # a bad chain's move is then exactly zero

    step = state.step + 1
    sigma = sigma_of(lr, num_data, temperature)
    # σ > 0 exactly then (n > 0 is validated); a float ℓ = 0 (a warm-up's start) draws nothing
    positive = temperature > 0.0 and not (isinstance(lr, (int, float)) and lr == 0.0)
    # the warm-up's last step refreshes as a scheduled one would (:func:`~.warmup.closes_warmup`)
    due = refresh and adapt and (refresh_due(metric, step) or closes_warmup)
    # a grad subset and a refresh step (eigh on the host, every few hundred steps) run eagerly
    fuse = compiled is not None and stats is state.stats and not due and telemetry is None
    fuse = fuse and not localization  # the pull is added eagerly (:func:`localization_pull`)
    # compiled with counter-based noise: ξ is drawn inside the compiled call, which then makes
    # one fused pass over D (the same numbers: a function of the keys and the step count)
    inline = fuse and positive and noise_source == "philox" and ok is None
    inline = inline and sub_layout.shards is None

    def draw() -> Tensor:
        return work.noise.draw(state.generator, noise_source, state.keys, state.device_step)

    # ξ first: the generator drives nothing else, so the order does not change the chain.
    xi = draw() if positive and not inline else None
    if grad is None:  # the direct path of G = I
        noise = None if xi is None else work.views(xi)
        like = present[0]
        lr_arg, sigma_arg = _per_chain(lr, sub_layout, like), _per_chain(sigma, sub_layout, like)
        if telemetry is not None:
            record_telemetry(telemetry, params, present, noise, lr, sigma)
        move(sub_layout, params, present, noise, lr_arg, sigma_arg)
        state.step = step
        state.device_step.add_(1)
        return
    if sub_layout.shards is not None and checks != "deferred":
        # localised: G⁻¹ acts on ĝ + c(θ − θ₀), which the sums ahead (taken from ĝ) do not
        # see, so the metric then sums over the ranks itself, one all-reduce per sum
        summing = None if localization else metric
        _sum_ahead(summing, stats, sub_layout, grad, xi, adapt, checks == "sync")
    if xi is not None and ok is not None:
        xi.masked_fill_(~ok, 0.0)
    saved = None
    if ok is not None and adapt:
        saved = {k: v.clone() for k, v in stats.items()}
    step_arg: int | Tensor = state.device_step + 1 if checks == "deferred" else step
    lr_arg, sigma_arg = _per_chain(lr, sub_layout, grad), _per_chain(sigma, sub_layout, grad)
    fused = False
    pull = None
    if localization:
        assert state.center is not None
        centers = state.center if sub_layout is layout else [state.center[i] for i in active]
        pull = localization_pull(localization, params, centers, work.views, ok)
    if fuse and compiled is not None:
        keys = (state.keys, state.device_step) if inline else ()
        fused = compiled(  # type: ignore[operator]
            metric, stats, sub_layout, grad, xi, params, step_arg, lr_arg, sigma_arg, adapt, *keys
        )
    if not fused:
        if inline:  # not compiled after all: the same ξ, drawn eagerly
            xi = draw()
        args = (metric, stats, sub_layout, grad, xi, params, step_arg, lr_arg, sigma_arg)
        body(*args, adapt, due, work.views, telemetry, pull)
    if sub_layout.shards is not None:
        sub_layout.shards.ahead.clear()
    if saved is not None and ok is not None:
        for k, v in stats.items():  # a bad chain's statistics as they were
            keep = ok.reshape(*ok.shape[:-1], *([1] * (v.dim() - ok.dim() + 1)))
            v.copy_(torch.where(keep, v, saved[k]))
    state.step = step
    state.device_step.add_(1)
    if stats is not state.stats:
        _merge(metric, state.stats, stats, layout, active)


def localization_pull(
    strength: float,
    params: list[Tensor],
    centers: list[Tensor],
    views: Callable[[Tensor], list[Tensor]],
    ok: Tensor | None,
) -> Callable[[Tensor], None]:
    """The localisation's gradient c·(θ − θ₀), added to the flat gradient between the metric's
    update and G⁻¹: the drift is G⁻¹(ĝ + c(θ − θ₀)) while G is built from ĝ alone, the loss's
    gradient (Hitchcock & Hoogland 2025, App. D.3). A chain the deferred check stopped (``ok``
    false) stays exactly where it is. ``docs/llc.md`` maps c to devinterp's γ."""

    def pull(grad: Tensor) -> None:
        torch._foreach_add_(views(grad), torch._foreach_sub(params, centers), alpha=strength)
        if ok is not None:
            grad.masked_fill_(~ok, 0.0)

    return pull


def update_metric(
    metric: Metric, stats: Stats, layout: FlatLayout, grad: Tensor, step: int
) -> None:
    """``metric.update`` then, when due at ``step``, the scheduled refresh: the statistics part
    of an eager step (for callers that drive a metric directly, as the tests do)."""
    metric.update(stats, layout, grad, step)
    if refresh_due(metric, step):
        metric.refresh(stats, layout)


def in_graph() -> bool:
    """Whether this step is being traced by ``torch.compile`` or captured in a CUDA graph: then
    nothing may be decided from host values (a scheduled refresh is left to the host)."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def refresh_due(metric: Metric, step: int) -> bool:
    """Whether the metric's scheduled refresh (Shampoo's roots) is due after step ``step``."""
    interval = metric.refresh_interval
    return interval is not None and step % interval == 0


def _restrict(
    metric: Metric, stats: Stats, layout: FlatLayout, active: list[int]
) -> tuple[Stats, FlatLayout]:
    """Statistics of the parameters in ``active`` only (copies, written back by ``_merge``)."""
    sub_layout = FlatLayout(
        tuple(layout.names[i] for i in active),
        tuple(layout.shapes[i] for i in active),
        layout.batch_shape,
        None if layout.shards is None else layout.shards.restrict(active),
    )
    kinds = metric.stat_kinds(stats)
    index = {i: j for j, i in enumerate(active)}
    idx = torch.tensor(active)
    sub: Stats = {}
    for key, value in stats.items():
        if "@" in key:
            stat, i = key.rsplit("@", 1)
            if int(i) in index:
                sub[f"{stat}@{index[int(i)]}"] = value
        elif kinds[key] == "element":
            segs = layout.segments(value)
            sub[key] = torch.cat([segs[i] for i in active], dim=-1)
        elif kinds[key] == "tensor":
            sub[key] = value.index_select(-1, idx.to(value.device))
        else:
            sub[key] = value
    return sub, sub_layout


def _merge(metric: Metric, stats: Stats, sub: Stats, layout: FlatLayout, active: list[int]) -> None:
    kinds = metric.stat_kinds(stats)
    idx = torch.tensor(active)
    for key, value in stats.items():
        if "@" in key:
            stat, i = key.rsplit("@", 1)
            if int(i) in active:
                stats[key] = sub[f"{stat}@{active.index(int(i))}"]
        elif kinds[key] == "element":
            segs = layout.segments(value)
            for seg, src in zip(
                (segs[i] for i in active),
                sub[key].split([layout.numels[i] for i in active], -1),
                strict=True,
            ):
                seg.copy_(src)
        elif kinds[key] == "tensor":
            value.index_copy_(-1, idx.to(value.device), sub[key])
        else:
            stats[key] = sub[key]
