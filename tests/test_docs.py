"""The command lines of README.md and docs/*.md: every one that runs a script of this repo
(`python recipes/x.py`, `accelerate launch ... recipes/x.py`, `torchrun ... recipes/x.py`,
`sbatch launch/x.sbatch recipes/x.py ...`, `python bench/x.py`, or a bare `grpo.py --flag` in
prose) names a script that exists and only flags that script accepts, with a value among a choice
flag's choices. Parsed, never run: a recipe's flags come from its tyro `Args` dataclass (each recipe
imported once), a bench script's from its argparse calls (read, not imported).

A command is a line of a fenced or indented code block (lines ending in a backslash joined, a ` #`
comment dropped, a leading `$ ` prompt dropped) or an inline code span of the prose that starts
with a launcher. Only the words after the script are checked: the launcher's own flags come
before it. `cp recipes/grpo.py recipes/my_algo.py` in a page makes my_algo.py a name for
grpo.py in that page; `recipes/<recipe>.py` stands for every RL recipe."""

import ast
import contextlib
import importlib.util
import io
import re
import shlex
import sys
import types
import typing
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import tyro
from conftest import RL_RECIPES, ROOT

from common.config import flag_types
from common.flags import _flags as flag_fields_of
from common.formats.verl import OVERRIDE, Refused, is_override, lookup

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.py"))
PLACEHOLDER = re.compile(r"\.\.\.|[A-Z][A-Z0-9_]*|<[^>]*>|\$\S*|~\S*")  # N, PATH, <pid>, $VAR, ~/data/...
ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=\S*")
SCRIPT = re.compile(r"(?:\./)?((?:recipes|bench)/[\w<>.-]+\.py)")
REPO_FILE = re.compile(r"(?:\./)?((?:launch|configs)/[\w.-]+)")  # files a launcher is given: they must exist
SEPARATORS = {"&&", "||", ";", "|"}


# --- what a script accepts ------------------------------------------------------------------------
@dataclass(frozen=True)
class Flag:
    nargs: int | str  # 0 (a switch), 1, a count, or "*" / "+"
    kind: str  # "str", "int", "float", or "choice"
    choices: tuple = ()

    def bad_value(self, value: str) -> str | None:
        """Why `value` cannot be this flag's, or None (a placeholder such as N or PATH passes)."""
        if PLACEHOLDER.fullmatch(value):
            return None
        if self.kind == "choice" and value not in self.choices:
            return f"{value!r} is not one of {', '.join(self.choices)}"
        for kind, parse in (("int", int), ("float", float)):
            if self.kind == kind:
                try:
                    parse(value)
                except ValueError:
                    return f"{value!r} is not {'an' if kind == 'int' else 'a'} {kind}"
        return None


def scalar(tp, optional: bool) -> tuple[str, tuple]:
    """(kind, choices) of one value of type tp; an optional flag also takes None."""
    if typing.get_origin(tp) is typing.Literal:
        return "choice", tuple(str(c) for c in typing.get_args(tp)) + ("None",) * optional
    if optional and tp in (int, float):
        return "str", ()  # a number or None
    return {int: "int", float: "float"}.get(tp, "str"), ()


def tyro_flag(tp) -> Flag:
    """How tyro parses a field of type tp (flat dataclass fields: all the recipes use)."""
    optional = False
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(members) < len(typing.get_args(tp))
        tp = members[0] if len(members) == 1 else str
    if tp is bool:
        return Flag(0, "str")
    origin, inner = typing.get_origin(tp), typing.get_args(tp)
    if origin in (list, tuple) and inner:
        if origin is tuple and Ellipsis not in inner:
            return Flag(len(inner), *scalar(inner[0], False))
        return Flag("*", *scalar(inner[0], False))
    return Flag(1, *scalar(tp, optional))


