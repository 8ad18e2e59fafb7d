"""The knob values a built workload refuses (``Workload.refuses``: an architecture whose layers
have no part of that name, say): a searched one dropped with a note, as a choice the device cannot
run is; a fixed one refused, since no trial could run."""

from __future__ import annotations

from typing import Any

from search.core.errors import ConfigError, SpaceError, first_line
from search.core.knob_registry import GENERIC_KNOBS
from search.space.search_space import SearchSpace

__all__ = ["without_values_it_refuses"]


def without_values_it_refuses(space: SearchSpace, built: Any) -> tuple[SearchSpace, list[str]]:
    """``space`` without the generic knobs' choices the built workload refuses
    (``Workload.refuses``: an architecture without Liger's kernels, say), each with a note, as
    choices this device cannot run are dropped; a fixed value it refuses is refused, since no
    trial could run."""
    asked = getattr(built, "refuses", None)
    if asked is None:
        return space, []

    def refuses(name: str, value: Any) -> str | None:
        try:
            return asked(name, value)
        except Exception as e:  # the workload's own code (a model built on the meta device)
            first = first_line(e)
            raise ConfigError(
                f"space '{space.name}': workload {space.workload['_target_']} failed to say "
                f"whether it takes {name}={value}: {type(e).__name__}: {first}"
            ) from None

    for name, value in space.fixed.items():
        reason = refuses(name, value) if name in GENERIC_KNOBS else None
        if reason:
            raise ConfigError(f"space '{space.name}': params.{name}={value}: {reason}")
    try:
        return space.without_choices(
            lambda name, value: refuses(name, value) if name in GENERIC_KNOBS else None
        )
    except SpaceError as e:
        raise ConfigError(str(e)) from None
