"""The search strategy: what to measure next. The expert's order as a function of what the study
has seen (``order``, its moves in ``move``, ``memory_moves`` and ``lever_moves``, what it has seen
in ``book``), the same order as an Optuna sampler (``guided``) and Optuna's samplers by name
(``samplers``). It proposes; it neither measures nor stores (``search.study`` drives it)."""

from search.strategy.book import FIDELITY, OOM, PRECISION_ORDER, Seen, config_key
from search.strategy.guided import HANDED_OVER, WHY, GuidedSampler, distribution, seen_of
from search.strategy.move import Move
from search.strategy.order import next_move
from search.strategy.samplers import GUIDED, SAMPLERS, optuna_names, suggest

__all__ = [
    "FIDELITY",
    "GUIDED",
    "HANDED_OVER",
    "OOM",
    "PRECISION_ORDER",
    "SAMPLERS",
    "WHY",
    "GuidedSampler",
    "Move",
    "Seen",
    "config_key",
    "distribution",
    "next_move",
    "optuna_names",
    "seen_of",
    "suggest",
]
