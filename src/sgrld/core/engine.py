"""The one step engine: every path that moves a chain goes through :func:`advance`, so an option
works on every path or is refused on all of them (``docs/usage.md``, "One step engine").

A step (paper eq. 4 with h = ℓ/n, Γ dropped): SGLD moves by the gradients themselves
(:func:`_by_gradient`, bit for bit the flat path's numbers); other metrics gather them into a
flat buffer, check them, draw ξ and run :func:`body`, eagerly or compiled. NaN/Inf checks are
``"sync"`` (read at once), ``"deferred"`` (device flags, the chain frozen, raised at the next
host read: :func:`check`) or ``"off"``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

from sgrld.core.contract import Metric, PerTensor, StatKind, Stats, host_reads
from sgrld.core.integrator import euler_maruyama, noise_scale
from sgrld.core.layout import FlatLayout
from sgrld.core.noise import NoiseSource
from sgrld.core.shards import SumsAhead
from sgrld.core.state import SamplerState, Workspace
from sgrld.core.warmup import keep_where, restart, since_restart

CheckMode = Literal["sync", "deferred", "off"]
Scalar = float | Tensor


class NonFiniteGradientError(FloatingPointError):
    """A gradient holds NaN or ±Inf; the step was refused and nothing was changed."""


def validate_grads(params: Mapping[str, Tensor], grads: Sequence[Tensor | None]) -> None:
    """Refuse gradients that do not fit their parameter (metadata only: no host sync)."""
    for (name, p), g in zip(params.items(), grads, strict=True):
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


def _refuse_nonfinite(
    total: Tensor, names: Sequence[str], tensors: Callable[[], Sequence[Tensor]]
) -> None:
    """The ``"sync"`` check: one host read of the sum ``total``, then name the first bad tensor."""
    # one ``item`` (free on CPU) instead of isfinite → all → bool, five small kernels
    if math.isfinite(total.item()):
        return
    for name, g in zip(names, tensors(), strict=True):
        if not bool(torch.isfinite(g).all()):
            raise NonFiniteGradientError(f"gradient of parameter {name!r} contains NaN or Inf")


def check_finite_now(layout: FlatLayout, grads: Sequence[Tensor | None]) -> None:
    """The ``"sync"`` check on parameter-shaped gradients (``None``: skipped): one sum each, one
    read (a facade checks every group's before any group moves)."""
    present = [(n, g) for n, g in zip(layout.names, grads, strict=True) if g is not None]
    if not present:
        return
    names, tensors = zip(*present, strict=True)
    sums = torch.stack([g.sum() for g in tensors])
    if layout.shards is not None:
        _refuse_shards(layout.sum_(sums), names)
    else:
        _refuse_nonfinite(sums.sum(), names, lambda: tensors)


def _refuse_shards(total: Tensor, names: Sequence[str]) -> None:
    """The ``"sync"`` check on per-tensor sums over the ranks (every rank refuses alike)."""
    finite = torch.isfinite(total)
    if bool(finite.all()):
        return
    name = names[int((~finite).to(torch.int8).argmax())]
    raise NonFiniteGradientError(f"gradient of parameter {name!r} contains NaN or Inf")


def _record_bad(
    state: SamplerState, layout: FlatLayout, grad: Tensor, active: Sequence[int] | None = None
) -> Tensor:
    """Device-side check: per chain, whether it may move this step, shape (*batch, 1); records the
    first bad step and tensor (``active`` maps a subset's indices back) in ``state.flags``.
    """
    # max |g| per tensor and chain as max(max g, −min g) (NaN propagates): two reads of D, no
    # |g| buffer (abs + amax, the inf-norm and aminmax kernels all measured slower on CPU)
    peaks = torch.stack(
        [
            torch.maximum(s.amax(-1), -s.amin(-1)) if s.shape[-1] else s.sum(-1)
            for s in layout.segments(grad)
        ],
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
    """Sharded parameters: the finite check's per-tensor sums and the metric's sums of this step
    (:class:`~sgrld.core.shards.SumsAhead`) in one all-reduce, before anything changes.
    """
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
    """Raise :class:`NonFiniteGradientError` if a deferred check recorded a bad gradient (the one
    host read of the flags, naming the first bad step, parameter and chain)."""
    if not bool((state.flags[..., 0] != 0).any()):
        return
    flat = state.flags.reshape(-1, 2).tolist()
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


def _per_chain(value: Scalar, layout: FlatLayout, like: Tensor) -> Scalar:
    """A per-chain ℓ or σ of shape (K,) as (K, 1): broadcast over the flat (K, D) buffers."""
    if isinstance(value, Tensor) and value.dim() > 0:
        return value.to(like.dtype).reshape(*layout.batch_shape, 1)
    return value


class Move(NamedTuple):
    """One step's arguments of :func:`body`: ``grad`` and ``xi`` private flat buffers (the metric
    may overwrite them), ``step`` the count after it (int or 0-d device tensor), ℓ and σ floats or
    0-d or ``(*batch, 1)`` tensors."""

    metric: Metric
    stats: Stats
    layout: FlatLayout
    grad: Tensor
    xi: Tensor | None
    params: list[Tensor]
    step: int | Tensor
    lr: Scalar
    sigma: Scalar
    adapt: bool


def body(
    move: Move,
    refresh: bool = False,
    views: Callable[[Tensor], list[Tensor]] | None = None,
    telemetry: Tensor | None = None,
    pull: Callable[[Tensor], None] | None = None,
) -> None:
    """The step's maths, composed once: update G (and with ``refresh`` its scheduled part, used
    already by this step as in the paper's code), then θ ← θ − ℓG⁻¹ĝ + σG^{-½}ξ (paper eq. 4, Γ
    dropped). ``pull`` adds the localisation's gradient after the statistics saw ĝ alone.
    """
    metric, stats, layout, grad, xi, params, step, lr, sigma, adapt = move
    if adapt:
        metric.update(stats, layout, grad, step)
        if refresh:
            try:
                metric.refresh(stats, layout)
            except FloatingPointError as exc:  # a failed refresh (Shampoo's roots): at which step
                raise type(exc)(f"step {int(step)}: {exc}") from None
    if pull is not None:
        pull(grad)
    shape = layout.views if views is None else views  # eager steps reuse the buffers' views
    drift = shape(metric.inverse(stats, layout, grad))
    noise = None if xi is None else shape(metric.inverse_sqrt(stats, layout, xi))
    if telemetry is not None:
        record_telemetry(telemetry, params, drift, noise, lr, sigma)
    euler_maruyama(params, drift, noise, lr, sigma)


def telemetry_figures(sums: Sequence[float], extra: dict[str, float]) -> dict[str, float]:
    """One chain's figures from its :func:`record_telemetry` sums and the metric's own (``extra``):
    steps, the RMS over steps of ‖drift‖, ‖noise‖ and ‖θ‖, and drift_to_noise (inf without noise).
    """
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
    """Add ‖ℓG⁻¹ĝ‖², ‖σG^{-½}ξ‖², ‖θ‖² (before the move) and 1 to ``acc`` (float64 ``(*batch, 4)``),
    with no host read.
    """
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


@dataclass(frozen=True)
class Plan:
    """How a sampler's steps run, decided from its configuration at its state's first step and kept
    on the state.
    """

    config: tuple[object, ...]  # what it was decided from (a traced facade step changes it)
    checks: CheckMode
    noise: NoiseSource
    by_gradient: bool  # G = I eagerly, checks not deferred: θ moves by ĝ itself (_by_gradient)
    fused: Callable[..., bool] | None  # the compiled body; None eagerly or localised
    inline: bool  # Philox ξ drawn inside the compiled call: one fused pass over D
    localization: float

    def __deepcopy__(self, memo: dict[int, object]) -> Plan:
        return self  # immutable; a copied state shares it (and its compiled body)

    @staticmethod
    def of(state: SamplerState, metric: Metric, *options: Any) -> Plan:
        """``options``: ``advance``'s checks, noise_source, compiled, direct, localization."""
        config = (metric.preconditions, *options)
        if isinstance(state.plan, Plan) and state.plan.config == config:
            return state.plan
        checks, noise, compiled, direct, localization = options
        eager = compiled is None and not localization
        fused = None if localization else compiled  # the pull is added eagerly
        # deferred checks mask ξ; sharded ξ is drawn at global indices (sgrld.core.shards)
        inline = noise == "philox" and checks != "deferred" and state.layout.shards is None
        by_gradient = direct and eager and not metric.preconditions and checks != "deferred"
        state.plan = Plan(
            config, checks, noise, by_gradient, fused, fused is not None and inline, localization
        )
        return state.plan


@dataclass
class Part:
    """What moves this step: all of a group's tensors, or those with a gradient (``active``, with
    restricted copies of the statistics written back by :func:`_merge`), and ℓ, σ, whether ξ is
    drawn."""

    layout: FlatLayout
    stats: Stats
    params: list[Tensor]
    grads: list[Tensor]
    work: Workspace
    active: tuple[int, ...] | None
    lr: Scalar = 0.0
    sigma: Scalar = 0.0
    draws: bool = False
    #: the step the statistics were last restarted after (a device count's: on the device)
    origin: int | Tensor = 0

    @staticmethod
    def of(metric: Metric, state: SamplerState, grads: Sequence[Tensor | None]) -> Part:
        params = list(state.params.values())
        present = [g for g in grads if g is not None]
        if len(present) == len(params):
            if state.workspace is None:
                state.workspace = Workspace.for_layout(state.layout, params[0])
            return Part(state.layout, state.stats, params, present, state.workspace, None)
        active = tuple(i for i, g in enumerate(grads) if g is not None)
        whole = state.layout
        layout = FlatLayout(
            tuple(whole.names[i] for i in active),
            tuple(whole.shapes[i] for i in active),
            whole.batch_shape,
            None if whole.shards is None else whole.shards.restrict(list(active)),
        )
        stats = _restrict(metric.stat_kinds(whole), state.stats, whole, active)
        work = Workspace.for_layout(layout, params[0])
        return Part(layout, stats, [params[i] for i in active], present, work, active)


def advance(
    metric: Metric,
    state: SamplerState,
    grads: Sequence[Tensor | None],
    *,
    lr: Scalar,
    num_data: float,
    temperature: float,
    checks: CheckMode = "sync",
    adapt: bool | Tensor = True,
    noise_source: NoiseSource = "torch",
    compiled: Callable[..., bool] | None = None,
    refresh: bool = True,
    direct: bool = True,
    telemetry: Tensor | None = None,
    closes_warmup: bool = False,
    localization: float = 0.0,
    restarts: tuple[int, ...] = (),
) -> None:
    """One SGRLD step of ``state`` in place; parameters whose gradient is ``None`` are skipped.

    ``lr``: a float or a 0-d or ``(K,)`` tensor; ``checks``: the check mode; ``adapt=False``: a
    frozen G, or per chain a bool tensor of the batch shape (a frozen chain's statistics are kept
    as they were, selected on the device); ``adapt=True`` on a state whose waiting warm-up froze
    some of its chains already adapts the others only (``Arrival.chains_adapting``);
    ``compiled``: a :class:`~sgrld.core.compiled.CompiledMove`; ``refresh=False`` leaves a due
    refresh to the caller (captured steps); ``direct=False`` sends SGLD through the flat
    buffers (the same numbers; tests compare); ``telemetry``: a :func:`record_telemetry`
    accumulator; ``localization`` c > 0 adds c·(θ − ``state.center``) to the drift's gradient only;
    ``restarts``: the steps after which the metric's statistics restart
    (:func:`sgrld.core.warmup.restart_steps`), decided from the step's count, a traced or
    captured step's on the device (:func:`sgrld.core.warmup.since_restart`).
    """
    if all(g is None for g in grads):
        return
    validate_grads(state.params, grads)
    if localization and state.center is None:
        raise ValueError(
            "localization needs a state with a centre (init by a sampler with localization > 0)"
        )
    plan = Plan.of(state, metric, checks, noise_source, compiled, direct, localization)
    if adapt is True and state.warmup is not None:  # the chains that arrived stay frozen
        still = state.warmup.chains_adapting(state.step)
        adapt = True if still is None else still
    origin: int | Tensor = 0
    if restarts and adapt is not False:  # before a subset's statistics are copied (Part.of)
        # a traced or captured step decides on the device's count (its host count would be
        # baked into the graph); any other on the host's, the same count (no device pass)
        count = state.device_step + 1 if in_graph() else state.step + 1
        origin, now = since_restart(restarts, count)
        restart(metric, state.stats, state.layout, now, None if adapt is True else adapt)
    part = Part.of(metric, state, grads)
    part.lr, part.sigma = lr, noise_scale(lr, num_data, temperature)
    part.origin = origin
    # σ > 0 exactly then (n > 0 is validated); a float ℓ = 0 (a warm-up's start) draws nothing
    part.draws = temperature > 0.0 and not (isinstance(lr, (int, float)) and lr == 0.0)
    if plan.by_gradient and all(g.is_contiguous() for g in part.grads):
        _by_gradient(plan, state, part, telemetry)
    else:
        # the warm-up's last step refreshes as a scheduled one would (warmup.closes_warmup)
        adapts = adapt if isinstance(adapt, bool) else True  # some chain: a mask comes with one
        due = refresh and adapts and (refresh_due(metric, state.step + 1) or closes_warmup)
        if torch.compiler.is_compiling():  # a traced step reads nothing on the host anyway
            _through_flat(plan, metric, state, part, adapt, due, telemetry)
        else:
            token = host_reads.set(plan.checks == "sync")
            try:
                _through_flat(plan, metric, state, part, adapt, due, telemetry)
            finally:
                host_reads.reset(token)
    state.step += 1
    state.device_step.add_(1)
    if part.active is not None:  # a subset's statistics back into the group's
        _merge(metric.stat_kinds(state.layout), state.stats, part.stats, state.layout, part.active)


def _draw(state: SamplerState, part: Part, plan: Plan) -> Tensor:
    """This step's ξ, in the workspace's noise buffer."""
    return part.work.noise.draw(state.generator, plan.noise, state.keys, state.device_step)


def _by_gradient(plan: Plan, state: SamplerState, part: Part, telemetry: Tensor | None) -> None:
    """G = I: θ ← θ − ℓĝ + σξ by the gradients themselves (no statistics, no flat copy)."""
    if plan.checks == "sync":
        check_finite_now(part.layout, part.grads)
    noise = part.work.views(_draw(state, part, plan)) if part.draws else None
    if telemetry is not None:
        record_telemetry(telemetry, part.params, part.grads, noise, part.lr, part.sigma)
    like = part.grads[0]
    lr, sigma = _per_chain(part.lr, part.layout, like), _per_chain(part.sigma, part.layout, like)
    euler_maruyama(part.params, part.grads, noise, lr, sigma)


def _through_flat(
    plan: Plan,
    metric: Metric,
    state: SamplerState,
    part: Part,
    adapt: bool | Tensor,
    due: bool,
    telemetry: Tensor | None,
) -> None:
    """Every other step: ĝ gathered, checked, and :func:`body` (or compiled) on it."""
    layout, stats = part.layout, part.stats
    # per chain: every chain's statistics updated, the frozen ones' then put back (keep_where)
    chosen, adapt = (None, adapt) if isinstance(adapt, bool) else (adapt, True)
    grad = part.work.gather(part.grads)
    ok: Tensor | None = None  # deferred checks: per chain, whether it may move
    if plan.checks == "sync" and layout.shards is None:  # sharded: with the sums, below
        _refuse_nonfinite(grad.sum(), layout.names, lambda: layout.segments(grad))
    elif plan.checks == "deferred":
        ok = _record_bad(state, layout, grad, part.active)
        grad.masked_fill_(~ok, 0.0)  # a bad chain's move is then exactly zero
    # a grad subset, a refresh step (eigh on the host) and telemetry run eagerly
    fused = plan.fused if part.active is None and not due and telemetry is None else None
    inline = fused is not None and plan.inline and part.draws
    # ξ first: the generator drives nothing else, so the order does not change the chain.
    xi = _draw(state, part, plan) if part.draws and not inline else None
    if layout.shards is not None and ok is None:
        # localised: G⁻¹ acts on ĝ + c(θ − θ₀), which the sums ahead (taken from ĝ) do not
        # see, so the metric then sums over the ranks itself, one all-reduce per sum
        summing = None if plan.localization else metric
        _sum_ahead(summing, stats, layout, grad, xi, adapt, plan.checks == "sync")
    if ok is not None and xi is not None:
        xi.masked_fill_(~ok, 0.0)
    keep = chosen if ok is None else ok.squeeze(-1) if chosen is None else ok.squeeze(-1) & chosen
    saved = {k: v.clone() for k, v in stats.items()} if adapt and keep is not None else None
    # deferred: the count read on the device (a captured step reads no host value)
    count = state.device_step + 1 if plan.checks == "deferred" else state.step + 1
    if not isinstance(part.origin, int) or part.origin:  # counted from the statistics' restart
        count = count - part.origin
    pull = None
    if plan.localization:
        assert state.center is not None
        centers = state.center if part.active is None else [state.center[i] for i in part.active]
        pull = localization_pull(plan.localization, part.params, centers, part.work.views, ok)
    rates = _per_chain(part.lr, layout, grad), _per_chain(part.sigma, layout, grad)
    move = Move(metric, stats, layout, grad, xi, part.params, count, *rates, adapt)
    keys = (state.keys, state.device_step) if inline else ()
    if fused is None or not fused(move, *keys):
        if inline:  # not compiled after all: the same ξ, drawn eagerly
            move = move._replace(xi=_draw(state, part, plan))
        body(move, due, part.work.views, telemetry, pull)
    if layout.shards is not None:
        layout.shards.ahead.clear()
    if saved is not None and keep is not None:  # a bad or frozen chain's statistics as they were
        keep_where(stats, saved, keep)


def localization_pull(
    strength: float,
    params: list[Tensor],
    centers: list[Tensor],
    views: Callable[[Tensor], list[Tensor]],
    ok: Tensor | None,
) -> Callable[[Tensor], None]:
    """c·(θ − θ₀), added to the flat gradient between the metric's update and G⁻¹, so G is built
    from ĝ alone (Hitchcock & Hoogland 2025, App. D.3); a chain the deferred check stopped stays
    put."""

    def pull(grad: Tensor) -> None:
        torch._foreach_add_(views(grad), torch._foreach_sub(params, centers), alpha=strength)
        if ok is not None:
            grad.masked_fill_(~ok, 0.0)

    return pull


def in_graph() -> bool:
    """Whether this step is traced by ``torch.compile`` or captured in a CUDA graph."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def refresh_due(metric: Metric, step: int) -> bool:
    """Whether the metric's scheduled refresh (Shampoo's roots) is due after step ``step``."""
    interval = metric.refresh_interval
    return interval is not None and step % interval == 0


def _renamed(key: str, kind: StatKind, active: Sequence[int]) -> str | None:
    """A statistic's key among ``active``'s (a PerTensor one renumbered; ``None``: not there)."""
    if not isinstance(kind, PerTensor):
        return key
    return PerTensor(kind.stat, active.index(kind.tensor)).key if kind.tensor in active else None


def _restrict(
    kinds: dict[str, StatKind], stats: Stats, layout: FlatLayout, active: Sequence[int]
) -> Stats:
    """Statistics of the tensors in ``active`` only (copies, written back by :func:`_merge`)."""
    sub: Stats = {}
    for key, value in stats.items():
        name, kind = _renamed(key, kinds[key], active), kinds[key]
        if kind == "element":
            segs = layout.segments(value)
            value = torch.cat([segs[i] for i in active], dim=-1)
        elif kind == "tensor":
            value = value.index_select(-1, torch.tensor(active, device=value.device))
        if name is not None:
            sub[name] = value
    return sub


def _merge(
    kinds: dict[str, StatKind], stats: Stats, sub: Stats, layout: FlatLayout, active: Sequence[int]
) -> None:
    for key, value in stats.items():
        name, kind = _renamed(key, kinds[key], active), kinds[key]
        if kind == "element":
            parts = sub[key].split([layout.numels[i] for i in active], -1)
            segs = layout.segments(value)
            for seg, src in zip((segs[i] for i in active), parts, strict=True):
                seg.copy_(src)
        elif kind == "tensor":
            value.index_copy_(-1, torch.tensor(active, device=value.device), sub[key])
        elif name is not None:
            stats[key] = sub[name]
