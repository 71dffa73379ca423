"""A flag is declared once, on its field: its default, the range it must be in, and what that range
means. check_ranges reads the rules back from the fields, so no table elsewhere restates them.

    lr: float = flag(1e-5, gt=0)
    top_k: int = flag(-1, rule=(lambda v: v == -1 or v >= 1, "-1 (off) or >= 1"))
    grad_clip: float = flag(1.0, ge=0, note="0 disables clipping")
    overlong_buffer_len: int = flag(4, ge=0, le="max_response_length")  # a bound may name another flag

    kl_loss_coef: float = flag(0.001, ge=0, only_with="use_kl_loss")
    target_kl: float = flag(0.1, gt=0, only_with=(lambda a: a.kl_ctrl == "adaptive", "add --kl-ctrl adaptive"))

A bound compares every number of the value (a tuple's each); None always passes (an unset optional
flag); the message names the flag as the command line spells it: `--lr -1e-05: must be > 0`.
only_with names what must hold for the run to read the flag (a switch, or a test of every flag and what
to add): a value of its own set where it would change nothing is refused, not silently dropped.
A group (a field whose default is a dataclass, such as RLArgs.conditioning) stands for its flags, and a
field named apart from its flag (ModelArgs.path is --model) is read by that name.
"""

import copy
import functools
import inspect
import math
import operator
import os
import typing
from dataclasses import MISSING, field, fields, is_dataclass
from pathlib import Path
from types import SimpleNamespace

import tyro._strings

from common.errors import UsageError

BUNDLED = Path(__file__).resolve().parent.parent / "bundled"  # the bundled model and tasks: the flags' defaults

# tyro (1.0) joins a help text's single line breaks before it dedents it, so a field docstring whose later lines are
# indented, as every one here is, kept its breaks in --help ("... float32" / "gradient reduction ..."). Dedented
# first, each flag's help is one paragraph the terminal wraps (tests/test_rl_recipes.py reads --help to hold it).
_join_lines = getattr(tyro._strings, "remove_single_line_breaks", None)
if _join_lines is not None and not getattr(_join_lines, "dedents", False):
    tyro._strings.remove_single_line_breaks = lambda text: _join_lines(inspect.cleandoc(text))
    tyro._strings.remove_single_line_breaks.dedents = True

BOUNDS = {"gt": (">", operator.gt), "ge": (">=", operator.ge), "lt": ("<", operator.lt), "le": ("<=", operator.le)}


def flag(default=MISSING, *, gt=None, ge=None, lt=None, le=None, rule=None, unit="", note="", only_with=None):
    """The field of a flag: its default and its range, as bounds (gt / ge / lt / le, in unit) or
    rule=(test, what it must be); note says what an edge value means; only_with=a switch's name, or
    (test of the flags, what to add), says when the run reads it."""
    bounds = {k: v for k, v in dict(gt=gt, ge=ge, lt=lt, le=le).items() if v is not None}
    metadata = {"bounds": bounds, "rule": rule, "unit": unit, "note": note} if bounds or rule else {}
    if isinstance(only_with, str):  # a switch: --use-kl-loss (a script without it reads the flag its own way)
        only_with = (lambda a, switch=only_with: getattr(a, switch, True), f"add {flag_name(only_with)}")
    return field(default=default, metadata={**metadata, "only_with": only_with} if only_with else metadata)


def must_be(f, values: dict | None = None) -> str | None:
    """What a field's value must be, in words ('in [0, 1]', '>= 1 (0: off)'), or None without a rule;
    a bound naming another flag (le="max_response_length") shows it with its value in `values`."""
    bounds, rule, note = f.metadata.get("bounds", {}), f.metadata.get("rule"), f.metadata.get("note", "")
    show = {op: f"{flag_name(b)} ({values[b]:g})" if isinstance(b, str) else f"{b:g}" for op, b in bounds.items()}
    if rule is not None:
        what = rule[1]
    elif not bounds:
        return None
    elif len(bounds) == 2:
        lo_op, hi_op = sorted(bounds, key=lambda op: op[0] != "g")
        what = f"in {'(' if lo_op == 'gt' else '['}{show[lo_op]}, {show[hi_op]}{')' if hi_op == 'lt' else ']'}"
    else:
        ((op, shown),) = show.items()
        what = f"{BOUNDS[op][0]} {shown}" + (f" {f.metadata['unit']}" if f.metadata.get("unit") else "")
    return f"{what} ({note})" if note else what


def in_range(f, value, values: dict | None = None) -> bool:
    """Whether value passes the field's rule (True for a field without one, and for None); a bound
    naming another flag takes its value in `values`."""
    if value is None:
        return True
    rule = f.metadata.get("rule")
    if rule is not None:
        return bool(rule[0](value))
    numbers = value if isinstance(value, tuple) else (value,)
    bounds = {op: values[b] if isinstance(b, str) else b for op, b in f.metadata.get("bounds", {}).items()}
    return all(BOUNDS[op][1](v, b) for v in numbers for op, b in bounds.items())


