"""The ``speedtronic`` subcommands, one module per concept; ``speedtronic.cli`` builds the
parser and dispatches (``corpus``: ``prepare`` and ``tokenizer``)."""

from __future__ import annotations

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
