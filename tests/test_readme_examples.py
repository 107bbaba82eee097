"""The README's and the docs' examples are real (issue #45): every ``kvq`` command in a fenced
block of README.md or docs/*.md, and every example in a command's ``--help``, parses with kvq's
own command line (options, choices, ranges), names recipes that exist and ``--set`` keys that
are recipe fields; every option quoted inline exists; and the README's three-command flow runs
as written on a tiny model (the model alias and the data paths substituted, nothing else)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from conftest import SHARED_DATA, kvq_run

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

#: options quoted inline that belong to other tools, each with the page that quotes it
OTHER_TOOLS = {"--nproc-per-node", "--nnodes", "--master-addr", "--master-port", "--rdzv-endpoint",  # torchrun
               "--rdzv-backend",  # torchrun (docs/distributed.md)
               "--kv-cache-dtype",  # vLLM (docs/quantize.md)
               "--calculate-kv-scales",  # vLLM (docs/kv-cache.md)
               "--kl-divergence"}  # llama.cpp's perplexity tool (docs/verify.md)


def _command(line: str) -> list[str] | None:
    """The argv after ``kvq`` of one shell line (a ``$ `` prompt, ``NAME=value`` prefixes and a
    path to the script allowed; cut at the first pipe, redirection, ``&`` or ``;``; comments
    dropped), else ``None``."""
    lex = shlex.shlex(line.removeprefix("$ "), posix=True, punctuation_chars=True)
    lex.whitespace_split, lex.commenters = True, "#"
    try:
        tokens = list(lex)
    except ValueError:  # an unbalanced quote: not a command line
        return None
    while tokens and re.fullmatch(r"[A-Za-z_]\w*=.*", tokens[0]):
        tokens = tokens[1:]
    if not tokens or not (tokens[0] == "kvq" or tokens[0].endswith("/kvq")):
        return None
    cut = next((i for i, t in enumerate(tokens) if set(t) <= set("();<>|&")), len(tokens))
    return tokens[1:cut]


def _lines(text: str):
    """``(line number, shell line)`` of ``text``, backslash continuations joined."""
    start, buf = 0, ""
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not buf:
            start = no
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        yield start, buf + line
        buf = ""


def fenced_examples() -> list[tuple[str, list[str]]]:
    """``(page:line, argv)`` of every ``kvq`` command in a fenced block of the pages."""
    out = []
    for page in PAGES:
        fence, block, first = False, [], 0
        for no, raw in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if raw.lstrip().startswith("```"):
                if fence:
                    out += [(f"{page.name}:{first + n - 1}", argv) for n, line in _lines("\n".join(block))
                            if (argv := _command(line))]
                fence, block, first = not fence, [], no + 1
            elif fence:
                block.append(raw)
    return out


def help_examples() -> list[tuple[str, list[str]]]:
    """``(kvq COMMAND --help, argv)`` of every example line in the commands' help texts."""
    from compressor.cli import cli

    return [(f"kvq {name} --help", argv) for name, cmd in sorted(cli.commands.items())
            for _, line in _lines(cmd.help or "") if (argv := _command(line))]


EXAMPLES = fenced_examples() + help_examples()


def test_the_pages_have_examples():
    pages = {where.split(":")[0] for where, _ in EXAMPLES}
    assert {"README.md", "verify.md", "serve.md", "kvq quantize --help"} <= pages, pages
    assert any(argv[0] == "quantize" and "-o" in argv for where, argv in EXAMPLES if where.startswith("README.md"))


@pytest.mark.parametrize("where, argv", EXAMPLES, ids=[w for w, _ in EXAMPLES])
def test_every_example_parses(where, argv):
    """kvq's own parser takes it (options, choices, ranges); recipes exist; --set keys are recipe fields."""
    import click

    from compressor.cli import cli
    from compressor.cli_options import parse_settings
    from compressor.recipe import apply_settings, bundled_recipes, load_recipes

    assert argv and argv[0] in cli.commands, (where, argv)
    cmd = cli.commands[argv[0]]
    try:
        with cmd.make_context(argv[0], list(argv[1:])) as ctx:
            params = dict(ctx.params)
    except click.ClickException as e:
        pytest.fail(f"{where}: kvq {' '.join(argv)}: {e.format_message()}")
    recipes = params.get("recipes_") or ()
    unknown = [r for r in recipes if r not in bundled_recipes() and not r.endswith((".yaml", ".yml"))]
    assert not unknown, f"{where}: no bundled recipe {unknown}"
    if params.get("settings") and not any(r.endswith((".yaml", ".yml")) for r in recipes):
        apply_settings(load_recipes(list(recipes)), parse_settings(params["settings"]))  # InputError: a bad key


def test_every_option_quoted_inline_exists():
    """An inline `kvq COMMAND ...` names options of that command; an inline `--option` is one of some command's."""
    from compressor.cli import cli

    options = {name: {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help", "-h"}
               for name, cmd in cli.commands.items()}
    every = set().union(*options.values())
    bad = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for span in re.findall(r"`([^`\n]+)`", text):
            words = span.split()
            if words and words[0] == "kvq" and len(words) > 1 and words[1] in options:
                known = options[words[1]]
            elif span.startswith("--"):
                known = every | OTHER_TOOLS
            else:
                continue
            bad += [f"{page.name}: `{span}`: {flag}" for flag in re.findall(r"(?<![\w-])--?[A-Za-z][\w-]*", span)
                    if flag not in known]
    assert not bad, bad


def _verbatim(argv: list[str], model: Path) -> list[str]:
    """``argv`` with the model alias as the tiny model and ``../shared/data`` as this checkout's
    data folder (the embedded corpus where there is none); nothing else changed."""
    out = []
    for a in argv:
        if a == "smollm2-135m":
            a = str(model)
        elif a.startswith("../shared/data/"):
            real = SHARED_DATA / a.removeprefix("../shared/data/")
            a = str(real) if real.is_file() else "embedded"
        out.append(a)
    return out


@pytest.mark.slow  # three whole commands (make test-fast leaves it out; the parse checks above stay in it)
def test_the_readme_flow_runs_as_written(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """The README's quantize, verify and serve-smoke examples, in a fresh folder: no usage or input error (exit 2);
    the output folder's parent (out/) is created by quantize."""
    monkeypatch.chdir(tmp_path)
    flow = [argv for where, argv in EXAMPLES if where.startswith("README.md:")]
    assert [a[0] for a in flow] == ["quantize", "verify", "serve-smoke"], flow
    for argv in flow:
        code, _, err = kvq_run(_verbatim(argv, tiny_model_dir), capsys)
        assert code in (0, 1) and "kvq: error" not in err, (argv, err[-2000:])
    assert (tmp_path / "out" / "smollm2-w4" / "kvq-manifest.json").is_file()
    assert (tmp_path / "out" / "report" / "report.html").is_file()
