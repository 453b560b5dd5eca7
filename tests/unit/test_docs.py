"""The documentation is kept true by tests: every ``--flag`` it writes exists in the parser of
the command it is written for, every relative link and image resolves, the README's Python
example runs, and the README stays a first page (at most 160 lines).

Which command a ``--flag`` belongs to (the rule the flag tests apply):

* Pages: README.md, CONTRIBUTING.md, scripts/slurm/README.md and docs/*.md (the CHANGELOG keeps
  history, old flags included, and is not checked).
* Commands are recognised by name: ``bfpp-train``, ``bfpp-sim``, ``bfpp-plan`` (with its
  subcommand ``recommend``, ``auto``, ``profile`` or ``bpipe-estimate`` when one follows), the
  Megatron-LM launcher (``megatron_bfpp.launch``, ``pretrain_gpt.py``, the sbatch templates, or
  the word ``Megatron-LM``), ``torchrun``, the SLURM launcher ``scripts/slurm/launch.py`` and the
  Megatron-Bridge example ``examples/bridge_pretrain.py``. Other
  programs are recognised so that their flags are left alone: ``scripts/*.py`` and
  ``scripts/*.sh`` (benchmarks, setup), ``pip install``, ``git``, ``patch -p1``, ``ruff``,
  ``pytest``, ``mypy``.
* In a fenced code block (``python`` blocks excepted) each command line, with its backslash
  continuations, is read left to right: a flag belongs to the last command named before it on
  the line; after the SLURM launcher's ``--`` the flags are Megatron-LM's. A line that names no
  command belongs to the block's previous command, else to the page's subject.
* In prose, an inline code span that names a command is read the same way. Any other flag
  belongs to the command named nearest to it (by characters, the earlier one on a tie) in the
  same paragraph (the lines between blank lines; a list item, a table row and a heading are
  paragraphs of their own), else to the command the nearest heading above it names (a heading
  rules until the next one of its level or higher; one naming several commands names none, or
  ``bfpp-plan`` for several of its subcommands), else to the page's subject (``SUBJECTS``),
  else to any of the commands. Code blocks without a command use the same subject.
* Megatron-LM's flags are the plugin's (``megatron_bfpp.megatron.arguments``) and
  ``megatron.training.arguments``'s, read in a subprocess. megatron-core 0.16 wheels do not ship
  ``megatron.training`` (``MEGATRON_LM_PATH`` names a checkout to read it from instead); without
  it the Megatron-LM test skips, naming the flags it could not check, and the plugin's flags are
  still checked by the first test.
"""

from __future__ import annotations

import argparse
import fnmatch
import functools
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
README_MAX_LINES = 160

FLAG_PAGES = ("README.md", "CONTRIBUTING.md", "scripts/slurm/README.md", "docs/*.md")
LINK_PAGES = (*FLAG_PAGES, "CHANGELOG.md", "patches/README.md")
# A page about one command: flags in its prose that no nearer command claims are that command's.
SUBJECTS = {
    "docs/train.md": "bfpp-train",
    "docs/simulator.md": "bfpp-sim",
    "docs/planner.md": "bfpp-plan",
    "docs/megatron-lm.md": "megatron",
    "scripts/slurm/README.md": "megatron",
    "docs/bridge.md": "examples/bridge_pretrain.py",
}

MEGATRON = "megatron"  # the Megatron-LM launcher: Megatron-LM's flags plus the plugin's
TORCHRUN = "torchrun"
SLURM = "scripts/slurm/launch.py"
BRIDGE_EXAMPLE = "examples/bridge_pretrain.py"
OTHER = "other"  # a program whose flags are not ours to check
PLAN_SUBCOMMANDS = ("recommend", "auto", "profile", "bpipe-estimate")

