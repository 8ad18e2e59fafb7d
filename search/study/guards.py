"""Guards: what settles a proposal without measuring it.

Each guard takes a proposal and returns a ruling (how to tell the trial, and why) or None to let
it through. The driver asks them in order and measures only what all of them let through:

- ``RepeatedRetry``: a retry of a stale trial that an earlier retry already covers (two processes
  can both recover the same trial on sqlite);
- ``Constraints``: a configuration that breaks a space constraint;
- ``CertainOom``: a configuration certain to run out of memory (the space's ``memory_grows_with``
  knobs at or above those of a configuration that ran out, the other knobs equal);
- ``Reuse``: a configuration already measured in this study under the same fingerprint: told the
  earlier outcome again. Complete and infeasible outcomes are reused, a failure only within the
  invocation that saw it (the next invocation tries it again: crashes and timeouts can be
  transient);
- ``InFlight``: a configuration another process is measuring right now.

``KnownOutcomes`` is what the guards know of the study: refreshed from the storage before every
proposal, so outcomes other processes stored are reused and learned from too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from search.analysis.memory_model import MemoryModel, gradients_of
from search.core.records import COMPLETE, FAILED, INFEASIBLE, fault_kind
from search.space.search_space import SearchSpace
from search.storage.liveness import duplicate_retry
from search.storage.trial_store import (
    OUTCOME_ATTRS,
    late_seconds,
    named_constraints,
    over_limit,
    own_trials,
)
from search.strategy.book import Seen, config_key
from search.strategy.guided import seen_of

__all__ = [
    "CertainOom",
    "Constraints",
    "Guard",
    "InFlight",
    "KnownOutcomes",
    "Proposal",
    "RepeatedRetry",
    "Reuse",
    "Ruling",
    "guards",
]


@dataclass(frozen=True)
class Proposal:
    """A configuration the sampler proposed, as a trial that has not been told yet."""

    number: int
    """The Optuna trial number."""
    config: Mapping[str, Any]
    """Every knob: the searched ones the sampler chose and the space's fixed ones."""
    params: Mapping[str, Any]
    """The searched knobs only, as Optuna stores them."""
    user_attrs: Mapping[str, Any]
    """The trial's own attributes so far (``retry_of`` for a queued retry)."""


@dataclass(frozen=True, kw_only=True)
class Ruling:
    """How to tell a proposal that is not measured."""

    counted_as: str | None
    """The ``StudyOutcome`` count it adds to (``rejected``, ``reused``, ...), None for none."""
    user_attrs: Mapping[str, Any]
    """Stored on the trial before it is told (``state``, ``failure``, ...)."""
    state: TrialState = TrialState.PRUNED
    values: Sequence[float] | None = None
    """With ``state`` COMPLETE: the values told (a reused measurement)."""
    resample: bool = False
    """Whether the sampler should be reseeded (it is in step with another process's)."""
    constraints: Mapping[str, float] = field(default_factory=dict)
    """With ``state`` COMPLETE: the Optuna constraints told (those of the reused measurement)."""


Guard = Callable[[Proposal], "Ruling | None"]


