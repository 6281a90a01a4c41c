"""The shape of the tree: small files, and the layers' direction (also checked, in full,
by ``lint-imports`` in ``make test``: pyproject.toml's ``[tool.importlinter]``)."""

from __future__ import annotations

import ast
from pathlib import Path

BARGEIN = Path(__file__).resolve().parents[1] / "bargein"
MAX_LINES = 500


def test_no_python_file_is_over_500_lines():
    long = {str(p.relative_to(BARGEIN)): n for p in BARGEIN.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_the_engine_imports_no_layer_above_it():
    above = ("bargein.distributed", "bargein.server", "bargein.cli", "bargein.build")
    found = {str(p.relative_to(BARGEIN)): sorted(n for n in _imports(p) if n.startswith(above))
             for p in (BARGEIN / "engine").rglob("*.py")}
    assert not {k: v for k, v in found.items() if v}
