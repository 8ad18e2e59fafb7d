"""The study: the driver that proposes (``search.strategy``), guards, measures and tells
(``driver``), what an invocation hands it (``driver_inputs``), what settles a proposal without
measuring it (``guards``), and what one invocation's study did (``outcome``)."""

from search.study.driver import StudyDriver, repeat_run
from search.study.driver_inputs import Bench, DriverCallbacks
from search.study.guards import KnownOutcomes, Proposal
from search.study.outcome import StudyOutcome

__all__ = [
    "Bench",
    "DriverCallbacks",
    "KnownOutcomes",
    "Proposal",
    "StudyDriver",
    "StudyOutcome",
    "repeat_run",
]
