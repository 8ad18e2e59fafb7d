"""Command line: ``python -m search [sync|retune|history] +space=NAME [key=value ...]
[--config-dir DIR] [--cfg]``.

``sync`` copies to MLflow the trials a run could not log (see ``search.commands.sync``); ``retune``
re-tunes against the study's last tuning and says whether it got slower (see
``search.commands.retune`` and ``search.retuning``); ``history`` lists the study's tunings. Each
takes the same overrides as the tuning run, so that it finds the same study and experiment.

Overrides use Hydra syntax. Exit codes: 0 done, 2 bad input (one line, no traceback), 3 a
re-tune found a regression, 130 interrupted, 1 anything unexpected.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["USAGE", "main", "refuse_a_file_store"]

USAGE = """usage: python -m search +space=NAME [key=value ...] [--config-dir DIR] [--cfg]
       python -m search sync +space=NAME [key=value ...] [--config-dir DIR]
       python -m search retune +space=NAME [key=value ...] [--config-dir DIR]
       python -m search history +space=NAME [key=value ...] [--config-dir DIR]

Tunes a PyTorch workload: runs it under the settings a search space proposes, measures each one
until its variance is known, and logs every trial to MLflow.

  sync               copy to MLflow the measured trials of the study that have no run there yet
                     (e.g. after the tracking server was down), then set the pareto tags; give it
                     the same overrides as the tuning run. Nothing is measured again.
  retune             the nightly job: re-measure the last tuning's recommendation and front, search
                     a little, and say whether the model got slower (exit 3), the optimum moved,
                     or nothing changed; same overrides as the tuning run.
  history            the study's tunings and re-tunes: the recommendation, run by run.

  +space=NAME        the search space: spaces/NAME.yaml, or DIR/space/NAME.yaml with --config-dir DIR
  key=value          override any config key, e.g. study.n_trials=40 device=cuda:1 runs_dir=/data/tuning
  --config-dir DIR   add DIR to Hydra's search path (your own spaces in DIR/space/)
  --cfg              check the config as a run would (device, space), print it and exit; another
                     device's preset (preset=cuda on a CPU) is printed unchecked
  -h, --help         this text
"""  # noqa: E501 (help-table rows: the printed text stays byte-for-byte as it is)


def _parse(argv: Sequence[str]) -> tuple[list[str], list[str], bool]:
    from search.core.errors import ConfigError

    overrides, config_dirs, show = [], [], False
    args = iter(argv)
    for arg in args:
        if arg in ("--config-dir", "-cd"):
            value = next(args, None)
            if value is None:
                raise ConfigError(f"{arg} needs a directory")
            config_dirs.append(value)
        elif arg.startswith("--config-dir="):
            config_dirs.append(arg.split("=", 1)[1])
        elif arg == "--cfg":
            show = True
        elif arg.startswith("-"):
            raise ConfigError(f"unknown option {arg!r} (see --help)")
        else:
            overrides.append(arg)
    return overrides, config_dirs, show


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    if argv[:1] not in (["sync"], ["history"]):  # the commands that run no workload
        from search.execution.worker_server import start_worker_server

        # First: the server's imports (torch and its compiler, 3.5 s of a core on a 2-core CPU)
        # then overlap this process's own, which the workload's checks would otherwise wait for.
        start_worker_server()
    from search.commands.invocation import COMMAND_WORDS, invoked_as  # late: --help stays fast

    command = argv[0] if argv[:1] and argv[0] in COMMAND_WORDS else "tune"
    with invoked_as(argv):
        return _run(command, argv[1:] if command != "tune" else argv)


def refuse_a_file_store(uri: str) -> None:
    """Before any command opens a store, and with ``--cfg``: a settings check that needs MLflow,
    which the settings themselves must not import (re-validation and stability read them)."""
    from search.config.compose import ConfigError
    from search.tracking.connection import file_store_refusal

    refusal = file_store_refusal(uri)
    if refusal:
        raise ConfigError(refusal)


def _run(command: str, argv: list[str]) -> int:
    """``command`` with its overrides and options ``argv``: its exit code."""
    from search.config.compose import ConfigError, compose_config  # late: --help stays fast

    try:
        overrides, config_dirs, show = _parse(argv)
        cfg = compose_config(overrides, config_dirs)
        refuse_a_file_store(str(cfg.tracking.uri))
        if show:
            import yaml

            from search.config.compose import load_settings, preset, resolve, resolve_device
            from search.config.prepare import prepare

            settings = load_settings(cfg)
            # Refused here as a run would refuse them: the device always, the space where the
            # preset is this device's (another device's preset is printed, to be read).
            if preset(cfg) == resolve_device(settings.device).type:
                prepare(settings)
            print(yaml.safe_dump(resolve(cfg), sort_keys=False))
            return 0
        if command == "sync":
            from search.commands.sync import run_sync

            return run_sync(cfg)
        if command == "history":
            from search.commands.history import run_history

            return run_history(cfg)
        if command == "retune":
            from search.commands.tune import run_retune

            return run_retune(cfg)
        from search.commands.tune import run_tune

        return run_tune(cfg)
    except ConfigError as e:
        from search.config.compose import redact

        # A library's own message may repeat a URL with its password (a TLS or connection error).
        print(f"search: error: {redact(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("search: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from search.core.errors import StoreError

        if not isinstance(e, StoreError):
            raise
        print(f"search: error: {e}", file=sys.stderr)  # not bad input: the storage failed
        return 1
