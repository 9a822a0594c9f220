"""The experiments' names of samplers, priors, models, datasets and noise sources, read from the
registries (a metric or prior registered there is a choice without an edit here)."""

from __future__ import annotations

from collections.abc import (
    Callable,
    ItemsView,
    Iterable,
    Iterator,
    KeysView,
    Mapping,
    Sequence,
    ValuesView,
)
from typing import TypeVar, overload

from sgrld.core.noise import NOISE_SOURCES
from sgrld.data import DATASET_NAMES
from sgrld.metrics import metric_names
from sgrld.models.build import MODEL_NAMES
from sgrld.priors import prior_names

#: Registry name → the experiments' name, where the paper calls a prior otherwise.
_PRIOR_ALIASES = {"convcorrnormal": "correlated"}


class Names(Sequence[str]):
    """Names read from a registry each time they are used, so that a plug-in registered after
    import is among them (written as a tuple)."""

    def __init__(self, read: Callable[[], Iterable[str]]) -> None:
        self._read = read

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[str, ...]: ...
    def __getitem__(self, index: int | slice) -> str | tuple[str, ...]:
        return tuple(self._read())[index]

    def __len__(self) -> int:
        return len(tuple(self._read()))

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._read()))

    def __repr__(self) -> str:
        return repr(tuple(self._read()))


_V = TypeVar("_V")


class Table(Mapping[str, _V]):
    """A table read each time it is used (as :class:`Names`), so that what a plug-in
    registered after import declares is in it (written as a dict)."""

    def __init__(self, read: Callable[[], Mapping[str, _V]]) -> None:
        self._read = read

    def __getitem__(self, key: str) -> _V:
        return self._read()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(dict(self._read()))

    def __len__(self) -> int:
        return len(self._read())

    def __repr__(self) -> str:
        return repr(dict(self._read()))

    # one read for the whole view (the mixins would read once per key)
    def keys(self) -> KeysView[str]:
        return self._read().keys()

    def values(self) -> ValuesView[_V]:
        return self._read().values()

    def items(self) -> ItemsView[str, _V]:
        return self._read().items()


#: Sampler names (the metric registry).
SAMPLERS: Sequence[str] = Names(metric_names)
#: Experiment prior name → :mod:`sgrld.priors` registry name.
PRIORS: dict[str, str] = {_PRIOR_ALIASES.get(name, name): name for name in prior_names()}
MODELS: tuple[str, ...] = tuple(MODEL_NAMES)
DATASETS: tuple[str, ...] = tuple(DATASET_NAMES)
NOISE: tuple[str, ...] = tuple(NOISE_SOURCES)
#: The architecture each dataset is run with (the paper's; diabetes: the same fc net).
MODEL_FOR_DATASET = {"mnist": "fc", "cifar10": "resnet20", "diabetes": "fc"}