_COMMAND = re.compile(
    r"(?P<plan_sub>(?<![\w-])bfpp-plan\s+(?:recommend|auto|profile|bpipe-estimate)(?![\w-]))"
    r"|(?P<bfpp>(?<![\w-])bfpp-(?:train|sim|plan)(?![\w-]))"
    r"|(?P<slurm>(?<![\w.-])(?:scripts/slurm/)?launch\.py)"
    r"|(?P<megatron>megatron_bfpp\.launch(?![\w.])|pretrain_gpt\.py|pretrain_(?:gpt3|llama)\.sbatch"
    r"|(?<![\w/-])Megatron-LM(?![\w/-]))"
    r"|(?P<torchrun>(?<![\w-])torchrun(?![\w-]))"
    r"|(?P<example>(?<![\w/.-])(?:examples/)?bridge_pretrain\.py)"
    r"|(?P<other>(?<![\w/.-])scripts/[\w/.-]+\.(?:py|sh)\b|\bpip\s+install\b|\bgit\s+\w"
    r"|\bpatch\s+-p|\bruff\b|\bpytest\b|\bmypy\b)"
)
_FLAG = re.compile(r"(?<![\w-])--[A-Za-z*][\w*-]*")
_FENCE = re.compile(r"^\s*(```|~~~)")
_NEW_PARAGRAPH = re.compile(r"^\s*(?:[*+-]|\d+[.)])\s|^\s*\||^#")
_CODE_SPAN = re.compile(r"`[^`]+`")


@dataclass(frozen=True)
class Flag:
    page: str
    line: int
    flag: str
    command: str | None  # None: no command and no subject; any of ours will do

    def where(self) -> str:
        return f"{self.page}:{self.line}: {self.flag}"


@dataclass(frozen=True)
class _Mention:
    start: int
    end: int
    command: str


def _command_name(match: re.Match[str]) -> str:
    kind = match.lastgroup
    text = match.group()
    if kind == "plan_sub":
        return "bfpp-plan " + text.split()[-1]
    if kind == "bfpp":
        return text
    if kind == "slurm":
        return SLURM
    if kind == "megatron":
        return MEGATRON
    if kind == "torchrun":
        return TORCHRUN
    if kind == "example":
        return BRIDGE_EXAMPLE
    return OTHER


def _mentions(text: str) -> list[_Mention]:
    return [_Mention(m.start(), m.end(), _command_name(m)) for m in _COMMAND.finditer(text)]


def _command_line_flags(text: str, command: str | None) -> Iterator[tuple[int, str, str | None]]:
    """(offset, flag, command) of a command line or code span, read left to right; ``command``
    is the one in force at its start."""
    events = [(m.start, "command", m.command) for m in _mentions(text)]
    events += [(m.start(), "flag", m.group()) for m in _FLAG.finditer(text)]
    events += [(m.start(), "separator", "") for m in re.finditer(r"(?<=\s)--(?=\s|$)", text)]
    for offset, kind, value in sorted(events):
        if kind == "command":
            command = value
        elif kind == "separator":
            if command == SLURM:
                command = MEGATRON
        else:
            yield offset, value, command


def _line_of(offsets: list[int], offset: int) -> int:
    """Index of the line (in a list of line-start offsets) holding ``offset``."""
    low, high = 0, len(offsets) - 1
    while low < high:
        middle = (low + high + 1) // 2
        if offsets[middle] <= offset:
            low = middle
        else:
            high = middle - 1
    return low


def doc_flags(page: str, text: str) -> list[Flag]:
    """Every ``--flag`` written on ``page`` (its text given), with the command it belongs to."""
    flags: list[Flag] = []
    paragraph: list[tuple[int, str]] = []  # (line number, text)
    headings: list[tuple[int, str | None]] = []  # (level, command its heading names)

    def subject() -> str | None:
        named = [command for _, command in headings if command is not None]
        return named[-1] if named else SUBJECTS.get(page)

    def flush() -> None:
        if paragraph:
            flags.extend(_prose_flags(page, paragraph, subject()))
            paragraph.clear()

    in_fence = False
    language = ""
    block: list[tuple[int, str]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line):
            if in_fence:
                if language != "python":
                    flags.extend(_block_flags(page, block, subject()))
                block = []
                in_fence = False
            else:
                flush()
                in_fence = True
                language = line.strip().lstrip("`~").strip().lower()
            continue
        if in_fence:
            block.append((number, line))
            continue
        if not line.strip():
            flush()
            continue
        heading = re.match(r"^(#{1,6})\s", line)
        if heading:
            flush()
            level = len(heading.group(1))
            headings = [(lvl, command) for lvl, command in headings if lvl < level]
            headings.append((level, _heading_command(line)))
        elif _NEW_PARAGRAPH.match(line):
            flush()
        paragraph.append((number, line))
        if line.lstrip().startswith(("|", "#")):
            flush()
    flush()
    return flags


