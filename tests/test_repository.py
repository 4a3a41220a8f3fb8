"""The checkout itself: no merge leftovers in any tracked text file; the suite's ordering list
names tests that exist."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^(<{7} |>{7} |={7}$)", re.MULTILINE)
TEXT_SUFFIXES = {".py", ".pyi", ".md", ".toml", ".ini", ".yaml", ".yml", ".json", ".txt", ""}


def tracked_text_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [ROOT / name for name in listed if Path(name).suffix in TEXT_SUFFIXES]


def test_no_merge_conflict_markers() -> None:
    files = tracked_text_files()
    assert files, "git ls-files listed nothing"
    offenders = [
        str(path.relative_to(ROOT))
        for path in files
        if path.is_file() and MARKER.search(path.read_text(encoding="utf-8", errors="replace"))
    ]
    assert offenders == []


def test_every_slow_first_entry_names_an_existing_test() -> None:
    """``conftest.SLOW_FIRST`` orders the suite; a renamed test would silently drop out."""
    from conftest import SLOW_FIRST

    stale = []
    for entry in SLOW_FIRST:
        file, _, test = entry.partition("::")
        path = ROOT / file
        if not path.is_file() or (test and f"\ndef {test}(" not in path.read_text()):
            stale.append(entry)
    assert SLOW_FIRST and not stale, stale
