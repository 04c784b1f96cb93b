"""Command-line entry points. Each `main(argv=None) -> int` is a console script; the
modules that compare against `transformers` import it inside `main()` only."""

from __future__ import annotations

import argparse


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
