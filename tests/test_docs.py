"""The docs against the code: every command, flag and file the README and the docs name
exists, so that a rename or a removal cannot leave a stale line behind."""

from __future__ import annotations

import argparse
import glob
import itertools
import re
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


DOCS = ("README.md", "docs/**/*.md", "examples/*.md", "loadtests/*.md")
# A command's words run to the end of its code span, shell comment or table cell.
STREAMWORLD_COMMAND = r"(?<![\w/.-])streamworld ([a-z][\w-]*)([^`\n#|]*)"
SCRIPT_COMMAND = (
    r"python3? (?:-m )?((?:benchmarks|examples|loadtests)[/.][\w/]+?)(?:\.py)?(\s[^`\n#|]*|(?=[`#|]|$))"
)


def _doc_files() -> list[Path]:
    return [path for pattern in DOCS for path in sorted(ROOT.glob(pattern))]


def _commands(text: str, pattern: str) -> list[tuple[int, str, str]]:
    """Each match of `pattern` (two groups: the program, the rest) in a Markdown text, as
    (its line, group 1, group 2), a shell command continued over lines read as one."""
    found, lines = [], text.splitlines()
    n = 0
    while n < len(lines):
        first, line = n + 1, lines[n]
        while line.endswith("\\") and n + 1 < len(lines):
            n += 1
            line = line[:-1] + " " + lines[n].strip()
        found += [(first, m.group(1), m.group(2)) for m in re.finditer(pattern, line)]
        n += 1
    return found


def _flags(words: list[str]) -> list[str]:
    """The `--flags` among a command's words, up to a `--` after which they go to another
    program."""
    if "--" in words:
        words = words[: words.index("--")]
    return [w.split("=")[0].rstrip(".,;:)'\"") for w in words if w.startswith("--") and len(w) > 2]


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """A parser's option strings, and those of its subcommands."""
    options = set(parser._option_string_actions)
    for sub in _subcommands(parser).values():
        options |= _options(sub)
    return options


def test_the_docs_name_only_flags_their_commands_have():
    """Every `--flag` the docs write after a `streamworld` command is one that command (or
    its subcommand) accepts."""
    from streamworld.cli import build_parser

    commands = _subcommands(build_parser())
    checked, unknown = 0, []
    for path in _doc_files():
        for line, command, rest in _commands(path.read_text(), STREAMWORLD_COMMAND):
            parser = commands.get(command)
            if parser is None:
                continue  # prose ("streamworld serves ...")
            words = rest.split()
            while words and words[0] in _subcommands(parser):
                parser = _subcommands(parser)[words.pop(0)]
            for flag in _flags(words):
                checked += 1
                if flag not in parser._option_string_actions:
                    unknown.append(f"{path.relative_to(ROOT)}:{line}: streamworld {command} {flag}")
    assert checked > 500, "the docs' commands were not found"
    assert not unknown, "flags the commands do not have:\n" + "\n".join(unknown)


def test_the_docs_name_only_scripts_that_exist_with_flags_they_have(monkeypatch):
    """The same for `python benchmarks/X.py`, `python examples/X.py` and
    `python -m loadtests.X`: the script exists and takes each flag written after it. Each
    script runs as `__main__` until it builds its parser, which is then read instead of
    parsing anything."""

    class Built(Exception):
        pass

    def read_instead(parser, *args, **kwargs):
        raise Built(parser)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", read_instead)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", read_instead)
    monkeypatch.chdir(ROOT)

    def options_of(script: str) -> set[str]:
        monkeypatch.setattr(sys, "argv", [script])
        monkeypatch.setattr(sys, "path", [str(ROOT / Path(script).parent), str(ROOT), *sys.path])
        try:
            if script.startswith("loadtests/"):
                runpy.run_module(script.removesuffix(".py").replace("/", "."), run_name="__main__")
            else:
                runpy.run_path(script, run_name="__main__")
        except Built as built:
            return _options(built.args[0])
        raise AssertionError(f"{script} ran to its end without building a parser")

    options, checked, unknown = {}, 0, []
    for path in _doc_files():
        for line, name, rest in _commands(path.read_text(), SCRIPT_COMMAND):
            script = name.replace(".", "/") + ".py"
            if not (ROOT / script).is_file():
                unknown.append(f"{path.relative_to(ROOT)}:{line}: no script {script}")
                continue
            if script not in options:
                options[script] = options_of(script)
            for flag in _flags(rest.split()):
                checked += 1
                if flag not in options[script]:
                    unknown.append(f"{path.relative_to(ROOT)}:{line}: {script} {flag}")
    assert len(options) > 10 and checked > 100, "the docs' scripts were not found"
    assert not unknown, "scripts or flags that do not exist:\n" + "\n".join(unknown)


def test_the_docs_command_reader_finds_commands_in_code_tables_and_continuations():
    text = (
        "Run `streamworld eval pusht --plan --seeds 0-4` or\n"
        "```bash\nstreamworld train pusht --data D \\\n    --compile   # a comment --not-a-flag\n```\n"
        "| `streamworld serve --port 0` | --cell |\nstreamworld serves streams.\n"
        "python benchmarks/plan_cost.py --json x -- --other; `python -m loadtests.run`\n"
    )
    assert _commands(text, STREAMWORLD_COMMAND) == [
        (1, "eval", " pusht --plan --seeds 0-4"),
        (3, "train", " pusht --data D  --compile   "),
        (6, "serve", " --port 0"),
        (7, "serves", " streams."),
    ]
    assert _commands(text, SCRIPT_COMMAND) == [
        (8, "benchmarks/plan_cost", " --json x -- --other; "),
        (8, "loadtests.run", ""),
    ]
    assert _flags(["--json", "x", "--", "--other;"]) == ["--json"]


# A path the docs name: under a top folder of the repository, with `*` globs and `{a,b}`
# alternatives as a shell expands them.
REPO_PATH = (
    r"(?<![\w/.-])((?:docs|benchmarks|examples|loadtests|streamworld|tests|web|\.ci)/[\w./*{},-]*[\w/*}])"
)


def _expand(path: str) -> list[str]:
    """A path's `{a,b}` alternatives, as the shell expands them."""
    parts = re.split(r"\{([^{}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def test_the_files_the_docs_name_exist():
    checked, missing = 0, []
    for doc in _doc_files():
        for line_no, line in enumerate(doc.read_text().splitlines(), 1):
            for m in re.finditer(REPO_PATH, line):
                for path in _expand(m.group(1)):
                    checked += 1
                    if not glob.glob(str(ROOT / path)):
                        missing.append(f"{doc.relative_to(ROOT)}:{line_no}: {path}")
    assert checked > 300, "the docs' paths were not found"
    assert not missing, "files the docs name that do not exist:\n" + "\n".join(missing)


def test_paths_expand_as_the_shell_does():
    assert _expand("docs/benchmarks/a-{1,2}step-{x,y}.json") == [
        "docs/benchmarks/a-1step-x.json",
        "docs/benchmarks/a-1step-y.json",
        "docs/benchmarks/a-2step-x.json",
        "docs/benchmarks/a-2step-y.json",
    ]
    assert [
        m.group(1) for m in re.finditer(REPO_PATH, "(`docs/pusht.md`, and docs/benchmarks/x-{a,b}.json).")
    ] == [
        "docs/pusht.md",
        "docs/benchmarks/x-{a,b}.json",
    ]
