"""The commands: tune (the default), sync, retune and history, behind one command line (``cli``).
A tuning and a re-tune are ``tune``'s two entries, with their steps in the sibling modules
(``context``, ``callbacks``, ``retune``, ``revalidation_rounds``, ``finish``, ``conclusion``);
``sync`` and ``history`` are modules of their own.

Exported: the command line alone, which imports each command only once it is chosen, so that
``--help`` stays fast."""

from search.commands.cli import main

__all__ = ["main"]
