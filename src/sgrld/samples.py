"""Keep posterior samples of a model, predict with them, and the model's log-density.

:class:`SampleStore` keeps a thinned, capped subset of a chain's states (in memory or on disk);
:func:`posterior_predictive` and :func:`log_predictive_density` average the samples'
predictives; :func:`log_density` is the minibatch ``log p(θ | D)`` (``docs/usage.md``).
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["SampleStore", "log_density", "log_predictive_density", "posterior_predictive"]


class SampleStore:
    """Thinned posterior samples of a model's state, in memory or on disk, with a cap.

    Call :meth:`observe` after every sampler step: the state after step ``k`` (1-based) is kept
    when ``k > burnin`` and ``k % thinning == 0``. When ``max_samples`` are kept and another is
    due, every second one is dropped and ``thinning`` doubles, so the store spans the whole
    chain after burn-in evenly.

    Args:
        burnin: steps before the first sample can be kept, ≥ 0.
        thinning: keep every ``thinning``-th step, ≥ 1.
        max_samples: most samples kept at once, ≥ 2.
        directory: write each sample's state dict to a file there (CPU) instead of keeping it
            in memory; files of dropped samples are deleted.

    :attr:`adapting` records whether each sample was drawn while the metric still adapted
    (``docs/posterior.md``); the first such is said in a ``RuntimeWarning``.

    Raises:
        ValueError: invalid arguments.
    """

    def __init__(
        self,
        *,
        burnin: int = 0,
        thinning: int = 1,
        max_samples: int = 100,
        directory: str | os.PathLike[str] | None = None,
    ) -> None:
        for name, value, low in (
            ("burnin", burnin, 0),
            ("thinning", thinning, 1),
            ("max_samples", max_samples, 2),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        self.burnin = burnin
        self.thinning = thinning
        self.max_samples = max_samples
        self.directory = None if directory is None else Path(directory)
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        self.step = 0
        self.steps: list[int] = []  # the step of each kept sample
        #: per kept sample: drawn while the metric adapted (``None``: no sgrld optimizer)
        self.adapting: list[bool | None] = []
        self._warned = False
        self._memory: list[dict[str, Tensor]] = []

    def __len__(self) -> int:
        return len(self.steps)

    def observe(self, model: nn.Module) -> bool:
        """Count one sampler step; keep ``model``'s state if it is a sample. Returns whether."""
        self.step += 1
        if self.step <= self.burnin or self.step % self.thinning:
            return False
        if len(self) == self.max_samples:
            self._halve()
            if self.step % self.thinning:  # not a sample at the new thinning
                return False
        self.add(model.state_dict(), step=self.step)
        self.adapting[-1] = self._drawn_adapting(model)
        return True

    def _drawn_adapting(self, model: nn.Module) -> bool | None:
        """Whether this sample was drawn while the metric adapted; the first such is said."""
        from sgrld.optim import drawn_adapting

        found = drawn_adapting(model.parameters())
        if found is None:
            return None
        adapted, steps, until = found
        if adapted and not self._warned:
            self._warned = True
            fix = (
                "adapt_until=None adapts at every step (the paper's protocol); give the optimizer "
                "adapt_until=N (e.g. 1000) and a burnin of at least N"
                if until is None
                else f"use burnin >= {until} (the optimizer's adapt_until), or build the "
                f"optimizer with adapt_until <= {self.burnin}"
            )
            warnings.warn(
                f"SampleStore: the sample after step {steps} was drawn while the metric is still "
                f"adapting (adapt_until={until}), so G is not frozen yet and the samples follow a "
                f"biased law (docs/posterior.md); {fix}",
                RuntimeWarning,
                stacklevel=3,
            )
        return adapted

    def add(self, state: dict[str, Tensor], *, step: int | None = None) -> None:
        """Keep ``state`` (a state dict; copied to CPU) as the next sample, off the schedule.

        Raises:
            ValueError: the store is full (``add`` makes no room).
        """
        if len(self) >= self.max_samples:
            raise ValueError(f"the store holds max_samples={self.max_samples} samples already")
        step = self.step if step is None else step
        copy = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
        if self.directory is None:
            self._memory.append(copy)
        else:
            torch.save(copy, self._path(step, len(self)))
        self.steps.append(step)
        self.adapting.append(None)

    def _path(self, step: int, index: int) -> Path:
        assert self.directory is not None
        return self.directory / f"sample-{step:09d}-{index:04d}.pt"

    def _halve(self) -> None:
        """Double the thinning and drop the samples it no longer takes (every second one)."""
        keep = [i for i, step in enumerate(self.steps) if step % (2 * self.thinning) == 0]
        if len(keep) == len(self):  # samples given to add() off the schedule
            keep = keep[1::2]
        if self.directory is None:
            self._memory = [self._memory[i] for i in keep]
        else:
            paths = [self._path(s, i) for i, s in enumerate(self.steps)]
            for i, path in enumerate(paths):
                if i not in keep:
                    path.unlink()
            for new, old in enumerate(keep):
                paths[old].rename(self._path(self.steps[old], new))
        self.steps = [self.steps[i] for i in keep]
        self.adapting = [self.adapting[i] for i in keep]
        self.thinning *= 2

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        """The ``index``-th kept sample's state dict (loaded from disk if stored there)."""
        if self.directory is None:
            return self._memory[index]
        index = range(len(self))[index]
        state: dict[str, Tensor] = torch.load(
            self._path(self.steps[index], index), map_location="cpu", weights_only=True
        )
        return state

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        return (self[i] for i in range(len(self)))


