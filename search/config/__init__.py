"""The run's settings: Hydra composition (``compose``), the typed settings (``settings``), and the
space as this device runs it, with the fingerprint of what is measured (``prepare``).

Exported lazily (``search.core.lazy_exports``): ``compose`` and ``prepare`` import Hydra and much
of ``search.execution``, while the packages that read the typed settings alone (re-validation,
the strategy) need neither."""

from __future__ import annotations

from typing import TYPE_CHECKING

from search.core.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from search.config.compose import (
        compose_config,
        for_logging,
        load_settings,
        redact,
        redact_tree,
        resolve,
        resolve_device,
    )
    from search.config.prepare import control_config, fingerprint, load_space
    from search.config.settings import SAMPLER_NAMES, Settings

__all__ = [
    "SAMPLER_NAMES",
    "Settings",
    "compose_config",
    "control_config",
    "fingerprint",
    "for_logging",
    "load_settings",
    "load_space",
    "redact",
    "redact_tree",
    "resolve",
    "resolve_device",
]

__getattr__ = lazy_exports(
    __name__,
    {
        "compose": [
            "compose_config",
            "for_logging",
            "load_settings",
            "redact",
            "redact_tree",
            "resolve",
            "resolve_device",
        ],
        "prepare": ["control_config", "fingerprint", "load_space"],
        "settings": ["SAMPLER_NAMES", "Settings"],
    },
)
