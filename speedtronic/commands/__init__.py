"""The ``speedtronic`` subcommands, one module per concept; ``speedtronic.cli`` builds the
parser and dispatches (``corpus``: ``prepare`` and ``tokenizer``; ``checkpoints``:
``evaluate``, ``generate`` and ``export``; ``config_args``: reading ``--config``)."""

from __future__ import annotations

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "UserError"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class UserError(Exception):
    """A mistake the user can fix; printed without a traceback."""
