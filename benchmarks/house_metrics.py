"""The shape of the code base, counted (issue 33's measures): the names of the front door
(``speedtronic.__all__``), the import cycles between packages, and the public top-level names
used nowhere outside their own module.

    python benchmarks/house_metrics.py        # the figures
    python benchmarks/house_metrics.py -v     # and every unused public name, path:name

* *front door*: ``len(speedtronic.__all__)``.
* *import cycles*: the import graph of ``speedtronic`` (grimp, as import-linter builds it,
  ``TYPE_CHECKING`` imports left out) with each module folded into its package
  (``speedtronic.engine.loop`` -> ``speedtronic.engine``; a top-level module such as
  ``speedtronic.runtime`` is its own node). Reported: the strongly connected groups of more
  than one package, the pairs of packages that import each other, and every group of
  *modules* that import each other in a cycle (largest first, each with its modules).
* *unused public names*: a top-level ``def``/``class``/assignment without a leading ``_`` in
  ``speedtronic/`` or ``callbacks/speedtronic_callbacks/`` whose name appears (as a word)
  in no other file of the package, the plugins, tests, docs, examples, benchmarks, configs,
  README.md or pyproject.toml. A name in an ``__all__`` of its own module only counts as used
  when something else names it. Text search: a name used through ``getattr`` by a string of
  the same spelling counts as used. Those not used even in their own module are *dead*; the
  others are helpers of their module that are public by name only.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
SOURCES = (ROOT / "speedtronic", ROOT / "callbacks" / "speedtronic_callbacks")
READERS = ("speedtronic", "callbacks", "tests", "docs", "examples", "benchmarks", "configs")
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def front_door() -> int:
    sys.path.insert(0, str(ROOT))
    import speedtronic

    return len(speedtronic.__all__)


def _package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _components(nodes: set[str], edges: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[set[str]] = []
    counter = 0
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group: set[str] = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                found.append(group)
    return found


def import_cycles() -> dict[str, object]:
    graph = grimp.build_graph("speedtronic", exclude_type_checking_imports=True, cache_dir=None)
    modules = set(graph.modules)
    module_edges: dict[str, set[str]] = defaultdict(set)
    package_edges: dict[str, set[str]] = defaultdict(set)
    for module in modules:
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in modules:
                continue
            module_edges[module].add(imported)
            source, target = _package(module), _package(imported)
            if source != target:
                package_edges[source].add(target)
    packages = {_package(m) for m in modules}
    package_groups = [g for g in _components(packages, package_edges) if len(g) > 1]
    mutual = sorted(
        (a, b)
        for a, targets in list(package_edges.items())
        for b in targets
        if a < b and a in package_edges.get(b, set())
    )
    module_groups = sorted(
        (sorted(g) for g in _components(modules, module_edges) if len(g) > 1),
        key=lambda group: (-len(group), group),
    )
    return {
        "package cycles (groups)": len(package_groups),
        "packages in cycles": sorted(p for g in package_groups for p in g),
        "package pairs importing each other": mutual,
        "module cycles (groups)": len(module_groups),
        "modules in the largest cycle": len(module_groups[0]) if module_groups else 0,
        "module cycle groups": module_groups,
    }


def _public_names(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return [n for n in names if not n.startswith("_") and n not in {"T", "logger", "log"}]


def _all_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            try:
                return set(ast.literal_eval(node.value))
            except ValueError:
                return set()
    return set()


def _uses_in_own_module(path: Path, name: str) -> int:
    """How often ``name`` appears in its own module beyond its definition (and ``__all__``)."""
    text = path.read_text(encoding="utf-8")
    return len(re.findall(rf"\b{re.escape(name)}\b", text)) - 1 - (f'"{name}"' in text)


def unused_public_names() -> tuple[list[str], int]:
    files = [p for folder in READERS for p in (ROOT / folder).rglob("*") if p.is_file()]
    files += [ROOT / "README.md", ROOT / "pyproject.toml"]
    words: dict[Path, set[str]] = {}
    for path in files:
        if path.suffix not in {".py", ".md", ".toml", ".yaml", ".yml", ".json", ".pyi", ".txt"}:
            continue
        if "__pycache__" in path.parts or "schemas" in path.parts:
            continue
        words[path] = set(WORD.findall(path.read_text(encoding="utf-8", errors="replace")))
    unused: list[str] = []
    in_all = 0
    for source in SOURCES:
        for path in sorted(source.rglob("*.py")):
            exported = _all_of(path)
            for name in _public_names(path):
                if name in {"__all__"}:
                    continue
                if any(name in found for other, found in words.items() if other != path):
                    continue
                dead = _uses_in_own_module(path, name) <= 0
                unused.append(f"{path.relative_to(ROOT)}:{name}" + (" (dead)" if dead else ""))
                in_all += name in exported
    return unused, in_all


def main() -> None:
    print(f"names in speedtronic.__all__: {front_door()}")
    for key, value in import_cycles().items():
        if key == "module cycle groups":
            assert isinstance(value, list)
            for number, group in enumerate(value, 1):
                print(f"  module cycle {number} ({len(group)} modules): {', '.join(group)}")
            continue
        print(f"{key}: {value}")
    unused, in_all = unused_public_names()
    dead = [entry for entry in unused if entry.endswith("(dead)")]
    print(f"unused public names: {len(unused)} ({in_all} of them in an __all__)")
    print(f"  of them used nowhere, not even in their own module: {len(dead)}")
    if "-v" in sys.argv:
        print("\n".join(unused))


if __name__ == "__main__":
    main()
