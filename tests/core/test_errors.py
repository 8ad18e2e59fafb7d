"""One root for the package's errors, and the built-in bases callers have caught all along."""

from __future__ import annotations

import pytest

import search
from search.core.errors import ConfigError, KnobError, SpaceError, StoreError
from search.execution.knobs import Knobs
from search.space.parse import parse_space


@pytest.mark.parametrize(
    "error, builtin",
    [
        (ConfigError, ValueError),
        (SpaceError, ValueError),
        (KnobError, ValueError),
        (StoreError, RuntimeError),
    ],
)
def test_every_error_has_the_one_root_and_its_builtin_base(error, builtin):
    assert issubclass(error, search.SearchError) and issubclass(error, builtin)


def test_what_the_modules_raise_is_caught_by_the_root():
    with pytest.raises(search.SearchError, match="micro_batch_size"):
        Knobs(batch_size=4, micro_batch_size=3)
    with pytest.raises(search.SearchError):
        parse_space("t", {"workload": {"_target_": "x"}, "params": {}, "objectives": {"nope": 1}})
