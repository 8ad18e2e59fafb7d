"""The default sampler: the expert's order (``search.strategy.order``) as an Optuna sampler.

It proposes what ``search.strategy.order.next_move`` names from the study as it stands, so a resumed
study, several workers sharing one storage, a re-tune and optuna-dashboard see an ordinary Optuna
sampler. Float knobs, and every knob once the order has nothing left to propose, are drawn by a
model-based sampler (multivariate TPE). Each proposal's reason is kept on the trial as the user
attribute ``why``, which the trial's line shows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial, TrialState

from search.analysis.memory_model import GRADIENTS
from search.core.records import COMPLETE, FAILED, INFEASIBLE, fault_kind
from search.space.params import CategoricalParam, FloatParam, IntParam, Param
from search.space.search_space import SearchSpace
from search.storage.optuna_private import study_storage, trial_id
from search.strategy.book import FIDELITY, OOM, Seen
from search.strategy.order import Move, next_move

__all__ = ["HANDED_OVER", "WHY", "GuidedSampler", "distribution", "seen_of"]

WHY = "why"
"""Trial user attr: why the sampler proposed this configuration (a few words)."""
HANDED_OVER = "model-based (TPE): the expert's order has nothing left to propose"


def distribution(param: Param) -> BaseDistribution:
    """The Optuna distribution ``suggest`` draws ``param`` from."""
    if isinstance(param, IntParam) and param.pow2:
        return CategoricalDistribution(param.values())
    if isinstance(param, IntParam):
        return IntDistribution(param.low, param.high, log=param.log, step=param.step)
    if isinstance(param, FloatParam):
        return FloatDistribution(param.low, param.high, log=param.log, step=param.step)
    assert isinstance(param, CategoricalParam)
    return CategoricalDistribution(list(param.choices))


class GuidedSampler(BaseSampler):
    """Proposes the expert's next move; ``fallback`` draws floats and what the order leaves.

    ``names``: each searched knob's Optuna parameter name
    (``search.strategy.samplers.optuna_names``); ``seen()``: what the study knows of each
    configuration, read afresh before every proposal.
    """

    def __init__(
        self,
        space: SearchSpace,
        names: Mapping[str, str],
        seen: Callable[[], Sequence[Seen]],
        fallback: BaseSampler,
        slo: Mapping[str, float] | None = None,
    ):
        self.space, self.names, self.seen, self.fallback = space, dict(names), seen, fallback
        self.slo = dict(slo or {})
        self.discrete = [k for k, p in space.searched.items() if not isinstance(p, FloatParam)]
        self._moves: dict[int, Move | None] = {}
        """Each trial's move, from ``infer_relative_search_space`` to ``sample_relative``."""

    def infer_relative_search_space(
        self, study: optuna.Study, trial: FrozenTrial
    ) -> dict[str, BaseDistribution]:
        if "fixed_params" in trial.system_attrs:  # a queued trial: its values are set already
            self._moves[trial.number] = None
            return {}
        move = next_move(self.space, self.seen(), self._busy(study, trial), self.slo)
        self._moves[trial.number] = move
        if move is None:
            return self.fallback.infer_relative_search_space(study, trial)
        return {self.names[k]: distribution(self.space.searched[k]) for k in self.discrete}

    def sample_relative(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        search_space: dict[str, BaseDistribution],
    ) -> dict[str, Any]:
        if "fixed_params" in trial.system_attrs:
            return {}
        move = self._moves.pop(trial.number, None)
        why = move.why if move is not None else HANDED_OVER
        study_storage(study).set_trial_user_attr(trial_id(trial), WHY, why)
        if move is None:
            return self.fallback.sample_relative(study, trial, search_space)
        return {self.names[k]: move.config[k] for k in self.discrete}

    def sample_independent(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        param_name: str,
        param_distribution: BaseDistribution,
    ) -> Any:
        return self.fallback.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self.fallback.before_trial(study, trial)

    def after_trial(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        state: TrialState,
        values: Sequence[float] | None,
    ) -> None:
        self.fallback.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self.fallback.reseed_rng()

    def _busy(self, study: optuna.Study, trial: FrozenTrial) -> list[dict[str, Any]]:
        """The configurations other running trials (other processes) are measuring."""
        knobs = {name: knob for knob, name in self.names.items()}
        busy = []
        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            config = {knobs[n]: v for n, v in t.params.items() if n in knobs}
            if t.number != trial.number and set(self.discrete) <= set(config):
                busy.append({**config, **self.space.fixed})
        return busy


def seen_of(
    trials: Sequence[FrozenTrial],
    ran_out: Sequence[FrozenTrial],
    space: SearchSpace,
    predicted_out: Sequence[Mapping[str, Any]] = (),
    seconds: Mapping[int, Mapping[str, Any]] | None = None,
) -> list[Seen]:
    """What the strategy reads of the study: every measured trial (``guards.KnownOutcomes``:
    ``trials`` complete or infeasible, and this invocation's failures), those that ran out of
    memory under this invocation's limit (``ran_out``), and the configurations the memory model
    predicted to run out (``predicted_out``), read as out of memory too. ``seconds``: second
    processes kept apart from their trials, by trial number (measured at the end of an
    invocation, after the trial was told)."""
    # the interval too: the book tells a tie from a win (``Book.best``)
    metrics = {"throughput", "throughput_ci_low", "throughput_ci_high"}
    metrics |= {o.metric for o in space.objectives} | {GRADIENTS}  # the memory model's too
    seen = []
    for t in trials:
        attrs = t.user_attrs
        state, failure = attrs.get("state"), str(attrs.get("failure", ""))
        if state == COMPLETE:
            second = attrs.get("second_process") or (seconds or {}).get(t.number)
            seen.append(Seen(attrs["config"], COMPLETE, _figures(attrs, metrics, second)))
        elif state == FAILED and fault_kind(failure) == "oom":
            seen.append(Seen(attrs["config"], OOM, {}))
        elif state == INFEASIBLE and failure.startswith("fidelity:"):
            seen.append(Seen(attrs["config"], FIDELITY, {}))
        else:
            seen.append(Seen(attrs["config"], FAILED, {}))
    oom = [t.user_attrs["config"] for t in ran_out] + list(predicted_out)
    return seen + [Seen(config, OOM, {}) for config in oom]


def _figures(
    attrs: Mapping[str, Any], metrics: set[str], second: Mapping[str, Any] | None
) -> dict[str, float]:
    """A complete trial's figures of ``metrics`` as its line shows them and the study is told:
    where a second fresh process measured it too (a compiled trial), its throughput is the mean of
    the two (``search.stability.judge``). Read from the first process alone, the order once went on
    from a kernel whose line read 11.5k tokens/s over one at 11.7k, on its first run's 11.9k
    against 11.4k."""
    figures = {k: float(v) for k, v in attrs.get("metrics", {}).items() if k in metrics}
    second = second or {}
    again = second.get("metrics", {}).get("throughput")
    if second.get("state") == COMPLETE and again is not None and "throughput" in figures:
        figures["throughput"] = (figures["throughput"] + float(again)) / 2
    return figures
