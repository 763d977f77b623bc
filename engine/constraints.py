"""Which structured-output constraint a request asks for, and the request-level limits of
structured output and of ``n`` (completions per prompt). Plain Python, no torch, no grammar
engine: ``SamplingParams.validate`` calls ``check_structured``; compiling the constraint is
engine/structured/grammar.py's job.

A constraint is one of ``json_schema`` (a JSON Schema document), ``json_object`` (any JSON
object), ``regex``, ``grammar`` (EBNF / GBNF) or ``choice`` (one of a list of strings). Its
``key`` (kind, text) is what compiled grammars are cached by.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_N = 16
MAX_CONSTRAINT_CHARS = 65536  # a schema, regex or grammar text
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
# objects and arrays nested in a json_schema: its compile time grows with the cube of the
# nesting (6,500 levels took hours), while real schemas nest a few levels
MAX_SCHEMA_DEPTH = 64
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_JSON_BRACKET = re.compile(r"[\[\]{}]")
CONSTRAINT_FIELDS = ("json_schema", "json_object", "regex", "grammar", "choice")


@dataclass(frozen=True)
class Constraint:
    kind: str  # one of CONSTRAINT_FIELDS: also the SamplingParams field it came from
    text: str  # the schema / regex / grammar; for choice the strings joined by NUL; "" for json_object
    choices: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind, self.text)


def constraint_of(params) -> Constraint | None:
    """The request's constraint, or None; raises ValueError when more than one is set."""
    given = [name for name in CONSTRAINT_FIELDS if _is_set(getattr(params, name))]
    if len(given) > 1:
        raise ValueError(f"{', '.join(given)}: give at most one structured-output constraint")
    if not given:
        return None
    kind = given[0]
    if kind == "json_object":
        return Constraint(kind, "")
    if kind == "choice":
        choices = tuple(params.choice)
        return Constraint(kind, "\0".join(choices), choices)
    return Constraint(kind, getattr(params, kind))


def check_structured(params) -> None:
    """Limits of ``n`` and of the constraint fields, and the sampling options they exclude;
    ValueError names the field and the limit."""
    if not 1 <= params.n <= MAX_N:
        raise ValueError(f"n must be in [1, {MAX_N}], got {params.n}")
    c = constraint_of(params)
    if c is None:
        return
    if c.kind in ("json_schema", "regex", "grammar") and len(c.text) > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"{c.kind}: at most {MAX_CONSTRAINT_CHARS} characters, got {len(c.text)}")
    if c.kind == "json_schema" and (depth := json_depth(c.text)) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"json_schema: nests objects and arrays {depth} levels deep; "
                         f"at most {MAX_SCHEMA_DEPTH}")
    if c.kind == "choice":
        _check_choices(c.choices)
    # the grammar decides where the output ends: EOS is its only way out, so neither can be kept off
    if params.ignore_eos:
        raise ValueError(f"ignore_eos: cannot be combined with {c.kind} (the constraint ends the output)")
    if params.min_tokens:
        raise ValueError(f"min_tokens: cannot be combined with {c.kind} (the constraint ends the output)")


def json_depth(text: str) -> int:
    """The deepest nesting of objects and arrays in a JSON text, read without parsing it (a parser
    recurses once per level: deep nesting is what this guards against). Brackets inside strings
    do not count; a text that is not JSON gets a number all the same, and fails to compile later."""
    depth = deepest = 0
    for bracket in _JSON_BRACKET.findall(_JSON_STRING.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _check_choices(choices: tuple[str, ...]) -> None:
    if len(choices) > MAX_CHOICES:
        raise ValueError(f"choice: at most {MAX_CHOICES} strings, got {len(choices)}")
    for s in choices:
        if not s:
            raise ValueError("choice: the strings must not be empty")
        if len(s) > MAX_CHOICE_CHARS:
            raise ValueError(f"choice: each string is at most {MAX_CHOICE_CHARS} characters, got {len(s)}")


def _is_set(value) -> bool:
    return value is not None and value is not False and value != [] and value != ()
