"""Docs that cannot drift: every `trtbuild …`, `perfclient …` and `make …` command shown in README.md and docs/
(code blocks and inline code) names a subcommand, flags and make targets that exist, and every repository path
the docs name exists in the tree.

The flags are read from the CLIs' own argparse parsers, built in-process once (`builder.cli._parser`,
`client.cli._parser`); the make targets from the Makefile's rules. No server, no subprocess.
"""

from __future__ import annotations

import argparse
import glob
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])

# Paths under these top-level folders are checked; generated outputs (model_repository/, reports/, .run/, .cache/,
# .logs/, site/) are not: the docs name them as what a command writes.
CHECKED_ROOTS = ("bench", "builder", "client", "common", "deploy", "docs", "requirements", "tests", ".ci")
TOP_FILES = ("Makefile", "pyproject.toml", "models.toml", "mkdocs.yml")
TOOLS = ("trtbuild", "perfclient", "make")


@dataclass(frozen=True)
class Command:
    where: str  # file:line
    text: str  # the command, comments and continuation lines joined

    @property
    def tool(self) -> str:
        return self.text.split(maxsplit=1)[0]


@dataclass(frozen=True)
class PathRef:
    where: str
    path: str


# ---------------------------------------------------------------------------------------------------------------
# Extraction


_FENCE = re.compile(r"^\s*```")
_INLINE = re.compile(r"(?<!`)`([^`]+)`(?!`)")
# A command starts at the line's start, after whitespace, a path (`.venv/bin/trtbuild`), `$ `, or a shell
# operator (`&&`, `;`, `|`, `(`); it ends at the next operator.
_COMMAND_START = re.compile(r"(?:^|(?<=[\s/;&|(]))(trtbuild|perfclient|make)\s+(?=[\w\[-])")
_COMMAND_END = re.compile(r"\s*(?:&&|\|\||;|\|(?!\s*\w+\]))")


def _commands_of(line: str) -> list[tuple[int, str]]:
    """(offset, text) of every command a line of shell holds, each cut at the operator that ends it."""
    found = []
    for m in _COMMAND_START.finditer(line):
        rest = line[m.start():]
        end = _COMMAND_END.search(rest, len(m.group(1)))
        found.append((m.start(), rest[: end.start()] if end else rest))
    return found


def _strip_comment(line: str) -> str:
    """Drops a shell comment: `#` at the start or after whitespace (not inside `a#b`)."""
    m = re.search(r"(?:^|\s)#", line)
    return line[: m.start()] if m else line


def _is_continuation(previous: str, line: str) -> bool:
    stripped = line.strip()
    if not stripped:
        return False
    if previous.rstrip().endswith("\\"):
        return True
    # A synopsis's wrapped option lines: indented, starting with an option or a bracket.
    return line[:1].isspace() and (stripped.startswith("[") or stripped.startswith("-"))


