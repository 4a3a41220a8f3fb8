"""The package version, in a leaf module: what records it (checkpoints, the CLI) imports
this, never the package root."""

__version__ = "3.0.0"