@dataclass(kw_only=True)
class KnownOutcomes:
    """Finished outcomes of this fingerprint to reuse, and out-of-memory trials to learn from."""

    space: SearchSpace
    fingerprint: str
    memory_limit_mb: float | None
    """This invocation's limit: only an OOM under a limit at least as tight teaches anything."""
    reusable: dict[str, FrozenTrial] = field(default_factory=dict)
    ran_out: list[FrozenTrial] = field(default_factory=list)
    predicted_out: list[Mapping[str, Any]] = field(default_factory=list)
    """Configurations not run in this invocation: predicted to run out (``PredictedOom``)."""
    device_memory_mb: float | None = None
    """The device's own memory, MB (``Bench.memory_mb``): what ``PredictedOom`` holds a
    prediction to where no ``memory_limit_mb`` is set."""
    seconds: dict[int, Mapping[str, Any]] = field(default_factory=dict)
    """Second processes measured at the end of earlier invocations, by trial number
    (``late_seconds``): the order reads a compiled trial on both its processes."""

    @classmethod
    def load(
        cls,
        study: optuna.Study,
        space: SearchSpace,
        fingerprint: str,
        memory_limit_mb: float | None,
        device_memory_mb: float | None = None,
    ) -> KnownOutcomes:
        """What the study holds at the start; of repeated outcomes the latest is reused."""
        known = cls(
            space=space,
            fingerprint=fingerprint,
            memory_limit_mb=memory_limit_mb,
            device_memory_mb=device_memory_mb,
        )
        known.seconds = late_seconds(study.user_attrs)
        for trial in own_trials(study, fingerprint, space):
            if known._reusable(trial):
                known.reusable[config_key(trial.user_attrs["config"])] = trial
            known._learn_oom(trial)
        return known

    def refresh(self, study: optuna.Study) -> None:
        """Take in outcomes stored since (by another process); what is known already stays."""
        self.seconds.update(late_seconds(study.user_attrs))
        for trial in own_trials(study, self.fingerprint, self.space):
            if self._reusable(trial):
                self.reusable.setdefault(config_key(trial.user_attrs["config"]), trial)
            self._learn_oom(trial)

    @staticmethod
    def _reusable(trial: FrozenTrial) -> bool:
        """Complete or infeasible (a complete one above this invocation's memory limit is told
        out of memory by ``Reuse``)."""
        return trial.user_attrs["state"] in (COMPLETE, INFEASIBLE)

    def learn(self, trial: FrozenTrial) -> None:
        """Take in a trial measured here; its failure too is not measured again in this
        invocation."""
        self.reusable[config_key(trial.user_attrs["config"])] = trial
        self._learn_oom(trial)

    def _learn_oom(self, trial: FrozenTrial) -> None:
        if self._ran_out_under_our_limit(trial) and all(
            t.number != trial.number for t in self.ran_out
        ):
            self.ran_out.append(trial)

    def _ran_out_under_our_limit(self, trial: FrozenTrial) -> bool:
        """An OOM trial whose limit was at least this invocation's (None: the whole device), or a
        complete one whose peak memory lies above this invocation's limit."""
        attrs = trial.user_attrs
        if over_limit(attrs, self.memory_limit_mb):
            return True  # it ran within a looser limit, above this one
        if attrs["state"] != FAILED or fault_kind(attrs.get("failure", "")) != "oom":
            return False
        theirs, ours = attrs.get("memory_limit_mb"), self.memory_limit_mb
        if ours is None:
            return theirs is None
        return theirs is None or ours <= theirs

    def seen(self) -> list[Seen]:
        """What the expert's order reads of the outcomes known (``seen_of``)."""
        trials = list(self.reusable.values())
        return seen_of(trials, self.ran_out, self.space, self.predicted_out, self.seconds)

    def memory_model(self) -> MemoryModel:
        """The memory model of the complete trials known (``search.analysis.memory_model``)."""
        complete = [t for t in self.reusable.values() if t.user_attrs["state"] == COMPLETE]
        return MemoryModel(
            (
                (t.number, t.user_attrs["config"], t.user_attrs["metrics"]["peak_memory_mb"])
                for t in complete
                if "peak_memory_mb" in t.user_attrs.get("metrics", {})
            ),
            gradients_of(t.user_attrs.get("metrics", {}) for t in complete),
        )

    def certain_oom(self, config: Mapping[str, Any]) -> FrozenTrial | None:
        return next(
            (t for t in self.ran_out if self.space.certain_oom(config, t.user_attrs["config"])),
            None,
        )

    def measured(self, config: Mapping[str, Any]) -> FrozenTrial | None:
        return self.reusable.get(config_key(config))


def _not_run(counted_as: str, config: Mapping[str, Any], why: str, **kwargs: Any) -> Ruling:
    attrs = {"config": dict(config), "state": INFEASIBLE, "failure": f"not run: {why}"}
    return Ruling(counted_as=counted_as, user_attrs=attrs, **kwargs)


@dataclass(frozen=True)
class RepeatedRetry:
    study: optuna.Study

    def __call__(self, proposal: Proposal) -> Ruling | None:
        earlier = duplicate_retry(self.study, proposal)
        if earlier is None:
            return None
        return Ruling(
            counted_as=None,
            user_attrs={
                "failure": f"not run: trial #{earlier} already retries the same stale trial"
            },
        )


@dataclass(frozen=True)
class Constraints:
    space: SearchSpace

    def __call__(self, proposal: Proposal) -> Ruling | None:
        broken = self.space.violations(proposal.config)
        if not broken:
            return None
        return Ruling(
            counted_as="rejected",
            user_attrs={"state": INFEASIBLE, "failure": f"violates {'; '.join(broken)}"},
        )


@dataclass(frozen=True)
class CertainOom:
    known: KnownOutcomes

    def __call__(self, proposal: Proposal) -> Ruling | None:
        ran_out = self.known.certain_oom(proposal.config)
        if ran_out is None:
            return None
        grows = ", ".join(
            f"{k}={ran_out.user_attrs['config'][k]}" for k in self.known.space.memory_grows_with
        )
        return _not_run(
            "skipped_oom",
            proposal.config,
            f"certain to run out of memory, as trial "
            f"#{ran_out.number} ({grows}, the other knobs equal) did",
        )


