"""The tool-call parser every model format shares: content until a marker, then JSON call objects.

A parser is fed the choice's text in whatever pieces it arrives (speculative decoding delivers
several tokens at once) and answers with content that is safe to show and OpenAI tool-call delta
entries. Text that could be the start of a marker is held back until it is not; a call's name is
sent once it is complete, its arguments as the raw JSON text of the value, fragment by fragment.
Non-streamed responses feed the whole text once: both paths run the same code, so they agree.

A format is described by its markers (text that opens the tool-call section), the pattern before
the first call object and the pattern between two objects; a subclass sets those and builds its
constraints (router/tools/grammar.py).
"""

from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass, field
from typing import Any, ClassVar

from common.detokenize import partial_suffix_len
from common.sampling import Constraint
from router.tools.grammar import TokenId
from router.tools.jsonscan import Memo, ObjectScan, scan_object, skip_ws
from router.tools.schema import FunctionSpec

WS = None  # a pattern item: any whitespace, possibly none
Pattern = tuple[str | tuple[str, bool] | None, ...]  # literal (required), (literal, optional) or WS
NO = -1  # what cannot match: the call section is over

_ID_CHARS = string.ascii_letters + string.digits


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def message_entry(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolDelta:
    """What one piece of text adds: content to show and tool-call delta entries (one per index)."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def __iadd__(self, other: ToolDelta) -> ToolDelta:
        self.content += other.content
        for entry in other.calls:
            same = next((e for e in self.calls if e["index"] == entry["index"]), None)
            if same is None:
                self.calls.append(entry)
            else:
                same.setdefault("function", {}).setdefault("arguments", "")
                same["function"]["arguments"] += entry["function"]["arguments"]
        return self


def match(text: str, i: int, pattern: Pattern) -> int | None:
    """Index after `pattern` at text[i], None while the text may still complete it, NO if it cannot."""
    for item in pattern:
        if item is WS:
            i = skip_ws(text, i)
            continue
        lit, optional = item if isinstance(item, tuple) else (item, False)
        if text.startswith(lit, i):
            i += len(lit)
        elif lit.startswith(text[i:]):
            return None  # the text ends inside (or right before) the literal
        elif not optional:
            return NO
    return i


class ToolParser:
    """One choice's tool-call parser; subclasses describe their format with the class variables."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]]  # text that opens the tool-call section
    first: ClassVar[Pattern] = (WS,)  # between the marker and the first call object
    between: ClassVar[Pattern] = (WS,)  # between two call objects
    args_keys: ClassVar[tuple[str, ...]] = ("arguments", "parameters")
    template_hints: ClassVar[tuple[str, ...]] = ()  # chat template text that says "this format"
    keeps_special_tokens: ClassVar[bool] = False  # its markers are special tokens: show them to the parser
    id_prefix: ClassVar[str] = "call_"
    id_length: ClassVar[int] = 24

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.calls: list[ToolCall] = []
        self.content = ""  # all content sent
        self._buf = ""  # content mode: text held back; call mode: the text after the marker
        self._marker: str | None = None  # the marker that opened the call section (None: content mode)
        self._pos = 0  # call mode: where the next call object (or the pattern before it) starts
        self._obj: int | None = None  # call mode: where the open call object starts
        self._started = False  # the open call object has been sent as a call
        self._sent = 0  # argument characters sent for the open call
        self._over = False  # no call comes after this
        self._finished = False
        self._memo: Memo = {}  # call mode: how far open containers in the text were scanned

    @classmethod
    def new_id(cls) -> str:
        return cls.id_prefix + "".join(random.choices(_ID_CHARS, k=cls.id_length))

    # ---- constraints (overridden per format) ----

    @classmethod
    def required_constraint(cls, functions: list[FunctionSpec], parallel: bool, token_id: TokenId) -> Constraint:
        """The output is one call (or, with `parallel`, one or more) of these functions, in this format;
        `token_id` finds the markers the vocabulary holds as single tokens."""
        raise NotImplementedError

    @classmethod
    def auto_constraint(cls, functions: list[FunctionSpec], token_id: TokenId) -> Constraint:
        """Free text in which every call of these functions, once started, follows its schema."""
        raise NotImplementedError

    # ---- parsing ----

    def feed(self, text: str) -> ToolDelta:
        self._buf += text
        return self._content_step(final=False) if self._marker is None else self._call_step(final=False)

    def finish(self) -> ToolDelta:
        """The choice ended: release what was held; a call section without one call is content."""
        if self._finished:
            return ToolDelta()
        self._finished = True
        out = self._content_step(final=True) if self._marker is None else self._call_step(final=True)
        if self._marker is not None and not self.calls:
            out.content += self._say(self._marker + self._buf).content
            self._buf = ""
        return out

    def _say(self, content: str) -> ToolDelta:
        self.content += content
        return ToolDelta(content)

    def find_start(self, text: str) -> tuple[int, str] | None:
        """(where the call section starts, its marker) in held content text, if it does."""
        found = [(i, m) for m in self.markers if (i := text.find(m)) != -1]
        return min(found) if found else None

    def hold(self, text: str) -> int:
        """How much of the end of held content text may still turn out to open the call section."""
        return partial_suffix_len(text, self.markers)

    def _content_step(self, final: bool) -> ToolDelta:
        start = self.find_start(self._buf)
        if start is None:
            keep = 0 if final else self.hold(self._buf)
            shown, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
            return self._say(shown)
        at, marker = start
        out = self._say(self._buf[:at])
        self._marker, self._buf = marker, self._buf[at + len(marker) :]
        out += self._call_step(final)
        return out

    def _call_step(self, final: bool) -> ToolDelta:
        out = ToolDelta()
        while not self._over and (self._obj is not None or self._next_object(final)):
            if not self._scan_call(out, final):
                break
        return out

    def locate(self) -> int | None:
        """Where the next call object's brace is; None while unknown, NO when no call follows."""
        at = match(self._buf, self._pos, self.between if self.calls else self.first)
        if at is None or at == NO:
            return at
        if at >= len(self._buf):
            return None
        return at if self._buf[at] == "{" else NO

    def _next_object(self, final: bool) -> bool:
        """Find where the next call object starts; False while unknown (or never: then `_over`)."""
        at = self.locate()
        if at is None or at == NO:
            self._over = final or at == NO
            return False
        self._obj, self._started, self._sent = at, False, 0
        return True

    def _scan_call(self, out: ToolDelta, final: bool) -> bool:
        """Advance the open call object; True once it is complete (then look for the next)."""
        assert self._obj is not None
        try:
            scan = scan_object(self._buf, self._obj, self._memo)
            name, args, args_done = self._fields(scan)
        except ValueError:  # Malformed, or a string json cannot decode
            self._over = True
            return False
        if not self._started:
            if name is None or (self.max_calls is not None and len(self.calls) >= self.max_calls):
                # no name yet, or a complete object naming no function (then not a call), or one too many
                self._over = final or scan.end is not None or name is not None
                return False
            self.calls.append(ToolCall(self.new_id(), name))
            self._started = True
            out += ToolDelta(calls=[{"index": len(self.calls) - 1, **self.calls[-1].message_entry()}])
        if scan.end is not None and not args_done:
            args = "{}"  # a call without an arguments member
        if len(args) > self._sent:
            fragment = {"index": len(self.calls) - 1, "function": {"arguments": args[self._sent :]}}
            out += ToolDelta(calls=[fragment])
            self.calls[-1].arguments, self._sent = args, len(args)
        if scan.end is None:
            self._over = final
            return False
        self._pos, self._obj = scan.end, None
        return True

    def _fields(self, scan: ObjectScan) -> tuple[str | None, str, bool]:
        """(name once complete, argument text known so far, whether the arguments are complete)."""
        name, args, done = None, "", False
        for m in scan.members:
            if m.key == "name" and m.end is not None:
                value = json.loads(self._buf[m.start : m.end])
                name = value if isinstance(value, str) else None
            elif m.key in self.args_keys:
                args, done = self._args_text(m.start, m.end)
        return name, args, done

    def _args_text(self, start: int, end: int | None) -> tuple[str, bool]:
        """Arguments stream as the raw text of an object; a string value (JSON already encoded as a
        string, as some models write it) is decoded once complete; anything else waits to be complete."""
        raw = self._buf[start:end]
        if end is None:
            return (raw, False) if raw.startswith("{") else ("", False)
        if raw.startswith('"'):
            value = json.loads(raw)
            return (value if isinstance(value, str) else raw), True
        return raw, True