@cache
def recipe_args(name: str):
    """The recipe's Args dataclass, its file imported once (as conftest.load_recipe does, under
    a name of its own so that no other test's module is replaced)."""
    spec = importlib.util.spec_from_file_location(f"docs_recipe_{name}", ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.Args


@cache
def recipe_flags(name: str) -> dict[str, Flag]:
    flags = {"--help": Flag(0, "str")}
    for field, hint in flag_types(recipe_args(name)).items():  # a group's flags (RLArgs.conditioning) too
        flags["--" + field.replace("_", "-")] = tyro_flag(hint)
        if hint is bool:
            flags["--no-" + field.replace("_", "-")] = Flag(0, "str")
    for holder, f in flag_fields_of(recipe_args(name)):  # a flag's other names (tyro.conf.arg(aliases=...))
        for config in getattr(typing.get_type_hints(holder, include_extras=True)[f.name], "__metadata__", ()):
            flags.update(
                {alias: flags["--" + f.name.replace("_", "-")] for alias in getattr(config, "aliases", None) or ()}
            )
    return flags


@cache
def bench_flags(name: str) -> dict[str, Flag]:
    """The options of bench/<name>.py's parser.add_argument calls, read from its source."""
    flags = {"--help": Flag(0, "str")}
    for call in ast.walk(ast.parse((ROOT / "bench" / f"{name}.py").read_text())):
        if not (isinstance(call, ast.Call) and getattr(call.func, "attr", None) == "add_argument"):
            continue
        names = [a.value for a in call.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")]
        keywords = {k.arg: k.value for k in call.keywords}
        action = keywords.get("action")
        if isinstance(action, ast.Constant) and str(action.value).startswith("store_"):
            flag = Flag(0, "str")
        else:
            nargs = ast.literal_eval(keywords["nargs"]) if "nargs" in keywords else 1
            parse = getattr(keywords.get("type"), "id", "str")
            if "choices" in keywords:
                flag = Flag(nargs, "choice", tuple(str(c) for c in ast.literal_eval(keywords["choices"])))
            else:
                flag = Flag(nargs, parse if parse in ("int", "float") else "str")
        flags.update(dict.fromkeys(names, flag))
    return flags


def script_flags(script: str) -> dict[str, Flag]:
    folder, name = script.split("/")[0], Path(script).stem
    return recipe_flags(name) if folder == "recipes" else bench_flags(name)


# --- the command lines of a page ------------------------------------------------------------------
def code_lines(lines: list[str]) -> dict[int, str]:
    """{line number: text} of every line of a fenced or indented code block."""
    code, fenced, indented, previous_blank = {}, False, False, True
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            code[number] = ""
        elif fenced:
            code[number] = line
        elif line.startswith(("    ", "\t")) and (previous_blank or indented):
            indented = True
            code[number] = line
        elif line.strip():
            indented = False
        previous_blank = not line.strip()
    return code


def drop_comment(line: str) -> str:
    line = line.strip()
    return "" if line.startswith("#") else re.split(r"\s#", line, maxsplit=1)[0].rstrip()


def commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) for every code-block line (continuations joined) and every inline
    code span of the prose that starts with a launcher or a recipe's file name."""
    lines = text.splitlines()
    code = code_lines(lines)
    found, joining, previous = [], False, None
    for number in sorted(code):
        line = drop_comment(code[number])
        continued, line = line.endswith("\\"), line.removesuffix("\\").rstrip()
        if joining and number == previous + 1:
            found[-1] = (found[-1][0], f"{found[-1][1]} {line}")
        elif line:
            found.append((number, line))
        joining, previous = continued and bool(line or joining), number
    prose = "\n".join("" if n in code else line for n, line in enumerate(lines, 1))
    for match in re.finditer(r"(?<!`)`([^`]+)`(?!`)", prose):
        span = match.group(1)
        if "\n\n" not in span and runs_something(span.split()):
            found.append((prose.count("\n", 0, match.start()) + 1, " ".join(span.split())))
    return [(n, c.removeprefix("$ ")) for n, c in found]


def runs_something(words: list[str]) -> bool:
    while words and ENV_ASSIGNMENT.fullmatch(words[0]):
        words = words[1:]
    if not words:
        return False
    first = words[0]
    return (
        Path(first).name.startswith("python")
        or first in ("accelerate", "torchrun", "sbatch", "srun", "cp")
        or bool(SCRIPT.fullmatch(first))
        or (first.endswith(".py") and first[:-3] in RECIPES)
    )


def split_words(command: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError:  # an unbalanced quote in a prose example: plain words will do
        return command.split()


def segments(command: str) -> list[list[str]]:
    """The simple commands of a line (`a && b`, `a | b`), each as its words, environment dropped."""
    out = [[]]
    for word in split_words(command):
        if word in SEPARATORS:
            out.append([])
        elif out[-1] or not ENV_ASSIGNMENT.fullmatch(word):
            out[-1].append(word)
    return [words for words in out if words]


def invocation(words: list[str]) -> tuple[str, list[str]] | None:
    """(the repo script a command runs, the words after it), or None if it runs none."""
    first = words[0]
    if first.endswith(".py") and first[:-3] in RECIPES:  # prose: `grpo.py --rollout-name vllm`
        return f"recipes/{first}", words[1:]
    if SCRIPT.fullmatch(first):
        return SCRIPT.fullmatch(first).group(1), words[1:]
    if not (Path(first).name.startswith("python") or first in ("accelerate", "torchrun", "sbatch", "srun")):
        return None
    if Path(first).name.startswith("python") and words[1:2] == ["-m"]:
        return None  # python -m pytest, ...
    for i, word in enumerate(words[1:], 1):
        if SCRIPT.fullmatch(word):
            return SCRIPT.fullmatch(word).group(1), words[i + 1 :]
    return None


# --- the check --------------------------------------------------------------------------------------
def check_flags(script: str, words: list[str]) -> list[str]:
    """What is wrong with the words given to `script`: unknown flags, missing or extra values,
    a choice outside its choices. A bare `--` ends the check (what follows is the script's own
    list of words, as bench/tool_task.py's grpo flags)."""
    accepted, problems, i = script_flags(script), [], 0
    while i < len(words):
        word = words[i]
        i += 1
        if word == "--":
            break
        if script.startswith("recipes/") and word in (
            "--verl-config",
            "--config-path",
            "--config-name",
            "--print-verl-translation",
        ):
            i += word != "--print-verl-translation"  # read by common.formats.verl before tyro: a path or name follows
            continue
        if not word.startswith("--") and script.startswith("recipes/") and is_override(word):
            entry = lookup(OVERRIDE.match(word).group(1))
            if entry is None or isinstance(entry, Refused):
                problems.append(f"{word!r}: a verl key the recipes refuse")
            continue
        if not word.startswith("--"):
            if word != "..." and not PLACEHOLDER.fullmatch(word):
                problems.append(f"{word!r} is not a flag and follows no flag that takes it")
            continue
        name, has_value, value = word.partition("=")
        values = [value] if has_value else []
        while not has_value and i < len(words) and not words[i].startswith("--") and words[i] != "...":
            values.append(words[i])
            i += 1
        flag = accepted.get(name)
        if flag is None:
            hint = [f for f in accepted if f.replace("-", "") == name.replace("-", "").replace("_", "")]
            problems.append(f"{name} is not a flag of {script}" + (f" (it spells it {hint[0]})" if hint else ""))
            continue
        elided = i < len(words) and words[i] == "..."  # `--flag ...`: its value left out on purpose
        if flag.nargs == 0:
            if values:
                problems.append(f"{name} takes no value, got {' '.join(values)!r}")
        elif not values:
            if flag.nargs != "*" and not elided:
                problems.append(f"{name} needs a value")
        elif isinstance(flag.nargs, int) and len(values) != flag.nargs:
            problems.append(f"{name} takes {flag.nargs} value(s), got {' '.join(values)!r}")
        problems += [f"{name} {v}: {why}" for v in values if (why := flag.bad_value(v))]
    return problems


def check_page(text: str) -> tuple[list[str], int]:
    """(problems as 'line N: `command`: what', how many commands ran a repo script)."""
    found = commands(text)
    copies = {}  # cp recipes/grpo.py recipes/my_algo.py: my_algo.py is grpo.py in this page
    for _, command in found:
        for words in segments(command):
            if words[0] == "cp" and len(words) == 3 and all(SCRIPT.fullmatch(w) for w in words[1:]):
                copies[words[2]] = words[1]
    problems, checked = [], 0
    for number, command in found:
        for words in segments(command):
            where = f"line {number}: `{command}`"
            if words[0] == "cp" or not runs_something(words):
                continue
            for word in words:
                repo_file = REPO_FILE.fullmatch(word)
                if repo_file and not (ROOT / repo_file.group(1)).exists():
                    problems.append(f"{where}: {repo_file.group(1)} does not exist")
            if (run := invocation(words)) is None:
                continue
            checked += 1
            script, rest = run
            script = copies.get(script, script)
            targets = [f"recipes/{r}.py" for r in RL_RECIPES] if "<" in script else [script]
            for target in targets:
                if not (ROOT / target).is_file():
                    problems.append(f"{where}: {target} does not exist")
                    continue
                problems += [f"{where}: {problem}" for problem in check_flags(target, rest)]
    return problems, checked


def table_flags(text: str) -> list[tuple[int, str]]:
    """(line number, flag) for every `--flag` in code spans of a "Coming from ..." table's mapped
    columns (all but the first): each must be a flag of some recipe, never a made-up one."""
    found, in_section = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("#"):
            in_section = line.lstrip("#").strip().lower().startswith("coming from")
        elif in_section and line.startswith("|"):
            mapped = "|".join(re.split(r"(?<!\\)\|", line)[2:])
            for span in re.findall(r"`([^`]+)`", mapped):
                found += [(number, f) for f in re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*[a-z0-9](?![\w.-])", span)]
    return found


# --- tests ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_runs_a_script_that_exists_with_flags_it_accepts(page):
    problems, _ = check_page(page.read_text())
    assert not problems, f"{page.relative_to(ROOT)}:\n  " + "\n  ".join(problems)


def test_the_pages_hold_the_commands_of_every_recipe_and_launcher():
    """The parser finds the commands at all: every recipe and bench script, every launcher form."""
    ran, launchers = set(), set()
    for page in DOCS:
        for _, command in commands(page.read_text()):
            for words in segments(command):
                if (run := invocation(words)) is not None:
                    ran.add(run[0])
                    launchers.add(Path(words[0]).name)
    assert {f"recipes/{r}.py" for r in RECIPES} <= ran, sorted({f"recipes/{r}.py" for r in RECIPES} - ran)
    assert {f"bench/{p.name}" for p in (ROOT / "bench").glob("*.py")} <= ran
    assert {"python", "accelerate", "torchrun", "sbatch"} <= launchers


def test_the_coming_from_tables_map_to_flags_that_exist():
    every_flag = set().union(*(recipe_flags(r) for r in RECIPES))
    bad = [
        f"{page.relative_to(ROOT)} line {number}: {flag}"
        for page in DOCS
        for number, flag in table_flags(page.read_text())
        if flag not in every_flag
    ]
    assert sum(len(table_flags(p.read_text())) for p in DOCS) > 50
    assert not bad, "flags of no recipe in a 'Coming from' table:\n  " + "\n  ".join(bad)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_reaches_a_file_and_heading_that_exist():
    """README.md links every docs/ page, and each page's links (../README.md, ../recipes/grpo.py,
    other pages and their #headings) resolve."""
    readme = (ROOT / "README.md").read_text()
    assert all(f"](docs/{p.name})" in readme for p in DOCS[1:]), "a docs/ page the README does not link"
    bad = []
    for page in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, fragment = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif fragment and file.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", file.read_text(), re.MULTILINE)
                if fragment not in {anchor(h) for h in headings}:
                    bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("name", RECIPES)
def test_the_flags_read_from_args_are_the_ones_tyro_prints(name):
    """The flag names this test derives from the Args fields are tyro's own spelling."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit):
        tyro.cli(recipe_args(name), args=["--help"])
    printed = set()
    for match in re.finditer(
        r"^ {1,4}(?:-h, )?(--[a-z][\w-]*)(?: [A-Z{][^,\s]*)?(?:, (--[a-z][\w-]*))?", out.getvalue(), re.MULTILINE
    ):
        printed.update(flag for flag in match.groups() if flag)
    assert printed == set(recipe_flags(name))


def test_a_made_up_flag_a_wrong_choice_and_a_launcher_flag_are_told_apart():
    page = "\n".join(
        [
            "Run:",
            "",
            "    accelerate launch --config_file configs/ddp.yaml --num_processes 2 recipes/grpo.py \\",
            "        --lr 1e-4 --made-up 3   # a comment --also-made-up",
            "    python recipes/rloo.py --kl-ctrl sometimes",
            "    python recipes/grpo.py --use-kl-loss yes --lr fast",
            "    python recipes/nope.py --lr 1",
            "    cp recipes/grpo.py recipes/mine.py",
            "    python recipes/mine.py --rollout-n 4 --not-in-grpo",
            "    python bench/scaling.py --steps 12 --stepz 3",
            "    accelerate launch --config_file configs/missing.yaml recipes/sft.py --max-length 64",
            "",
            "Prose with `torchrun --nproc_per_node 2 recipes/sft.py --lr-scheduler\nsteep` in it.",
        ]
    )
    problems, checked = check_page(page)
    text = "\n".join(problems)
    assert checked == 8 and len(problems) == 9, text
    whats = {}
    for problem in problems:
        where, what = problem.split("`: ", 1)
        whats.setdefault(where.split(":")[0], []).append(what)
    assert whats == {
        # the launcher's --config_file and --num_processes are not the recipe's, nor is the comment's flag
        "line 3": ["--made-up is not a flag of recipes/grpo.py"],
        "line 5": ["--kl-ctrl sometimes: 'sometimes' is not one of fixed, adaptive"],
        "line 6": ["--use-kl-loss takes no value, got 'yes'", "--lr fast: 'fast' is not a float"],
        "line 7": ["recipes/nope.py does not exist"],
        "line 9": ["--not-in-grpo is not a flag of recipes/grpo.py"],  # mine.py is a copy of grpo.py
        "line 10": ["--stepz is not a flag of bench/scaling.py"],
        "line 11": ["configs/missing.yaml does not exist"],
        "line 13": ["--lr-scheduler steep: 'steep' is not one of constant, cosine, wsd"],  # a prose span over two lines
    }, text


def test_every_test_the_trust_table_names_exists():
    """The README's Trust section cites tests as `tests/file.py::name` (or `::name` for the file
    named before it in the row): each must be a test function of that file, so a renamed or
    deleted test cannot leave a guarantee pointing at nothing."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Trust\n", 1)[1].split("\n## ", 1)[0]
    cited = []
    for line in section.splitlines():
        file = None
        for path, name in re.findall(r"`(tests/[\w/]+\.py)?(?:::(\w+))?`", line):
            file = path or file
            if file:
                cited.append((file, name))
    assert len({f for f, _ in cited}) >= 8
    for file, name in cited:
        assert (ROOT / file).is_file(), file
        if name:
            assert re.search(rf"^def {name}\(", (ROOT / file).read_text(), re.M), f"{file}::{name} does not exist"
