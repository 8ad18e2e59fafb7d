"""How this invocation was typed: the words after ``python -m search`` (``invoked_as``), the command
it records (``command_line``) and the ``sync`` command it prints (``sync_command``).

Apart from ``search.commands.context`` on purpose: the command line reads it before composing its
settings, so that input refused there is refused without importing what a study needs beyond the
settings (MLflow, Optuna, the study's own modules: 2.6 s of a 2-core CPU).
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from search.config.compose import redact

__all__ = ["COMMAND_WORDS", "command_line", "invoked_as", "sync_command"]


COMMAND_WORDS = ("sync", "retune", "history")
"""The words before the overrides that name a command other than the tuning (``cli.main``)."""

_invocation_words: list[str] | None = None


@contextmanager
def invoked_as(words: Sequence[str]) -> Iterator[None]:
    """Within it, this invocation is ``words`` (``cli.main``'s, command word included): the
    command lines it records and suggests are built from them, since ``main(argv)`` need not be
    ``sys.argv``. Restored after, so that one call of ``main`` leaves nothing to the next."""
    global _invocation_words
    before, _invocation_words = _invocation_words, list(words)
    try:
        yield
    finally:
        _invocation_words = before


def _words() -> list[str]:
    return list(sys.argv[1:] if _invocation_words is None else _invocation_words)


def _as_command(words: Sequence[str]) -> str:
    # Quoted as a shell reads it back: an override with a space (retune.baseline='tune 2026-...')
    # pasted from the printed sync command must stay one word.
    return redact(" ".join(["python -m search", *(shlex.quote(w) for w in words)]))


def command_line() -> str:
    """This invocation as a command, passwords redacted (the parent run's ``command`` tag)."""
    return _as_command(_words())


def sync_command() -> str:
    """``python -m search sync`` with this invocation's overrides: it copies to MLflow later what
    could not be logged now. A re-tune's own command word is left out: ``sync`` takes the
    overrides alone, and ``sync retune ...`` would be refused."""
    overrides = _words()
    if overrides[:1] and overrides[0] in COMMAND_WORDS:
        overrides = overrides[1:]
    return _as_command(["sync", *overrides])
