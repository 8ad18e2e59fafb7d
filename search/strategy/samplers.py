"""The samplers a study may use by name, and the Optuna parameter name each searched knob is drawn
under.

``guided`` (the default, ``search.strategy.guided``) wraps multivariate TPE; the others are Optuna's
own. An Optuna study keeps the distribution each parameter name was first drawn from, so a knob
whose range changed incompatibly is drawn under a numbered name (``optuna_names``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
    check_distribution_compatibility,
)
from optuna.trial import Trial

from search.config.settings import SAMPLER_NAMES
from search.space.params import CategoricalParam, FixedParam, FloatParam, IntParam, Param
from search.space.search_space import SearchSpace
from search.strategy.guided import distribution

__all__ = ["GUIDED", "RENAMED", "SAMPLERS", "optuna_names", "suggest"]

SAMPLERS: dict[str, Callable[[int], optuna.samplers.BaseSampler]] = {
    # Multivariate: independent TPE cannot learn joint rules such as micro <= batch
    # (docs/method/sampler.md).
    "tpe": lambda seed: optuna.samplers.TPESampler(seed=seed, multivariate=True),
    "gp": lambda seed: optuna.samplers.GPSampler(seed=seed),
    "nsga2": lambda seed: optuna.samplers.NSGAIISampler(seed=seed),
    "random": lambda seed: optuna.samplers.RandomSampler(seed=seed),
}
"""The plain Optuna samplers by name; ``guided`` (the default, ``search.strategy.guided``) wraps
``tpe``."""
GUIDED = "guided"
assert set(SAMPLER_NAMES) == {GUIDED, *SAMPLERS}, "settings.SAMPLER_NAMES lists every sampler"


def suggest(trial: Trial, name: str, param: Param) -> Any:
    """A value of ``param`` for ``trial``, under the Optuna parameter ``name`` (see
    ``optuna_names``)."""
    if isinstance(param, IntParam) and param.pow2:
        return trial.suggest_categorical(name, param.values())  # only powers of two, in order
    if isinstance(param, IntParam):
        return trial.suggest_int(name, param.low, param.high, step=param.step, log=param.log)
    if isinstance(param, FloatParam):
        return trial.suggest_float(name, param.low, param.high, log=param.log, step=param.step)
    if isinstance(param, CategoricalParam):
        return trial.suggest_categorical(name, list(param.choices))
    assert isinstance(param, FixedParam)
    return param.value


RENAMED = "~"
"""Separates a knob's name from the number of the distribution it is drawn from in Optuna
(``batch_size~2``)."""


def optuna_names(study: optuna.Study, space: SearchSpace) -> tuple[dict[str, str], list[str]]:
    """The Optuna parameter name of each searched knob, and a note for each knob whose range
    changed in a way Optuna cannot extend (other choices, a log scale, another kind).

    An Optuna study keeps, per parameter name, the distribution it was first drawn from, and
    refuses a later one that is not compatible with it (a categorical with other choices, say: a
    narrowed power-of-two range). Such a knob is drawn under a numbered name instead
    (``batch_size~2``), the first whose stored distribution is compatible, or a new one. Earlier
    measurements stay (they are kept by configuration, not by Optuna name) and are reused; only the
    sampler learns that knob afresh. A compatible change (an int or float range, widened or
    narrowed, but not a power-of-two one: that is drawn as a categorical of its values) keeps its
    name.
    """
    stored: dict[str, BaseDistribution] = {}
    for t in study.get_trials(deepcopy=False):
        for name, dist in t.distributions.items():
            stored.setdefault(name, dist)  # the first one, as Optuna's storage checks
    names, notes = {}, []
    for knob, param in space.searched.items():
        wanted, n = distribution(param), 1
        while True:
            name = knob if n == 1 else f"{knob}{RENAMED}{n}"
            if name not in stored or _compatible(stored[name], wanted):
                break
            n += 1
        names[knob] = name
        if n > 1 and name not in stored:
            notes.append(
                f"{knob}: its range changed since earlier trials ({_shown(stored[knob])} -> "
                f"{_shown(wanted)}): earlier measurements stay and are reused; the sampler learns "
                f"this knob afresh (Optuna parameter {name})"
            )
    return names, notes


def _compatible(old: BaseDistribution, new: BaseDistribution) -> bool:
    try:
        check_distribution_compatibility(old, new)
        return True
    except ValueError:
        return False


def _shown(dist: BaseDistribution) -> str:
    if isinstance(dist, CategoricalDistribution):
        return f"choices {list(dist.choices)}"
    assert isinstance(dist, (IntDistribution, FloatDistribution))
    return f"{dist.low}..{dist.high}{', log' if dist.log else ''}"
