"""Command-line entry points. Each `main(argv=None) -> int` is a console script; the
modules that compare against `transformers` import it inside `main()` only."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def disk_full(exc: BaseException) -> bool:
    """A write that failed for want of space (a full disk, a quota), not for a bad input."""
    import errno

    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def disk_full_line(exc: OSError, output: object, kept: str) -> str:
    """The one line a command prints for a full disk: where, and what was kept."""
    return (
        f"error: no space left writing {exc.filename or output} ({exc.strerror}); {kept}. Free some space and run again"
    )


def positive_int(text: str) -> int:
    """argparse `type=` for a count flag (`--batch-size`): an integer of at least 1, or a
    usage error naming the value."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (at least 1), got {value}")
    return value


def thread_count(text: str) -> int | str:
    """argparse `type=` for `--threads`: "auto" (`bert_port.threads.ThreadGovernor`) or a
    positive integer."""
    return "auto" if text == "auto" else positive_int(text)


def add_threads_flag(parser: argparse.ArgumentParser) -> None:
    """`--threads`, as the commands that run a model over many batches take it."""
    parser.add_argument(
        "--threads",
        type=thread_count,
        default="auto",
        help="CPU threads: a number, or 'auto' (default) to follow the cores other processes leave free, "
        "set before each batch (bert_port.threads)",
    )


def settings_parser(prog: str, description: str, settings: type, file_flag: str, file_help: str):
    """The parser of a training command: `file_flag` names a settings file (JSON, keys as the
    flags; flags win), then one flag per field of `settings` (`add_settings_flags`)."""
    parser = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(file_flag, help=file_help)
    add_settings_flags(parser, settings)
    return parser


def add_settings_flags(parser: argparse.ArgumentParser, settings: type) -> None:
    """One flag per field of the settings dataclass `settings` (`training.FinetuneConfig`,
    `PretrainConfig`), with its help, choices and default taken from the field (bool fields
    get --flag/--no-flag). Flags not given stay unset, so that a settings file's values hold.
    The command's own options come first in its help, then those every recipe shares."""
    import dataclasses

    from bert_port.training.settings import field_kind, flag

    own = set(vars(settings).get("__annotations__", {}))
    for f in sorted(dataclasses.fields(settings), key=lambda f: f.name not in own):
        kind, _ = field_kind(f)
        text = f.metadata["help"] + ("" if f.default is None else f" (default: {f.default})")
        if kind is bool:
            parser.add_argument(
                flag(f.name), action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=text
            )
        else:
            choices = f.metadata["choices"]
            parser.add_argument(flag(f.name), type=kind, default=argparse.SUPPRESS, choices=choices, help=text)


def settings_from(args: argparse.Namespace, settings: type, file: str | None):
    """`settings` from its dataclass defaults < the settings file `file` (or bundled recipe) <
    the flags given."""
    import dataclasses

    from bert_port.training import load_config_file

    values = load_config_file(file, settings) if file else {}
    values.update({f.name: getattr(args, f.name) for f in dataclasses.fields(settings) if hasattr(args, f.name)})
    return settings(**values)


def run_training(run: Callable[[], dict | None], report: Callable[[dict, float], str]) -> int:
    """A training command's main: logging (INFO on rank 0 of a torchrun job, warnings on the
    others), `run()` under tqdm-aware logging, its refusals as one `error:` line with exit 2
    (the machine's faults, `OSError`, exit 1), then `report(metrics, wall seconds)` printed
    by rank 0. `run` returns None when it has printed its own answer."""
    import logging
    import os
    import sys
    import time

    from tqdm.contrib.logging import logging_redirect_tqdm

    from bert_port.checkpoint import CheckpointError
    from bert_port.config import ConfigError
    from bert_port.data import DataError
    from bert_port.extras import MissingExtra
    from bert_port.metrics import MetricError
    from bert_port.training import FinetuneError

    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    t0 = time.perf_counter()
    try:
        with logging_redirect_tqdm():
            metrics = run()
    except (DataError, FinetuneError, CheckpointError, ConfigError, MissingExtra, MetricError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the machine, not the input: a vanished mount (a full disk is a FinetuneError)
        print(f"error: {exc}", file=sys.stderr)
        return 2 if disk_full(exc) else 1
    if metrics is not None and rank == 0:
        print(report(metrics, time.perf_counter() - t0))
    return 0


def report_ending(metrics: dict) -> list[str]:
    """A training report's last lines: how to continue a stopped run, what the folder holds."""
    lines = ["  stopped early: continue with the same command plus --resume"] if metrics["status"] == "stopped" else []
    return [
        *lines,
        (
            f"  output: {metrics['output_dir']} (HF checkpoint, metrics.json, training_curves.png, "
            "training_config.json, README.md; checkpoints/last-checkpoint.pt to resume)"
        ),
    ]
