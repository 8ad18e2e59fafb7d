"""Search spaces: a space file read and checked (``parse``), its knobs (``params``), constraints
and objectives (``search_space``) as typed values, constraint expressions evaluated without running
Python (``expressions``)."""

from search.space.params import CategoricalParam, FixedParam, FloatParam, IntParam, Param
from search.space.parse import parse_space
from search.space.search_space import SearchSpace

__all__ = [
    "CategoricalParam",
    "FixedParam",
    "FloatParam",
    "IntParam",
    "Param",
    "SearchSpace",
    "parse_space",
]