PREDICTION_MARGIN = 0.10
"""How far over the memory limit a predicted peak must be for ``PredictedOom`` to skip it: above
the memory model's worst error on the CPU presets since a CPU's figure is its tensors' peak (8%,
over two default ``llm`` runs: docs/guide/memory-wall.md). At 15%, the goal before, the ``llama``
CPU preset under a 25 MB limit probed bf16's micro-batch 8, predicted 11% over the limit from
micro-batches 2 and 4 (27.8 MB), and ran out at 28 MB."""


@dataclass(frozen=True)
class PredictedOom:
    """A configuration the memory model predicts to need more than ``runner.memory_limit_mb``
    (where none is set, the device's own memory, ``KnownOutcomes.device_memory_mb``) by more than
    its margin (``PREDICTION_MARGIN``) is not run: an out-of-memory trial costs a fresh process,
    a build and on a GPU often a compile, and tells one bit. The order reads it as out of memory
    (``predicted_out``). Why the device's memory too: without a limit set, as on a GPU by
    default, every wall was found by probes that ran out (3 of the 6 trials of the H100 llama
    study capped at 380 s)."""

    known: KnownOutcomes

    def __call__(self, proposal: Proposal) -> Ruling | None:
        limit_mb, named = self.known.memory_limit_mb, "runner.memory_limit_mb"
        if limit_mb is None:  # a GPU's own memory: its wall, found without a probe that fails
            limit_mb, named = self.known.device_memory_mb, "the device's memory"
        if limit_mb is None:
            return None
        predicted = self.known.memory_model().predict(proposal.config)
        if predicted is None or predicted.worst_mb <= limit_mb * (1 + PREDICTION_MARGIN):
            return None
        if proposal.config not in self.known.predicted_out:
            self.known.predicted_out.append(dict(proposal.config))
        return _not_run(
            "skipped_oom",
            proposal.config,
            f"predicted to run out of memory: {predicted.text()}, "
            f"{predicted.worst_mb / limit_mb - 1:.0%} over {named} = "
            f"{limit_mb:g} MB (more than the model's margin of {PREDICTION_MARGIN:.0%})",
        )


@dataclass(frozen=True)
class Reuse:
    known: KnownOutcomes

    def __call__(self, proposal: Proposal) -> Ruling | None:
        earlier = self.known.measured(proposal.config)
        if earlier is None:
            return None
        over = over_limit(earlier.user_attrs, self.known.memory_limit_mb)
        if over:
            return _not_run(
                "skipped_oom",
                proposal.config,
                f"certain to run out of memory: trial #{earlier.number}'s "
                f"{over.removeprefix('oom: ')}",
            )
        attrs = {k: earlier.user_attrs[k] for k in OUTCOME_ATTRS if k in earlier.user_attrs}
        late = self.known.seconds.get(earlier.number)
        if late is not None:
            attrs.setdefault("second_process", late)
        attrs["reused_from"] = earlier.number
        if earlier.state == TrialState.COMPLETE:
            told = named_constraints(earlier)
            return Ruling(
                counted_as="reused",
                user_attrs=attrs,
                state=TrialState.COMPLETE,
                values=earlier.values,
                constraints=told,
            )
        return Ruling(counted_as="reused", user_attrs=attrs, state=TrialState.FAIL)


@dataclass(frozen=True)
class InFlight:
    """Another trial of the same configuration and fingerprint (another process's) that is
    running, or that completed after this process last read the study's outcomes.

    Each process stores its parameters before it looks, so of two such running trials at least
    one sees the other and gives way (both may: a proposal is lost, never a measurement doubled).
    A trial that completed between that read and this look is no longer running and not yet known
    to ``Reuse``: it is caught here too, or its configuration would be measured twice.
    """

    study: optuna.Study
    fingerprint: str

    def __call__(self, proposal: Proposal) -> Ruling | None:
        states = (TrialState.RUNNING, TrialState.COMPLETE)
        other = next(
            (
                t
                for t in self.study.get_trials(deepcopy=False, states=states)
                if t.number != proposal.number
                and t.params == proposal.params
                and t.user_attrs.get("fingerprint") == self.fingerprint
                # a completed one also under the same fixed knobs (they are no parameters)
                and (t.state == TrialState.RUNNING or t.user_attrs.get("config") == proposal.config)
            ),
            None,
        )
        if other is None:
            return None
        doing = "is measuring" if other.state == TrialState.RUNNING else "has just measured"
        return _not_run(
            "in_flight",
            proposal.config,
            f"trial #{other.number} of another process {doing} this configuration",
            resample=True,
        )


def guards(study: optuna.Study, space: SearchSpace, known: KnownOutcomes) -> list[Guard]:
    """The guards in the order they are asked."""
    return [
        RepeatedRetry(study),
        Constraints(space),
        CertainOom(known),
        Reuse(known),
        PredictedOom(known),
        InFlight(study, known.fingerprint),
    ]
