"""A flag is declared once, on its field: its default, the range it must be in, and what that range
means. check_ranges reads the rules back from the fields, so no table elsewhere restates them.

    lr: float = flag(1e-5, gt=0)
    top_k: int = flag(-1, rule=(lambda v: v == -1 or v >= 1, "-1 (off) or >= 1"))
    grad_clip: float = flag(1.0, ge=0, note="0 disables clipping")

A bound compares every number of the value (a tuple's each); None always passes (an unset optional
flag); the message names the flag as the command line spells it: `--lr -1e-05: must be > 0`.
A group (a field whose default is a dataclass, such as RLArgs.conditioning) stands for its flags.
"""

import functools
import math
import operator
import os
import typing
from dataclasses import MISSING, field, fields, is_dataclass
from pathlib import Path

from common.errors import UsageError

BUNDLED = Path(__file__).resolve().parent.parent / "bundled"  # the bundled model and tasks: the flags' defaults

BOUNDS = {"gt": (">", operator.gt), "ge": (">=", operator.ge), "lt": ("<", operator.lt), "le": ("<=", operator.le)}


def flag(default=MISSING, *, gt=None, ge=None, lt=None, le=None, rule=None, unit="", note=""):
    """The field of a flag: its default and its range, as bounds (gt / ge / lt / le, in unit) or
    rule=(test, what it must be); note says what an edge value means."""
    bounds = {k: v for k, v in dict(gt=gt, ge=ge, lt=lt, le=le).items() if v is not None}
    metadata = {"bounds": bounds, "rule": rule, "unit": unit, "note": note} if bounds or rule else {}
    return field(default=default, metadata=metadata)


def must_be(f) -> str | None:
    """What a field's value must be, in words ('in [0, 1]', '>= 1 (0: off)'), or None without a rule."""
    bounds, rule, note = f.metadata.get("bounds", {}), f.metadata.get("rule"), f.metadata.get("note", "")
    if rule is not None:
        what = rule[1]
    elif not bounds:
        return None
    elif len(bounds) == 2:
        (lo_op, lo), (hi_op, hi) = sorted(bounds.items(), key=lambda kv: kv[0][0] != "g")
        what = f"in {'(' if lo_op == 'gt' else '['}{lo:g}, {hi:g}{')' if hi_op == 'lt' else ']'}"
    else:
        ((op, bound),) = bounds.items()
        what = f"{BOUNDS[op][0]} {bound:g}" + (f" {f.metadata['unit']}" if f.metadata.get("unit") else "")
    return f"{what} ({note})" if note else what


def in_range(f, value) -> bool:
    """Whether value passes the field's rule (True for a field without one, and for None)."""
    if value is None:
        return True
    rule = f.metadata.get("rule")
    if rule is not None:
        return bool(rule[0](value))
    numbers = value if isinstance(value, tuple) else (value,)
    return all(BOUNDS[op][1](v, b) for v in numbers for op, b in f.metadata.get("bounds", {}).items())


def _flags(args):
    """(the dataclass holding it, field) per flag of args; a group's from its value (in a class, its default)."""
    for f in fields(args):
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        value = default if isinstance(args, type) else getattr(args, f.name)
        if is_dataclass(value) and not isinstance(value, type):  # a group: RLArgs.optim, RLArgs.conditioning
            yield from _flags(type(value) if isinstance(args, type) else value)
        else:
            yield args, f


def flag_fields(args) -> list:
    """Every flag field of args (a dataclass of flags or its class). A field that only changes an
    inherited flag's default (RLArgs' lr) comes with the rule of the class that declared it."""
    out = []
    for holder, f in _flags(args):
        mro = (holder if isinstance(holder, type) else type(holder)).__mro__
        declared = (c.__dataclass_fields__.get(f.name) for c in mro if "__dataclass_fields__" in vars(c))
        out.append(next((d for d in declared if d is not None and d.metadata), f))
    return out


def check_ranges(args) -> None:
    """Every flag of args in its range, and every number finite (NaN passes every comparison's
    negation, and no flag here means infinity). Raises UsageError naming the flag."""
    for (holder, _), f in zip(_flags(args), flag_fields(args), strict=True):
        value = getattr(holder, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{flag_name(f.name)} {value}: must be a finite number")
        if not in_range(f, value):
            raise UsageError(f"{flag_name(f.name)} {value!r}: must be {must_be(f)}")


def flag_defaults(args) -> dict:
    """{flag: its default} for every flag of args (a dataclass or its class); a group's from the group's default."""
    out = {}
    for f in (f for f in fields(args) if f.default is not MISSING or f.default_factory is not MISSING):
        value = f.default if f.default is not MISSING else f.default_factory()
        out.update(flag_values(value) if is_dataclass(value) and not isinstance(value, type) else {f.name: value})
    return out


def flag_values(args) -> dict:
    """{flag: its value} for every flag of args, a group's beside the others: what a rule between flags reads."""
    return {f.name: getattr(holder, f.name) for holder, f in _flags(args)}


def flag_types(args_class) -> dict:
    """{flag: its type} for every flag of a dataclass of flags."""
    hints = functools.cache(typing.get_type_hints)  # once per class, not per flag
    return {f.name: hints(holder)[f.name] for holder, f in _flags(args_class)}


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
