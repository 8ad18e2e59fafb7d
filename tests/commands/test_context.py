"""Where an invocation's time went (``search.commands.context.Spent``)."""

from __future__ import annotations

import re
import time

from search.commands.context import Spent


def _rest_s(line: str) -> float:
    return float(re.search(r"the rest (\d+) s", line).group(1))


def test_a_retune_s_re_measurement_of_its_baseline_is_named_and_not_counted_as_the_rest():
    spent = Spent(started_s=time.monotonic() - 100, new_s=20, new_trials=2, confirmation_s=30)
    spent.baseline_s = 40
    line = spent.line()
    assert "the baseline re-measured 40 s" in line
    assert 9 <= _rest_s(line) <= 11  # 100 - 20 - 40 - 30, give or take the call's own time
    assert spent.metrics()["time_baseline_s"] == 40


def test_a_tuning_has_no_baseline_part():
    spent = Spent(started_s=time.monotonic() - 100, new_s=20, new_trials=2, confirmation_s=30)
    assert "baseline" not in spent.line() and "time_baseline_s" not in spent.metrics()
    assert 49 <= _rest_s(spent.line()) <= 51