def _heading_command(line: str) -> str | None:
    """The command a heading is about: the one it names (``bfpp-plan`` for several of its
    subcommands); ``None`` for none or several."""
    named = {mention.command for mention in _mentions(line)} - {OTHER}
    if len(named) == 1:
        return named.pop()
    if named and all(command.startswith("bfpp-plan") for command in named):
        return "bfpp-plan"
    return None


def _block_flags(page: str, block: list[tuple[int, str]], subject: str | None) -> list[Flag]:
    flags: list[Flag] = []
    previous = subject
    logical: list[tuple[int, str]] = []
    for number, line in [*block, (0, "")]:
        logical.append((number, line))
        if line.rstrip().endswith("\\") and number:
            continue
        starts = [sum(len(text) + 1 for _, text in logical[:i]) for i in range(len(logical))]
        joined = "\n".join(text for _, text in logical)
        command = previous
        for offset, flag, owner in _command_line_flags(joined, command):
            number_at = logical[_line_of(starts, offset)][0]
            flags.append(Flag(page, number_at, flag, owner))
        named = _mentions(joined)
        if named:
            previous = named[-1].command
        logical = []
    return flags


def _prose_flags(page: str, paragraph: list[tuple[int, str]], subject: str | None) -> list[Flag]:
    text = "\n".join(line for _, line in paragraph)
    starts = [sum(len(line) + 1 for _, line in paragraph[:i]) for i in range(len(paragraph))]
    flags: list[Flag] = []
    claimed: set[int] = set()
    for span in _CODE_SPAN.finditer(text):
        if not _mentions(span.group()):
            continue
        for offset, flag, owner in _command_line_flags(span.group(), None):
            where = span.start() + offset
            claimed.add(where)
            flags.append(Flag(page, paragraph[_line_of(starts, where)][0], flag, owner))
    mentions = _mentions(text)
    for match in _FLAG.finditer(text):
        if match.start() in claimed:
            continue

        def distance(mention: _Mention, match: re.Match[str] = match) -> tuple[int, int]:
            if mention.end <= match.start():
                return match.start() - mention.end, 0
            return max(mention.start - match.end(), 0), 1

        owner = min(mentions, key=distance).command if mentions else subject
        flags.append(
            Flag(page, paragraph[_line_of(starts, match.start())][0], match.group(), owner)
        )
    return flags


def _pages(patterns: tuple[str, ...]) -> list[Path]:
    pages: list[Path] = []
    for pattern in patterns:
        pages.extend(sorted(ROOT.glob(pattern)))
    return [page for page in pages if page.is_file()]


def _relative(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


# ---------------------------------------------------------------------------- the parsers


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for flag in parser._option_string_actions if flag.startswith("--")}


