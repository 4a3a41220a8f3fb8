"""``python -m speedtronic`` runs the CLI."""

from speedtronic.cli import main

raise SystemExit(main())
