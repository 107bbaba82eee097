"""The redesign's size rules (issue #17) hold for the whole package: no function over 100
lines and no module over 600, so a newcomer's first reads stay a screen or two long."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "compressor"
MAX_FUNCTION_LINES = 100
MAX_MODULE_LINES = 600


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def test_the_package_is_found():
    assert len(_modules()) > 40


def test_no_module_over_600_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in _modules() if (n := p.read_text().count("\n")) > MAX_MODULE_LINES}
    assert not long, long


def test_no_function_over_100_lines():
    long = {}
    for p in _modules():
        for f in ast.walk(ast.parse(p.read_text())):
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES:
                long[f"{p.relative_to(PACKAGE)}:{f.name}"] = f.end_lineno - f.lineno + 1
    assert not long, long