def _flags(args):
    """(the dataclass holding it, field) per flag of args; a group's from its value (in a class, its default)."""
    for f in fields(args):
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        value = default if isinstance(args, type) else getattr(args, f.name)
        if is_dataclass(value) and not isinstance(value, type):  # a group: RLArgs.optim, RLArgs.conditioning
            yield from _flags(type(value) if isinstance(args, type) else value)
        else:
            yield args, f


@functools.cache  # per class
def _names(holder: type) -> dict:
    """{field: its flag's name} of a dataclass: the field's own name, or the name its tyro.conf.arg gives."""
    hints = typing.get_type_hints(holder, include_extras=True)
    named = {k: m.name for k, h in hints.items() for m in getattr(h, "__metadata__", ()) if getattr(m, "name", None)}
    return {f.name: named.get(f.name, f.name) for f in fields(holder)}


def name_of(holder, f) -> str:
    """The flag's name of field f of holder (a dataclass or its class): ModelArgs.path is "model"."""
    return _names(holder if isinstance(holder, type) else type(holder))[f.name]


def _named(args):
    """(flag's name, holder, field) per flag of args."""
    return ((name_of(holder, f), holder, f) for holder, f in _flags(args))


def flag_fields(args) -> list:
    """Every flag field of args (a dataclass of flags or its class), named by its flag (ModelArgs.path as model).
    A field that only changes an inherited flag's default (RLArgs' lr) comes with the rule of the class that
    declared it."""
    return _flag_fields(args if isinstance(args, type) else type(args))


@functools.cache  # per class: every Args checks its flags as it is made
def _flag_fields(args: type) -> list:
    out = []
    for name, holder, f in _named(args):
        mro = (holder if isinstance(holder, type) else type(holder)).__mro__
        declared = (c.__dataclass_fields__.get(f.name) for c in mro if "__dataclass_fields__" in vars(c))
        f = copy.copy(next((d for d in declared if d is not None and d.metadata), f))
        f.name = name
        out.append(f)
    return out


def check_ranges(args) -> None:
    """Every flag of args in its range, and every number finite (NaN passes every comparison's
    negation, and no flag here means infinity). Raises UsageError naming the flag."""
    values = flag_values(args)
    for f in flag_fields(args):
        value = values[f.name]
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{flag_name(f.name)} {value}: must be a finite number")
        if not in_range(f, value, values):
            raise UsageError(f"{flag_name(f.name)} {value!r}: must be {must_be(f, values)}")


def check_used(args) -> None:
    """A flag set to a value of its own that this run would not read (its only_with does not hold)."""
    defaults, values = flag_defaults(args), flag_values(args)
    view = SimpleNamespace(**values)  # every flag by its name, a group's (args.optim.lr) too
    for f in flag_fields(args):
        used = f.metadata.get("only_with")
        if used and f.name in defaults and values[f.name] != defaults[f.name] and not used[0](view):
            raise UsageError(
                f"{flag_name(f.name)} {values[f.name]!r} would change nothing in this run: {used[1]}, or drop the flag"
            )


def flag_defaults(args) -> dict:
    """{flag: its default} for every flag of args (a dataclass or its class); a group's from the group's default."""
    out = {}
    for f in (f for f in fields(args) if f.default is not MISSING or f.default_factory is not MISSING):
        value = f.default if f.default is not MISSING else f.default_factory()
        grouped = is_dataclass(value) and not isinstance(value, type)
        out.update(flag_values(value) if grouped else {name_of(args, f): value})
    return out


def flag_values(args) -> dict:
    """{flag: its value} for every flag of args, a group's beside the others: what a rule between flags reads."""
    return {name: getattr(holder, f.name) for name, holder, f in _named(args)}


def flag_types(args_class) -> dict:
    """{flag: its type} for every flag of a dataclass of flags."""
    hints = functools.cache(typing.get_type_hints)  # once per class, not per flag
    return {name: hints(holder)[f.name] for name, holder, f in _named(args_class)}


def env_flag(name: str, default: str = "false") -> bool:
    return os.environ.get(name, default).strip().lower() in ("1", "true", "yes")


def flag_name(name: str) -> str:
    """A field's flag as the command line spells it: lr_warmup_steps_ratio -> --lr-warmup-steps-ratio."""
    return "--" + name.replace("_", "-")


def parse_band(threshold: float | str) -> tuple[float | None, float]:
    """verl's rollout_is_threshold: a number u truncates the weights at u (TIS: (None, u)); a text
    "lo_hi" keeps the weights inside [lo, hi] and zeroes the rest (IcePop's mask: (lo, hi))."""
    if isinstance(threshold, str) and "_" in threshold:
        lo, hi = threshold.split("_", 1)
        return float(lo), float(hi)
    return None, float(threshold)


def band_ok(threshold) -> bool:
    """rollout_is_threshold: a number >= 1, or lo_hi with 0 < lo <= 1 <= hi."""
    try:
        lo, hi = parse_band(threshold)
    except ValueError:
        return False
    return hi >= 1 if lo is None else 0 < lo <= 1 <= hi