@functools.cache
def our_parsers() -> dict[str, set[str]]:
    """The flags of every command whose parser lives in this repository (torch-free)."""
    from megatron_bfpp.cli import plan, sim, train
    from megatron_bfpp.megatron.arguments import add_schedule_arguments

    parsers = {
        "bfpp-train": _option_strings(train.build_parser()),
        "bfpp-sim": _option_strings(sim.build_parser()),
        "plugin": _option_strings(add_schedule_arguments(argparse.ArgumentParser())),
    }
    plan_parser = plan.build_parser()
    top = _option_strings(plan_parser)
    (commands,) = [
        action for action in plan_parser._actions if isinstance(action, argparse._SubParsersAction)
    ]
    assert set(commands.choices) == set(PLAN_SUBCOMMANDS), "bfpp-plan's subcommands changed"
    every = set(top)
    for name, subparser in commands.choices.items():
        parsers[f"bfpp-plan {name}"] = top | _option_strings(subparser)
        every |= _option_strings(subparser)
    parsers["bfpp-plan"] = every
    help_text = subprocess.run(
        [sys.executable, str(ROOT / SLURM), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    parsers[SLURM] = set(_FLAG.findall(help_text))
    parsers[BRIDGE_EXAMPLE] = _option_strings(_load(BRIDGE_EXAMPLE).build_parser())
    return parsers


def _load(path: str) -> Any:
    """A script of the repository as a module (its parser is built without running it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_EXTERNAL = r"""
import argparse, json, os, sys
found = {}
from torch.distributed.run import get_args_parser
found["torchrun"] = sorted(get_args_parser()._option_string_actions)
checkout = os.environ.get("MEGATRON_LM_PATH")
if checkout:
    sys.path.insert(0, checkout)
try:
    from megatron.training.arguments import add_megatron_arguments
except ImportError as error:
    found["megatron"] = None
    found["why"] = f"{type(error).__name__}: {error}"
else:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    found["megatron"] = sorted(parser._option_string_actions)
print("FLAGS " + json.dumps(found))
"""


@functools.cache
def external_parsers() -> dict[str, object]:
    """torchrun's flags and Megatron-LM's own (``None`` with a reason when megatron.training is
    missing), read in a fresh interpreter: importing megatron.training has side effects."""
    result = subprocess.run(
        [sys.executable, "-c", _EXTERNAL],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("FLAGS ")]
    assert lines, f"could not read torchrun's / Megatron-LM's parsers:\n{result.stderr[-3000:]}"
    found: dict[str, object] = json.loads(lines[-1][len("FLAGS ") :])
    return found


def _exists(flag: str, known: set[str]) -> bool:
    if "*" in flag:
        return any(fnmatch.fnmatchcase(option, flag) for option in known)
    return flag in known


def flag_problems(flags: list[Flag], parsers: dict[str, set[str]]) -> list[str]:
    """The flags that their command's parser does not know. Megatron-LM's own flags, and flags
    that no command claims and none of ours knows, are judged only when ``parsers`` holds
    Megatron-LM's (``parsers[MEGATRON]``; the plugin's are ``parsers["plugin"]``)."""
    problems = []
    with_megatron = MEGATRON in parsers
    every = set().union(*parsers.values())
    for flag in flags:
        if flag.command == OTHER:
            continue
        if flag.command is None:
            known, name = every, "any command"
        elif flag.command == MEGATRON:
            known, name = parsers["plugin"] | parsers.get(MEGATRON, set()), "Megatron-LM"
        else:
            known, name = parsers[flag.command], flag.command
        if _exists(flag.flag, known):
            continue
        if flag.command in (None, MEGATRON) and not with_megatron:
            continue  # Megatron-LM's own flags: test_megatron_lm_flags_exist
        problems.append(f"{flag.where()} is not a flag of {name}")
    return problems


def _all_doc_flags() -> list[Flag]:
    flags: list[Flag] = []
    for page in _pages(FLAG_PAGES):
        flags.extend(doc_flags(_relative(page), page.read_text(encoding="utf-8")))
    return flags


def test_every_written_flag_exists_in_its_commands_parser() -> None:
    parsers = dict(our_parsers())
    torchrun = external_parsers()["torchrun"]
    assert isinstance(torchrun, list)
    parsers[TORCHRUN] = set(torchrun)
    flags = _all_doc_flags()
    assert len(flags) > 100, "the pages lost their flags, or the reader lost the pages"
    problems = flag_problems(flags, parsers)
    assert not problems, "\n".join(problems)


def test_megatron_lm_flags_exist() -> None:
    """Megatron-LM's flags, and the flags no command claims (checked against every parser)."""
    found = external_parsers()
    flags = [flag for flag in _all_doc_flags() if flag.command in (MEGATRON, None)]
    megatron = found["megatron"]
    if megatron is None:
        ours = set().union(*our_parsers().values())
        unchecked = sorted({flag.flag for flag in flags if not _exists(flag.flag, ours)})
        pytest.skip(
            f"megatron.training is not importable ({found.get('why')}; megatron-core 0.16 wheels "
            "do not ship it: set MEGATRON_LM_PATH to a checkout): Megatron-LM's own flags left "
            f"unchecked: {' '.join(unchecked)} (the plugin's are checked by "
            "test_every_written_flag_exists_in_its_commands_parser)"
        )
    assert isinstance(megatron, list)
    torchrun = found["torchrun"]
    assert isinstance(torchrun, list)
    parsers = {**our_parsers(), TORCHRUN: set(torchrun), MEGATRON: set(megatron)}
    assert len(flags) > 20
    problems = flag_problems(flags, parsers)
    assert not problems, "\n".join(problems)


def test_flag_attribution_follows_the_documented_rule() -> None:
    text = (
        "Run `bfpp-sim --pp 4` or `torchrun --nnodes 2 -m megatron_bfpp.launch pretrain_gpt.py "
        "--lr 1`.\nbfpp-train takes `--save`.\n\n* in a list, Megatron-LM's `--vp`\n\n"
        "```bash\npython scripts/slurm/launch.py --dry-run -- --pipeline-schedule 1f1b \\\n"
        "    --seed 1\nbfpp-plan profile --top 3\n    --json\n```\n\n`--orphan`\n"
        "## On `bfpp-train`\n### Deeper\nIts `--seed`.\n## Other\nAnd `--json`.\n"
        "## `bfpp-plan recommend` and `bfpp-plan profile`\n`--top`\n"
    )
    got = [(f.line, f.flag, f.command) for f in doc_flags("docs/simulator.md", text)]
    assert got == [
        (1, "--pp", "bfpp-sim"),
        (1, "--nnodes", TORCHRUN),
        (1, "--lr", MEGATRON),
        (2, "--save", "bfpp-train"),
        (4, "--vp", MEGATRON),
        (7, "--dry-run", SLURM),
        (7, "--pipeline-schedule", MEGATRON),
        (8, "--seed", MEGATRON),
        (9, "--top", "bfpp-plan profile"),
        (10, "--json", "bfpp-plan profile"),
        (13, "--orphan", "bfpp-sim"),
        (16, "--seed", "bfpp-train"),
        (18, "--json", "bfpp-sim"),
        (20, "--top", "bfpp-plan"),
    ]
    parsers = {"bfpp-sim": {"--pp"}, "plugin": set()}
    wrong = [Flag("x.md", 3, "--nope", "bfpp-sim"), Flag("x.md", 4, "--t-*", "bfpp-sim")]
    unclaimed = [Flag("x.md", 5, "--mock-data", None), Flag("x.md", 6, "--pp", None)]
    megatron = [Flag("x.md", 7, "--mock-data", MEGATRON), Flag("x.md", 8, "--nope", MEGATRON)]
    assert flag_problems(wrong + unclaimed + megatron, parsers) == [
        "x.md:3: --nope is not a flag of bfpp-sim",
        "x.md:4: --t-* is not a flag of bfpp-sim",
    ]  # Megatron-LM's flags wait for its parser
    with_megatron = {**parsers, MEGATRON: {"--mock-data"}}
    assert flag_problems(unclaimed + megatron, with_megatron) == [
        "x.md:8: --nope is not a flag of Megatron-LM"
    ]


# ---------------------------------------------------------------------------- links


def github_slugs(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of a page: lower case, punctuation but ``-`` and
    ``_`` dropped, spaces as ``-``, a repeated slug suffixed ``-1``, ``-2``, ..."""
    slugs: set[str] = set()
    counts: dict[str, int] = {}
    for line in _outside_fences(markdown):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1))
        slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
        seen = counts.get(slug, 0)
        counts[slug] = seen + 1
        slugs.add(slug if seen == 0 else f"{slug}-{seen}")
    return slugs


def _outside_fences(markdown: str) -> Iterator[str]:
    in_fence = False
    for line in markdown.splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            yield line


_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
_HTML = re.compile(r"<(?:img|a)\s[^>]*?(?:src|href)=\"([^\"]+)\"", re.IGNORECASE)


def link_problems(page: str, text: str, root: Path = ROOT) -> list[str]:
    """Relative links and images of ``page`` (its text given) whose file, or heading, is
    missing."""
    problems = []
    base = (root / page).parent
    for number, line in enumerate(text.splitlines(), start=1):
        if _FENCE.match(line):
            continue
        visible = _CODE_SPAN.sub("", line)
        targets = [m.group(1) for pattern in (_LINK, _HTML) for m in pattern.finditer(visible)]
        reference = _REFERENCE.match(visible)
        if reference:
            targets.append(reference.group(1))
        for target in targets:
            if re.match(r"^[a-zA-Z][\w+.-]*:|^//", target):
                continue  # https:, mailto:, ...
            path, _, anchor = target.partition("#")
            file = (base / path).resolve() if path else (root / page)
            if not file.exists():
                problems.append(f"{page}:{number}: {target}: no such file")
                continue
            if (
                anchor
                and file.suffix == ".md"
                and file.is_file()
                and anchor.lower() not in github_slugs(file.read_text(encoding="utf-8"))
            ):
                problems.append(f"{page}:{number}: {target}: no such heading")
    return problems


def _outside_code_blocks(text: str) -> str:
    """The page with its fenced blocks blanked (line numbers kept)."""
    out, in_fence = [], False
    for line in text.splitlines():
        fence = _FENCE.match(line)
        out.append("" if in_fence or fence else line)
        if fence:
            in_fence = not in_fence
    return "\n".join(out)


def test_every_relative_link_and_image_resolves() -> None:
    problems = []
    pages = _pages(LINK_PAGES)
    assert len(pages) >= 8
    for page in pages:
        text = _outside_code_blocks(page.read_text(encoding="utf-8"))
        problems.extend(link_problems(_relative(page), text))
    assert not problems, "\n".join(problems)


def test_github_slugs_and_link_problems() -> None:
    page = (
        "# Timelines at pp=4, m=8\n## Split backward (I and W) at runtime\n"
        "## A `code_span`\n## A\n## A\n"
    )
    assert github_slugs(page) == {
        "timelines-at-pp4-m8",
        "split-backward-i-and-w-at-runtime",
        "a-code_span",
        "a",
        "a-1",
    }
    text = (
        "[ok](README.md) [gone](no/such.md) ![pic](docs/images/none.png) [h](#nowhere) "
        "[w](https://x.org)\n"
    )
    assert link_problems("README.md", text) == [
        "README.md:1: no/such.md: no such file",
        "README.md:1: docs/images/none.png: no such file",
        "README.md:1: #nowhere: no such heading",
    ]


# ---------------------------------------------------------------------------- the README


def python_examples(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.DOTALL | re.MULTILINE)


def test_the_readmes_python_example_runs(tmp_path: Path) -> None:
    examples = python_examples(README.read_text(encoding="utf-8"))
    assert examples, "README.md has no ```python example"
    for index, example in enumerate(examples):
        script = tmp_path / f"example_{index}.py"
        script.write_text(example, encoding="utf-8")
        result = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env={**os.environ, "MPLBACKEND": "Agg"},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert result.returncode == 0, f"README example {index}:\n{result.stderr[-4000:]}"


def test_the_readme_is_a_first_page() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
    text = "\n".join(lines)
    assert "bash scripts/test.sh" in text  # CI's command (.ci/run), as a user types it
    assert "bash scripts/quickstart.sh" in text


def test_the_readme_says_what_the_first_run_needs() -> None:
    """The quick start's "about 10 s" hid the first set-up (minutes, gigabytes of CUDA torch),
    and the Megatron-LM command assumed an activated environment and a checkout in
    ``MEGATRON_LM`` without saying how to get either."""
    text = " ".join(README.read_text(encoding="utf-8").split())
    quick_start = text[text.index("about 10 s") : text.index("<!-- megatron-lm-cpu-command -->")]
    assert re.search(r"about \d+ minutes and [\d.]+ GB", quick_start), quick_start
    assert ". .venv/bin/activate" in quick_start
    assert re.search(r"git clone [^`]*https://github.com/NVIDIA/Megatron-LM", quick_start)
    assert "export MEGATRON_LM=" in quick_start


def test_no_page_prints_a_machines_paths() -> None:
    """Paths like one machine's pyenv interpreter say nothing to a reader elsewhere."""
    found = [
        f"{_relative(page)}:{number}: {line.strip()}"
        for page in _pages(LINK_PAGES)
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1)
        if re.search(r"(?<![\w.])/(?:root|home/\w+|work|tmp/pytest)/|\.pyenv/versions/", line)
    ]
    assert not found, "\n".join(found)


KEEP_A_CHANGELOG = ("Added", "Changed", "Deprecated", "Removed", "Fixed", "Security")


def changelog_problems(text: str) -> list[str]:
    """Keep a Changelog 1.1.0: ``## [Unreleased]`` first, then ``## [version] - YYYY-MM-DD``
    sections, newest first, each with the six headings at most once."""
    problems = []
    versions = re.findall(r"^## (.*)$", text, re.MULTILINE)
    if not versions or versions[0] != "[Unreleased]":
        problems.append("the first section is not ## [Unreleased]")
    for version in versions[1:]:
        if not re.fullmatch(r"\[\d+\.\d+\.\d+(?:[-.]?\w+)?\] - \d{4}-\d{2}-\d{2}", version):
            problems.append(f"## {version}: not '[version] - YYYY-MM-DD'")
    for section in re.split(r"^## ", text, flags=re.MULTILINE)[1:]:
        name = section.splitlines()[0]
        headings = re.findall(r"^### (.*)$", section, re.MULTILINE)
        for heading in headings:
            if heading not in KEEP_A_CHANGELOG:
                problems.append(f"## {name}: ### {heading} is not a Keep a Changelog heading")
            elif headings.count(heading) > 1:
                problems.append(f"## {name}: ### {heading} appears {headings.count(heading)} times")
    return sorted(set(problems))


def test_the_changelog_keeps_one_section_per_version() -> None:
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert not changelog_problems(text)
    from megatron_bfpp import __version__

    released = re.findall(r"^## \[([^\]]+)\] - ", text, re.MULTILINE)
    assert released and released[0] == __version__, "the newest section is not the package's"
    bad = "## [Unreleased]\n### Added\n### Known gaps\n### Added\n## [1.0] - today\n"
    assert changelog_problems(bad) == [
        "## [1.0] - today: not '[version] - YYYY-MM-DD'",
        "## [Unreleased]: ### Added appears 2 times",
        "## [Unreleased]: ### Known gaps is not a Keep a Changelog heading",
    ]


def test_the_architecture_page_names_every_module() -> None:
    """docs/architecture.md's repository layout names every module of the package."""
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    missing = []
    for module in sorted((ROOT / "megatron_bfpp").rglob("*.py")):
        if module.name == "__init__.py" or "__pycache__" in module.parts:
            continue
        relative = module.relative_to(ROOT / "megatron_bfpp").as_posix()
        if not re.search(rf"(?<![\w.]){re.escape(module.name)}\b", page) and relative not in page:
            missing.append(relative)
    assert not missing, f"docs/architecture.md does not name: {', '.join(missing)}"
