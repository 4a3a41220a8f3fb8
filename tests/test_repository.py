"""The checkout itself: no merge leftovers in any tracked text file."""

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
