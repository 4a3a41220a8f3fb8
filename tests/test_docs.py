"""Every ```python block in docs/*.md and README.md runs (one namespace per page)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def python_blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text(encoding="utf-8"))


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: p.name)
def test_doc_examples_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem}"}
    for number, block in enumerate(python_blocks(page), start=1):
        # dont_inherit: a block runs as the user's own code would, without this module's
        # ``from __future__ import annotations`` (the declarations read real annotations).
        code = compile(block, f"{page.name}[block {number}]", "exec", dont_inherit=True)
        exec(code, namespace)  # noqa: S102 - executing our own documentation


def test_option_tables_are_generated_from_the_declarations() -> None:
    """Each marked table is what ``speedtronic schema --docs docs`` makes of its declaration,
    and every core section and built-in plugin has its table."""
    from importlib import metadata

    from speedtronic.config.docs_tables import render
    from speedtronic.config.sections import _SECTION_TYPES
    from speedtronic.plugins import plugin_spec

    marked = ""
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text(encoding="utf-8")
        assert render(text) == text, f"{page.name}: run `speedtronic schema --docs docs`"
        marked += "\n".join(re.findall(r"<!-- options: (.*?) -->", text)) + "\n"
    declarations = {word for line in marked.splitlines() for word in line.split() if ":" in word}
    for section_type in _SECTION_TYPES.values():
        assert f"speedtronic.config.sections:{section_type.__name__}" in declarations
    for entry in metadata.entry_points(group="speedtronic.callbacks"):
        if entry.dist is None or entry.dist.name != "speedtronic":
            continue
        options = plugin_spec(entry.name).options_type
        assert options is not None
        assert f"{options.__module__}:{options.__qualname__}" in declarations, entry.name
