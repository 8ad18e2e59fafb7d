"""A package's names exported lazily (PEP 562): each is imported from its module the first time it
is asked for, so that importing one module of the package does not import all the others.

A package whose modules differ in weight uses it: the worker process imports the light modules of
``search.execution`` and must not pay for Hydra and the fork server because ``isolation`` is
exported beside them. Its ``__init__`` names the same imports under ``TYPE_CHECKING`` for type
checkers and readers; ``tests/test_layers.py`` checks that each name of ``__all__`` resolves.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, names: Mapping[str, Sequence[str]]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package`` that imports each of ``names`` (module: names,
    modules relative to ``package``) from its module on first use."""
    module_of = {name: module for module, exported in names.items() for name in exported}

    def __getattr__(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{module}"), name)

    return __getattr__
