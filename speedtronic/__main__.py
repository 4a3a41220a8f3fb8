"""``python -m speedtronic`` runs the CLI.

``python -m`` puts the working directory first on ``sys.path``; it is dropped before anything
else is imported, so a ``yaml.py`` or ``json.py`` there never shadows a real module (the
config's ``imports:`` still find the user's modules: see ``speedtronic.user_imports``).
A ``speedtronic.py`` in the working directory is run by Python itself before this file, so
the ``speedtronic`` console script is the launcher that is immune to every such name.
"""

import os
import sys

if not sys.flags.safe_path and sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

from speedtronic.cli import main  # noqa: E402  (after the sys.path fix above)

raise SystemExit(main())