@torch.no_grad()
def posterior_predictive(
    model: nn.Module, samples: SampleStore, inputs: Tensor, *, batch_size: int = 1000
) -> Tensor:
    """Averaged class probabilities ``(1/S) Σ_s softmax(f(x; θ_s))`` of the stored samples.

    Each sample is loaded into ``model`` in eval mode; the model's own state and mode are
    restored afterwards. The average is a float64 log-sum-exp.

    Args:
        model: the network the samples were taken from.
        samples: the kept samples (at least one).
        inputs: ``(N, ...)`` inputs on ``model``'s device.
        batch_size: inputs per forward pass.

    Returns:
        ``(N, C)`` float64 probabilities.

    Raises:
        ValueError: ``samples`` is empty.
    """
    return torch.exp(_log_predictive(model, samples, inputs, batch_size))


@torch.no_grad()
def log_predictive_density(
    model: nn.Module,
    samples: SampleStore,
    inputs: Tensor,
    targets: Tensor,
    *,
    batch_size: int = 1000,
    next_token: bool = False,
    ignore_index: int = -100,
) -> float:
    """The ensemble's log predictive density ``mean_i log((1/S) Σ_s p(y_i | x_i, θ_s))``.

    The "LP" of the paper's tables, as a float64 log-sum-exp over the samples; for a token model
    the mean is over every predicted token (per token, as a language model's log-likelihood).

    Args:
        model: the network the samples were taken from; its output is the logits (or has them
            as ``.logits``, a Hugging Face ``ModelOutput``), class last.
        samples: the kept samples (at least one).
        inputs: ``(N, ...)`` inputs on ``model``'s device.
        targets: ``(N,)`` int64 class labels, or one per position of the logits (``(N, T)``
            tokens for ``(N, T, V)`` logits).
        batch_size: inputs per forward pass.
        next_token: a causal language model: position t's logits predict token t+1, so the
            targets are the input tokens themselves (Hugging Face's ``labels``), shifted here.
        ignore_index: targets equal to it (padding) are left out of the mean.

    Returns:
        The mean log predictive density (≤ 0; higher is better).

    Raises:
        ValueError: ``samples`` is empty, or ``targets`` does not match ``inputs``.

    Examples:
        >>> import torch, sgrld
        >>> from torch import nn
        >>> model = nn.Linear(3, 2)
        >>> store = sgrld.SampleStore()
        >>> store.add(model.state_dict())
        >>> x, y = torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1])
        >>> sgrld.log_predictive_density(model, store, x, y) <= 0.0
        True
    """
    if len(targets) != len(inputs) or (targets.dim() == 1 and next_token):
        raise ValueError(f"targets must have shape ({len(inputs)}, ...), got "
                         f"{tuple(targets.shape)}")  # fmt: skip
    if next_token:
        targets = targets[:, 1:]

    def target_logp(x: Tensor, at: slice) -> Tensor:
        logits = _logits(model(x))
        logits = logits[:, :-1] if next_token else logits
        y = targets[at].to(logits.device)
        if logits.shape[:-1] != y.shape:
            raise ValueError(f"targets must have shape {tuple(logits.shape[:-1])} per batch "
                             f"(one per position of the logits), got {tuple(y.shape)}")  # fmt: skip
        logp = F.log_softmax(logits.to(torch.float64), dim=-1)
        return logp.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)

    lp = _log_predictive(model, samples, inputs, batch_size, target_logp)
    keep = targets.to(lp.device) != ignore_index
    return float(lp[keep].mean())


