"""Nothing inside the package imports its root (``torchtpu/__init__.py``), counting
imports inside functions; the rest of the layering is import-linter's (pyproject.toml)."""

from __future__ import annotations

import ast
import pathlib

import torchtpu

PACKAGE = pathlib.Path(torchtpu.__file__).parent
# Tools at the top of the layering may use the public API.
TOOLS = {"conformance", "zoo", "demo.py", "_autoload.py", "__init__.py"}


def _root_imports(path: pathlib.Path) -> list[str]:
    """Each ``import torchtpu`` / ``from torchtpu import name`` of the root's own names."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}" for a in node.names if a.name == "torchtpu"]
        elif isinstance(node, ast.ImportFrom) and node.module == "torchtpu" and node.level == 0:
            for alias in node.names:
                is_module = (PACKAGE / f"{alias.name}.py").exists() or (
                    PACKAGE / alias.name
                ).is_dir()
                if not is_module:
                    found.append(f"line {node.lineno}: {alias.name}")
    return found


def test_nothing_inside_the_package_imports_its_root():
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] in TOOLS:
            continue
        found = _root_imports(path)
        if found:
            offenders[str(relative)] = found
    assert offenders == {}


def test_the_check_sees_a_root_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from torchtpu import sync, config\n")
    assert _root_imports(probe) == ["line 2: sync"]
