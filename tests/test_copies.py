"""Copies that stay copies (issue 60): a fork of grpo.py copies its update, forward_logprobs, old_ref_logprobs
(and whatever else it does not change) on purpose, so that the file reads whole; each copy must equal grpo.py's,
token for token (comments and blank lines aside), unless the fork names the function in its CHANGED dict with a
one-line reason. A fix to grpo.py's update then fails here in every fork that did not take it."""

import ast
import io
import tokenize
from pathlib import Path

from conftest import RL_RECIPES

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}


def top_functions(source: str) -> dict[str, list[str]]:
    """Each top-level function's tokens, without comments and layout (a reflowed line is the same code)."""
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef):
            text = ast.get_source_segment(source, node, padded=True)
            out[node.name] = [
                t.string for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type not in LAYOUT
            ]
    return out


def declared(source: str) -> dict[str, str]:
    """The fork's CHANGED = {function: reason} (a literal: read, never run)."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "CHANGED" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("no CHANGED = {function: reason} at the top of the file")


def differences(grpo: str, fork: str) -> list[str]:
    """The functions fork shares with grpo (by name) whose code is not grpo's."""
    ours, theirs = top_functions(grpo), top_functions(fork)
    return [name for name in theirs if name in ours and theirs[name] != ours[name]]


def sources() -> dict[str, str]:
    return {r: (ROOT / "recipes" / f"{r}.py").read_text() for r in RL_RECIPES}


def test_every_fork_copies_grpo_or_says_why(capsys):
    files = sources()
    grpo = files.pop("grpo")
    assert declared(grpo) == {}, "grpo.py is the original: its CHANGED stays empty"
    assert len(files) >= 19, sorted(files)
    problems, listed = [], []
    for recipe, source in sorted(files.items()):
        changed, differ = declared(source), differences(grpo, source)
        shared = set(top_functions(source)) & set(top_functions(grpo))
        for name in differ:
            if name not in changed:
                problems.append(
                    f"recipes/{recipe}.py: {name}() differs from grpo.py's; take grpo's or name it in CHANGED"
                )
        for name, reason in changed.items():
            if name not in shared:
                problems.append(f"recipes/{recipe}.py: CHANGED names {name}, which grpo.py and it do not both define")
            elif name not in differ:
                problems.append(f"recipes/{recipe}.py: CHANGED names {name}, but it equals grpo.py's; drop it")
            if not isinstance(reason, str) or not reason.strip() or "\n" in reason:
                problems.append(f"recipes/{recipe}.py: CHANGED[{name!r}] needs a one-line reason")
            listed.append(f"{recipe}.{name}: {reason}")
        assert {"update", "forward_logprobs", "old_ref_logprobs", "main"} <= shared, (recipe, sorted(shared))
    with capsys.disabled():
        print("\nthe forks' declared differences from grpo.py:\n  " + "\n  ".join(listed))
    assert not problems, "\n".join(problems)


def test_a_fix_to_grpos_update_fails_in_every_fork_that_did_not_take_it():
    """The check has teeth: one changed token in grpo.py's update is a difference in each fork that copies it."""
    files = sources()
    grpo = files.pop("grpo")
    update = ast.get_source_segment(grpo, next(n for n in ast.parse(grpo).body if getattr(n, "name", "") == "update"))
    fixed = grpo.replace(update, update.replace(".backward()", ".mul(1.0).backward()", 1))
    assert fixed != grpo, "grpo.py's update calls no .backward(): pick another token to change"
    copies = [r for r, source in files.items() if "update" not in declared(source)]
    assert len(copies) >= 15, copies
    caught = [r for r in copies if "update" in differences(fixed, files[r])]
    assert caught == copies
    assert not [r for r in copies if "update" in differences(grpo, files[r])]