def commands_in(text: str, name: str) -> Iterator[Command]:
    """Every trtbuild/perfclient/make command in a markdown text: in fenced code blocks (with wrapped and
    backslash-continued lines) and in inline code spans that start with the command."""
    lines = text.split("\n")
    in_fence = False
    prose: list[tuple[int, str]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if _FENCE.match(line):
            in_fence = not in_fence
            i += 1
            continue
        if not in_fence:
            prose.append((i + 1, line))
            i += 1
            continue
        found = _commands_of(_strip_comment(line))
        if not found:
            i += 1
            continue
        start = i
        for _, text in found[:-1]:  # all but the last end on this line (an operator follows them)
            yield Command(f"{name}:{start + 1}", text.strip())
        parts = [found[-1][1]]
        while i + 1 < len(lines) and not _FENCE.match(lines[i + 1]) and _is_continuation(lines[i], lines[i + 1]):
            i += 1
            parts.append(_strip_comment(lines[i]))
        joined = " ".join(p.strip().rstrip("\\").strip() for p in parts)
        yield Command(f"{name}:{start + 1}", joined)
        i += 1
    # Inline code may wrap across lines inside a paragraph: join each paragraph before matching.
    paragraph: list[tuple[int, str]] = []
    for number, line in [*prose, (0, "")]:
        if line.strip():
            paragraph.append((number, line))
            continue
        if paragraph:
            body = "\n".join(text for _, text in paragraph)
            for span in _INLINE.finditer(body):
                code = " ".join(span.group(1).split())
                at = paragraph[0][0] + body[: span.start()].count("\n")
                if code == "perfclient":
                    yield Command(f"{name}:{at}", code)
                    continue
                # Anywhere in the span: after `$ `, an env-var prefix (`PIP_NO_INDEX=1 make install`), a
                # path (`.venv/bin/trtbuild`) or another command (`make engines && trtbuild serve`).
                for _, text in _commands_of(_strip_comment(code)):
                    yield Command(f"{name}:{at}", text.strip())
        paragraph = []


_PATH = re.compile(
    r"(?<![\w./…-])((?:" + "|".join(re.escape(r) for r in CHECKED_ROOTS) + r")/[\w./*{},@+-]*"
    r"|(?:" + "|".join(re.escape(f) for f in TOP_FILES) + r")(?![\w.]))"
)


def paths_in(text: str, name: str) -> Iterator[PathRef]:
    """Every path under a checked top-level folder (or a top-level project file) that the text names."""
    for number, line in enumerate(text.split("\n"), 1):
        for m in _PATH.finditer(line):
            path = m.group(1).rstrip(".,:;)")
            if path.endswith("/"):
                path = path.rstrip("/")
            yield PathRef(f"{name}:{number}", path)


def _expand_braces(path: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [path]
    return [x for alt in m.group(1).split(",") for x in _expand_braces(path[: m.start()] + alt + path[m.end():])]


def missing_paths(refs: list[PathRef], root: Path = ROOT) -> list[str]:
    problems = []
    for ref in refs:
        for candidate in _expand_braces(ref.path):
            if any(c in candidate for c in "*?["):
                found = glob.glob(str(root / candidate))
            else:
                found = [candidate] if (root / candidate).exists() else []
            if not found:
                problems.append(f"{ref.where}: path {candidate!r} does not exist")
    return problems


# ---------------------------------------------------------------------------------------------------------------
# The CLIs and the Makefile


@dataclass(frozen=True)
class Cli:
    top_options: frozenset[str]
    subcommands: dict[str, frozenset[str]]  # empty: the CLI has none


def _options(parser: argparse.ArgumentParser) -> frozenset[str]:
    return frozenset(s for action in parser._actions for s in action.option_strings)


def _cli(parser: argparse.ArgumentParser) -> Cli:
    subs: dict[str, frozenset[str]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                subs[sub_name] = _options(sub)
    return Cli(_options(parser), subs)


@cache
def clis() -> dict[str, Cli]:
    from builder.cli import _parser as trtbuild_parser
    from client.cli import _parser as perfclient_parser

    return {"trtbuild": _cli(trtbuild_parser()), "perfclient": _cli(perfclient_parser())}


def make_targets(makefile: Path = ROOT / "Makefile") -> frozenset[str]:
    targets: set[str] = set()
    for line in makefile.read_text().split("\n"):
        m = re.match(r"^([A-Za-z0-9_./$()-][^:=#]*?)\s*:(?![=])", line)
        if m and not line.startswith("\t"):
            targets.update(t for t in m.group(1).split() if "$" not in t)
        if line.startswith(".PHONY:"):
            targets.update(line.split(":", 1)[1].split())
    return frozenset(targets)


_FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


def _tokens(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError:  # an unbalanced quote in a synopsis: whitespace is close enough
        return text.split()


def check_command(command: Command, cli_table: dict[str, Cli], targets: frozenset[str]) -> list[str]:
    """The problems of one documented command: an unknown subcommand, flag or make target."""
    where, text = command.where, command.text
    if command.tool == "make":
        problems = []
        tokens = _tokens(text)[1:]
        for index, token in enumerate(tokens):
            if token.startswith("-") or "=" in token or token in ("…", "..."):
                continue
            if index > 0 and tokens[index - 1] in ("-C", "-f", "-j"):  # the option's value, not a target
                continue
            if not re.fullmatch(r"[\w.-]+", token):
                break  # prose or another command after the targets
            if token not in targets:
                problems.append(f"{where}: `{text}`: make target {token!r} is not in the Makefile")
        return problems
    cli = cli_table[command.tool]
    # Drop the values of quoted arguments so that their contents are not read as flags.
    words = " ".join(_tokens(text)[1:]) if "'" in text or '"' in text else text.split(maxsplit=1)[-1]
    known = cli.top_options
    problems = []
    if cli.subcommands:
        sub = next((w for w in re.split(r"[\s\[\]|/]+", words) if w and not w.startswith("-")), None)
        if sub is None:
            return []
        if sub not in cli.subcommands:
            return [f"{where}: `{text}`: {command.tool} has no subcommand {sub!r}"]
        known = known | cli.subcommands[sub]
    for flag in _FLAG.findall(words):
        if flag in known:
            continue
        if re.fullmatch(r"-([A-Za-z])\1+", flag) and f"-{flag[1]}" in known:  # -vv
            continue
        problems.append(f"{where}: `{text}`: {command.tool} has no option {flag}")
    return problems


def problems_in(text: str, name: str, root: Path = ROOT) -> list[str]:
    targets = make_targets(root / "Makefile")
    found = [p for c in commands_in(text, name) for p in check_command(c, clis(), targets)]
    return found + missing_paths(list(paths_in(text, name)), root)


def _doc(path: Path) -> tuple[str, str]:
    return path.read_text(), str(path.relative_to(ROOT))


# ---------------------------------------------------------------------------------------------------------------
# The docs as they are


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_flag_target_and_path_in_the_docs_exists(path: Path) -> None:
    text, name = _doc(path)
    assert problems_in(text, name) == []


def test_the_docs_show_commands_of_every_tool() -> None:
    """The extraction finds what is there (a regex that matched nothing would pass every doc)."""
    found: dict[str, int] = dict.fromkeys(TOOLS, 0)
    subcommands: set[str] = set()
    for path in DOC_FILES:
        for command in commands_in(*_doc(path)):
            found[command.tool] += 1
            if command.tool == "trtbuild":
                subcommands.add(command.text.split()[1])
    assert all(n >= 5 for n in found.values()), found
    assert set(clis()["trtbuild"].subcommands) <= subcommands


def test_the_readme_keeps_the_commands_ci_and_users_rely_on() -> None:
    readme = (ROOT / "README.md").read_text()
    commands = {c.text for c in commands_in(readme, "README.md")}
    assert {"make demo", "make test"} <= commands
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert len(readme.split("\n")) <= 260


def test_the_mkdocs_nav_lists_every_page() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    listed = set(re.findall(r":\s*([\w./-]+\.md)\s*$", nav, re.M))
    assert pages == listed


# ---------------------------------------------------------------------------------------------------------------
# The checker catches drift


def test_a_renamed_flag_is_reported() -> None:
    snippet = "```\ntrtbuild build --onnx m.onnx --calibraton data.npz\n```\n"
    assert problems_in(snippet, "snippet.md") == [
        "snippet.md:2: `trtbuild build --onnx m.onnx --calibraton data.npz`: trtbuild has no option --calibraton"
    ]


def test_a_flag_of_another_subcommand_is_reported() -> None:
    # --calibration exists, but on build, not on serve.
    problems = problems_in("Run `trtbuild serve --calibration x.npz` first.", "snippet.md")
    assert problems == ["snippet.md:1: `trtbuild serve --calibration x.npz`: trtbuild has no option --calibration"]


def test_a_renamed_perfclient_flag_in_a_wrapped_synopsis_is_reported() -> None:
    snippet = "```\nperfclient -m MODEL [-u HOST:PORT]\n           [--concurency N] [--json PATH]\n```\n"
    problems = problems_in(snippet, "snippet.md")
    assert len(problems) == 1 and "perfclient has no option --concurency" in problems[0], problems


def test_an_unknown_subcommand_make_target_and_path_are_reported() -> None:
    snippet = (
        "`trtbuild compile --onnx m.onnx`, then `make engines demo-gpu` "
        "(see `builder/steps/no_such_step.py` and `bench/results/tune_*-1999-*.txt`)."
    )
    problems = problems_in(snippet, "snippet.md")
    assert any("no subcommand 'compile'" in p for p in problems), problems
    assert any("make target 'demo-gpu'" in p for p in problems), problems
    assert any("'builder/steps/no_such_step.py' does not exist" in p for p in problems), problems
    assert any("'bench/results/tune_*-1999-*.txt' does not exist" in p for p in problems), problems
    assert not any("'engines'" in p for p in problems), problems


def test_what_exists_is_not_reported() -> None:
    snippet = (
        "```\n$ make demo    # the demo\nmake install GPU=1\ntrtbuild -v engines --only efficientnet_lite0 -q\n"
        "perfclient -m a -m b --concurrency 8 \\\n  --json out.json   # a comment --not-a-flag\n```\n"
        "`bench/gpu/results/2026-11-22-h100-c{64,32}-tune-energy.{json,md,report.json}`, "
        "`trtbuild build --tolerance fp16:cosine_min=0.998` and `reports/gpu/none.json` (generated).\n"
    )
    assert problems_in(snippet, "snippet.md") == []


def test_the_commands_extracted_from_a_block() -> None:
    snippet = "```\ntrtbuild serve [--background]\n               [--http-port 8000]  # note\ntrtbuild stop\n```\n"
    assert [c.text for c in commands_in(snippet, "s.md")] == [
        "trtbuild serve [--background] [--http-port 8000]",
        "trtbuild stop",
    ]


def test_a_flag_renamed_in_the_code_is_reported_where_the_docs_use_it() -> None:
    """The check reads the CLIs' parsers: with `--calibration` renamed in `trtbuild build`'s parser (a copy of
    the real table here), every place README.md and docs/ show it is reported."""
    real = clis()["trtbuild"]
    renamed = Cli(real.top_options, {**real.subcommands,
                                     "build": (real.subcommands["build"] - {"--calibration"}) | {"--calibration-data"}})
    table = {**clis(), "trtbuild": renamed}
    targets = make_targets()
    found = [p for path in DOC_FILES for c in commands_in(*_doc(path)) for p in
             check_command(c, table, targets)]
    assert found and all("has no option --calibration" in p for p in found), found
    assert any(p.startswith("README.md:") for p in found), found


def test_commands_after_a_path_an_env_prefix_an_operator_or_make_options_are_checked() -> None:
    snippet = (
        "```\nmake engines && trtbuild serve --bogus-a\nmake -C somewhere no-such-target\n```\n"
        "Then `PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/w make no-such-install`, `.venv/bin/trtbuild build --bogus-b` and "
        "`$ perfclient --bogus-c`.\n"
    )
    problems = problems_in(snippet, "snippet.md")
    for wanted in ("--bogus-a", "'no-such-target'", "'no-such-install'", "--bogus-b", "--bogus-c"):
        assert any(wanted in p for p in problems), (wanted, problems)
    assert not any("'somewhere'" in p or "'engines'" in p for p in problems), problems
