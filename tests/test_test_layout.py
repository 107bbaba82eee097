"""The layout of tests/ itself: a test module never imports another test module. Shared helpers live in
tests/conftest.py (fixtures, the CLI runner, artifact and folder helpers) and every tiny model in
tests/tiny_models.py; importing a test_*.py module from another one runs and registers its tests and
fixtures twice and ties the two files' meanings together."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _is_test_module(dotted: str) -> bool:
    """Whether an imported dotted name is a test module of this folder: ``test_x``, ``tests.test_x``
    (or a name inside one)."""
    parts = dotted.split(".")
    if parts[0] == "tests":
        parts = parts[1:]
    return bool(parts) and parts[0].startswith("test_")


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, imported dotted name) of every import statement in ``tree``, relative ones as ``.name``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level or base in ("", "tests"):  # from . import test_x / from tests import test_x
                out += [(node.lineno, f"{base}.{a.name}".lstrip(".")) for a in node.names]
            if base:
                out.append((node.lineno, base))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            out.append((node.lineno, str(node.args[0].value)))
    return out


def imports_of_test_modules(source: str) -> list[str]:
    """``line: name`` for every import of a test module in ``source``: import statements, importlib /
    ``__import__`` calls, and the same inside string literals that parse as Python (the probe scripts
    a test runs in a subprocess)."""
    tree = ast.parse(source)
    found = [(line, name) for line, name in _imports(tree) if _is_test_module(name)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "import" in node.value:
            try:
                inner = ast.parse(node.value)
            except SyntaxError:
                continue
            found += [(node.lineno, name) for _, name in _imports(inner) if _is_test_module(name)]
    return [f"{line}: {name}" for line, name in sorted(set(found))]


def test_no_test_module_imports_another():
    modules = sorted(TESTS.glob("*.py"))
    assert len(modules) > 20 and TESTS / "conftest.py" in modules
    bad = {p.name: found for p in modules if (found := imports_of_test_modules(p.read_text()))}
    assert not bad, f"test modules importing test modules (move the helper to conftest.py or tiny_models.py): {bad}"


def test_the_check_finds_each_form_of_import():
    """The control: every way a test module was imported from another is found, and the shared
    modules are not."""
    t = "test_"  # the sources below name test modules only once formatted, so this file passes its own check
    probe = '"""\nfrom {t}frontier import digests\n"""\n'
    bad = ("from {t}cli import run\n", "import {t}arch\n", "from tests.{t}arch import tiny\n",
           "import tests.{t}frontier as tf\n", "from tests import {t}kimi_k25\n", "from . import {t}x\n",
           "from .{t}x import y\n", "def f():\n    from {t}pipeline import _model\n",
           "import importlib\nimportlib.import_module('{t}arch')\n", "BODY = " + probe)
    for src in bad:
        assert imports_of_test_modules(src.format(t=t)), src
    good = ("from conftest import kvq_run as run\n", "from tiny_models import tiny\n", "import tests.conftest\n",
            "from fake_cuda import fake_cuda\n", "import pytest\n", "BODY = 'import {t}arch oops('\n")
    for src in good:
        assert not imports_of_test_modules(src.format(t=t)), src