def _logits(out: Tensor | Mapping[str, Tensor]) -> Tensor:
    """A model's logits: its output, or the output's ``logits`` (a ``ModelOutput``)."""
    return out["logits"] if isinstance(out, Mapping) else out


def _log_predictive(
    model: nn.Module,
    samples: SampleStore,
    inputs: Tensor,
    batch_size: int,
    log_prob: Callable[[Tensor, slice], Tensor] | None = None,
) -> Tensor:
    """``log((1/S) Σ_s p_s)`` in float64: ``p_s`` the class probabilities ``softmax(f(x; θ_s))``
    ``(N, C)``, or ``exp(log_prob(x_batch, its slice))`` per batch."""
    if not len(samples):
        raise ValueError("no samples to predict with: the store is empty (still in burn-in?)")
    if log_prob is None:

        def log_prob(x: Tensor, at: slice) -> Tensor:
            return F.log_softmax(_logits(model(x)).to(torch.float64), dim=-1)

    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    training = model.training
    log_sum: Tensor | None = None
    try:
        model.eval()
        for state in samples:
            model.load_state_dict(state)
            logp = torch.cat(
                [
                    log_prob(inputs[i : i + batch_size], slice(i, i + batch_size))
                    for i in range(0, len(inputs), batch_size)
                ]
            )
            log_sum = logp if log_sum is None else torch.logaddexp(log_sum, logp)
    finally:
        model.load_state_dict(saved)
        model.train(training)
    assert log_sum is not None
    return log_sum - math.log(len(samples))


def log_density(model: nn.Module, inputs: Tensor, targets: Tensor, num_data: int) -> Tensor:
    """Minibatch estimate of ``log p(θ | D) + const = n · mean_B log p(y | x, θ) + log p(θ)``.

    Equal to ``−n · potential(model, x, y, n)`` (``docs/conventions.md``); differentiable in θ.

    Args:
        model: a :class:`~sgrld.models.BayesianModel` (anything with ``log_prior()``).
        inputs: a minibatch of inputs.
        targets: its targets: int64 class labels, or what the model's likelihood reads.
        num_data: n, the number of training points, ≥ 1.

    Returns:
        A 0-d tensor.
    """
    if num_data < 1:
        raise ValueError(f"num_data must be >= 1, got {num_data}")
    log_prior = getattr(model, "log_prior", None)
    if log_prior is None:
        raise TypeError(f"{type(model).__name__} has no log_prior(): use a BayesianModel")
    likelihood = getattr(model, "likelihood", None)
    eta = model(inputs)
    log_lik = (
        -F.cross_entropy(eta, targets) if likelihood is None else -likelihood.nll(eta, targets)
    )
    return num_data * log_lik + log_prior()
