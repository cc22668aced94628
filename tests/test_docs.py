"""The documentation stays true: a short README, links that resolve, commands the real CLI accepts as written,
and a recipe reference generated from the schema. Parsing only: nothing is trained or run (about a second)."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 200

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```(\w*)\s*$")


def _id(path: Path) -> str:
    return str(path.relative_to(REPO))


def _without_code(text: str) -> str:
    """The text outside fenced blocks and inline code spans, where a Markdown link is a link."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def _anchors(doc: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file (lower case, punctuation dropped, spaces to -)."""
    anchors: set[str] = set()
    fenced = False
    for line in doc.read_text().splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        heading = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).replace("`", "").lower()).replace(" ", "-")
            count = sum(a == slug or re.fullmatch(re.escape(slug) + r"-\d+", a) is not None for a in anchors)
            anchors.add(f"{slug}-{count}" if count else slug)
    return anchors


def _bash_commands(text: str) -> list[str]:
    """Every command line of every ```bash block (continuation lines joined)."""
    commands, in_bash, fenced, pending = [], False, False, ""
    for line in text.splitlines():
        fence = FENCE.match(line.strip())
        if fence:
            in_bash = not fenced and fence.group(1) == "bash"
            fenced = not fenced
            continue
        if not in_bash:
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        command = (pending + line).strip()
        pending = ""
        if command and not command.startswith("#"):
            commands.append(command)
    return commands


def _shardlight_commands() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for command in _bash_commands(doc.read_text()):
            for part in re.split(r"\s*(?:;|&&|\|\|)\s*", command):
                words = shlex.split(part, comments=True)
                if words and words[0] == "shardlight":
                    found.append((_id(doc), shlex.join(words)))
    return found


@lru_cache(maxsize=None)
def _parser() -> argparse.ArgumentParser:
    from shardlight.cli.main import build_parser

    return build_parser()


@lru_cache(maxsize=None)
def _recipe_keys() -> tuple[frozenset, tuple]:
    from shardlight.recipe.validate import schema_fields

    keys = frozenset(key for key, _ in schema_fields())
    mappings = tuple(key for key, f in schema_fields() if "dict" in str(f.type).lower())
    return keys, mappings


def _subcommand(parser: argparse.ArgumentParser, words: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """Walk the subcommands named at the front of ``words``: the deepest parser and the words left for it."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            return parser, words
        if not words or words[0].startswith("-"):
            return parser, words  # `shardlight --help`: this level's options (parsing fails without a command)
        name = words[0]
        assert name in subs[0].choices, f"unknown command {name!r} (the CLI has {sorted(subs[0].choices)})"
        parser, words = subs[0].choices[name], words[1:]


def test_readme_is_short():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, at most {README_MAX_LINES}"


@pytest.mark.parametrize("doc", DOCS, ids=_id)
def test_relative_links_resolve(doc):
    missing = []
    for target in LINK.findall(_without_code(doc.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # a URL (https:, mailto:)
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path) if path else doc
        if not linked.exists():
            missing.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            missing.append(target)
    assert not missing, f"{_id(doc)} links to files or headings that do not exist: {missing}"


def test_docs_show_shardlight_commands():
    commands = _shardlight_commands()
    assert len(commands) >= 10, commands  # the check below must have something to check
    shown = {shlex.split(c)[1] for _, c in commands}
    assert {"train", "analyze", "diagnose", "plan", "profile", "export", "launch"} <= shown, shown


@pytest.mark.parametrize("doc,command", [pytest.param(d, c, id=f"{d}: {c}") for d, c in _shardlight_commands()])
def test_shardlight_command_as_written(doc, command):
    words = shlex.split(command, comments=True)[1:]
    parser, rest = _subcommand(_parser(), words)
    known = parser._option_string_actions
    for word in rest:
        if word.startswith("-"):
            option = word.split("=", 1)[0]
            assert option in known, f"{doc}: `{command}`: {option} is not an option of {parser.prog}"
    if any(w in ("-h", "--help") for w in rest):
        return
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args, extra = parser.parse_known_args(rest)
    except SystemExit:
        pytest.fail(f"{doc}: `{command}`: {stderr.getvalue().strip().splitlines()[-1]}")
    items = list(getattr(args, "items", None) or []) + extra
    keys, mappings = _recipe_keys()
    for i, item in enumerate(items):
        if "=" in item:
            key = item.split("=", 1)[0]
            known_key = key in keys or any(key.startswith(m + ".") for m in mappings)
            assert known_key, f"{doc}: `{command}`: {key!r} is not a recipe key"
        elif i == 0 and parser.prog.endswith(" recipes"):
            continue  # `recipes copy NAME DEST`: checked by test_recipes_copied_in_the_docs_are_shipped
        elif i == 0:
            from shardlight.recipe.recipe_files import shipped_recipe

            shipped_or_copied = shipped_recipe(item) is not None or item in _copied_recipes(doc)
            assert item.endswith((".yaml", ".yml")) or shipped_or_copied, \
                f"{doc}: `{command}`: {item!r} is not a recipe file"
            assert (REPO / item).is_file() or shipped_or_copied, f"{doc}: `{command}`: no recipe file {item}"
        else:
            pytest.fail(f"{doc}: `{command}`: a second positional word {item!r}")


def _copied_recipes(doc: str) -> set:
    """The files a doc's ``shardlight recipes copy NAME DEST`` commands write (its later commands train them)."""
    out = set()
    for d, command in _shardlight_commands():
        words = shlex.split(command, comments=True)
        if d == doc and words[1:3] == ["recipes", "copy"] and len(words) >= 5:
            out.add(words[4])
    return out


def test_recipes_copied_in_the_docs_are_shipped():
    from shardlight.recipe.recipe_files import shipped_recipe

    copies = [(d, shlex.split(c, comments=True)) for d, c in _shardlight_commands()]
    copies = [(d, words) for d, words in copies if words[1:3] == ["recipes", "copy"]]
    assert copies
    for doc, words in copies:
        assert len(words) >= 4 and shipped_recipe(words[3]) is not None, f"{doc}: {' '.join(words)}"


@pytest.mark.parametrize("doc", DOCS, ids=_id)
def test_make_train_recipes_exist(doc):
    for command in _bash_commands(doc.read_text()):
        for recipe in re.findall(r"\bRECIPE=(\S+)", command):
            assert (REPO / recipe).is_file(), f"{_id(doc)}: `{command}`: no recipe file {recipe}"


def test_recipe_reference_is_current():
    from shardlight.recipe.docs import TABLE_END, TABLE_START, recipe_reference_markdown

    text = (REPO / "docs" / "recipes.md").read_text()
    assert TABLE_START in text and TABLE_END in text, "docs/recipes.md lost its table markers"
    table = text.split(TABLE_START)[1].split(TABLE_END)[0]
    assert table == recipe_reference_markdown(), "docs/recipes.md's recipe reference is stale: run `make docs`"
