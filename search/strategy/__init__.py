"""The search strategy: what to measure next. The expert's order as a function of what the study
has seen (``order``, its moves in ``move``, ``memory_moves`` and ``lever_moves``, what it has seen
in ``book``), the same order as an Optuna sampler (``guided``) and Optuna's samplers by name
(``samplers``). It proposes; it neither measures nor stores (``search.study`` drives it).

Exported lazily (``search.core.lazy_exports``): ``guided`` and ``samplers`` import Optuna, which
the expert's order (``order``, ``book``, ``move``, ``memory_moves``, ``lever_moves``) does
without, as the import contracts hold; an eager ``__init__`` imported Optuna and MLflow into
every import of the order."""

from __future__ import annotations

from typing import TYPE_CHECKING

from search.core.lazy_exports import lazy_exports

if TYPE_CHECKING:
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

__getattr__ = lazy_exports(
    __name__,
    {
        "book": ["FIDELITY", "OOM", "PRECISION_ORDER", "Seen", "config_key"],
        "guided": ["HANDED_OVER", "WHY", "GuidedSampler", "distribution", "seen_of"],
        "move": ["Move"],
        "order": ["next_move"],
        "samplers": ["GUIDED", "SAMPLERS", "optuna_names", "suggest"],
    },
)
