"""Scanning JSON that may still be arriving: where a value ends, and an object's members so far.

Streamed model output is cut anywhere, so every function here answers "not known yet" (None)
when the text ends inside what it looks at, and raises `Malformed` only for text that no
continuation could make valid at that point.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_WS = " \t\r\n"
_LITERALS = ("true", "false", "null")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_STRING_STOP = re.compile(r'["\\]')
_STRUCTURAL = re.compile(r'[{}\[\]"]')
# value start -> (depth, where to resume, inside a string) of a container scanned up to the text's end
Memo = dict[int, tuple[int, int, bool]]


class Malformed(ValueError):
    """The text cannot be the JSON this scanner expects, whatever comes next."""


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """Index after the JSON string starting at text[i] (a quote); None if it is still open."""
    return _string_scan(text, i + 1)[0]


def _string_scan(text: str, j: int) -> tuple[int | None, int]:
    """(index after the closing quote or None, where to resume) for string content from text[j]."""
    while (m := _STRING_STOP.search(text, j)) is not None:
        if m.group() == "\\":
            if m.start() + 1 >= len(text):
                return None, m.start()  # the escaped character has not arrived
            j = m.start() + 2
            continue
        return m.start() + 1, m.start() + 1
    return None, len(text)


def value_end(text: str, i: int, memo: Memo | None = None) -> int | None:
    """Index after the JSON value starting at text[i] (no leading whitespace); None while open.

    Only the nesting is checked; the caller parses the complete text with `json.loads`. `memo` keeps
    where unfinished containers stopped, so text that only grows is scanned once.
    """
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in "{[":
        return _container_end(text, i, {} if memo is None else memo)
    if c in _NUMBER_CHARS:
        j = i
        while j < len(text) and text[j] in _NUMBER_CHARS:
            j += 1
        return j if j < len(text) else None  # "12" may yet become "123"
    for lit in _LITERALS:
        if text.startswith(lit, i):
            return i + len(lit)
        if lit.startswith(text[i:]):
            return None
    raise Malformed(f"unexpected {c!r} where a JSON value should start")


def _container_end(text: str, i: int, memo: Memo) -> int | None:
    # Resumes where the last scan of this container stopped, and jumps from one structural
    # character to the next: arguments can be long (a file's text) and stream in a few characters
    # at a time.
    depth, j, in_string = memo.get(i, (0, i, False))
    while True:
        if in_string:
            end, j = _string_scan(text, j)
            if end is None:
                memo[i] = (depth, j, True)
                return None
            in_string = False
        m = _STRUCTURAL.search(text, j)
        if m is None:
            memo[i] = (depth, len(text), False)
            return None
        j = m.start() + 1
        if m.group() == '"':
            in_string = True
            continue
        depth += 1 if m.group() in "{[" else -1
        if depth == 0:
            return j


@dataclass(frozen=True)
class Member:
    """One `"key": value` of an object: the value's span (end None while it is still open)."""

    key: str
    start: int
    end: int | None


@dataclass(frozen=True)
class ObjectScan:
    members: list[Member]
    end: int | None  # index after the closing brace, None while the object is open


def scan_object(text: str, i: int, memo: Memo | None = None) -> ObjectScan:
    """The members of the object starting at text[i] (a brace), as far as the text goes."""
    members: list[Member] = []
    j = skip_ws(text, i + 1)
    while j < len(text):
        if text[j] == "}":
            return ObjectScan(members, j + 1)
        if text[j] != '"':
            raise Malformed(f"expected a key, got {text[j]!r}")
        key_end = string_end(text, j)
        if key_end is None:
            break
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text):
            break
        if text[j] != ":":
            raise Malformed(f"expected ':' after key {key!r}")
        j = skip_ws(text, j + 1)
        if j >= len(text):
            break
        end = value_end(text, j, memo)
        members.append(Member(key, j, end))
        if end is None:
            break
        j = skip_ws(text, end)
        if j < len(text) and text[j] == ",":
            j = skip_ws(text, j + 1)
        elif j < len(text) and text[j] != "}":
            raise Malformed(f"expected ',' or '}}' after the value of {key!r}")
    return ObjectScan(members, None)
