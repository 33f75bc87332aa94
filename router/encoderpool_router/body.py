"""A client's JSON body: parsed once to be checked, sent on as the client's own bytes.

Re-serialising a body costs far more than parsing it (``json.dumps`` of a
2 MB base64 image is several times ``json.loads`` of it), and the router
changes at most one top-level field. So a body that is plain UTF-8 JSON goes
upstream as the client sent it, with the router's ``ec_transfer_params``
spliced in before the final ``}``. That is safe only where the consumer reads
the bytes exactly as the router did: vLLM parses request bodies with Python's
``json`` (FastAPI's ``Request.json``), the parser used here, and the bytes are
sent on only when

- they are strict UTF-8 without a BOM (what ``json.loads`` of a ``str`` takes;
  anything else, e.g. UTF-16, is parsed as before and re-serialised),
- no object anywhere repeats a key (a parser keeping the first duplicate
  instead of the last would otherwise see another request than the router
  checked), and
- there is no top-level ``ec_transfer_params`` in any spelling (escapes
  included: the parsed key is compared), since the router owns that field.

Otherwise, or once the router changed anything else (a dropped ``uuid``),
the parsed body is re-serialised, as it always was.

Two more savings for large images: json's character-by-character scan skips
long string values (``_loads``), and a producer request copies a long URL's
literal from the client's bytes (``string_literal``) instead of serialising it.
"""

from __future__ import annotations

import json
import os
from typing import Any

from encoderpool_connector.contracts import EC_TRANSFER_PARAMS

# What json.loads skips after a document: its WHITESPACE ([ \t\n\r]*).
_JSON_WS = b" \t\n\r"


class _Objects:
    """An ``object_pairs_hook`` that builds dicts as json does, notes a repeated key,
    and puts each long value cut out of the text (``_loads``) back in its place."""

    __slots__ = ("long", "put_back", "repeated")

    def __init__(self) -> None:
        self.repeated = False
        self.long: dict[str, str] = {}  # stand-in -> the value it stands for
        self.put_back = 0

    def reset(self) -> None:
        self.repeated = False
        self.long = {}
        self.put_back = 0

    def __call__(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        if self.long:
            for i, (k, v) in enumerate(pairs):
                if v.__class__ is str and v.startswith(_STAND_IN):
                    value = self.long.get(v)
                    if value is not None:
                        pairs[i] = (k, value)
                        self.put_back += 1
        d = dict(pairs)
        if len(d) != len(pairs):
            self.repeated = True
        return d


class NotAnObject(ValueError):
    """The body is JSON, but not an object."""


class ClientBody:
    """The parsed body (``data``) and whether ``raw`` may still go upstream as is."""

    __slots__ = ("data", "raw", "utf8", "verbatim")

    def __init__(self, raw: bytes, data: dict[str, Any], verbatim: bool, utf8: bool) -> None:
        self.raw = raw
        self.data = data
        self.verbatim = verbatim
        self.utf8 = utf8  # raw is strict UTF-8 JSON, parsed as such: string_literal may look

    def literal(self, value: str) -> memoryview | None:
        """``value``'s JSON literal as it stands in the client's bytes (see ``string_literal``)."""
        return string_literal(self.raw, value) if self.utf8 else None

    def changed(self) -> None:
        """The router edited ``data``: from now on it is what goes upstream."""
        self.verbatim = False

    def upstream(self, params: dict[str, Any] | None = None) -> bytes:
        """The bytes to send: the client's plus ``params`` as ``ec_transfer_params``,
        else the parsed body (with ``params``) serialised. ``data`` is never left changed."""
        if self.verbatim:
            return self.raw if not params else splice_last_field(self.raw, self.data, params)
        if not params:
            return json.dumps(self.data).encode()
        return json.dumps({**self.data, EC_TRANSFER_PARAMS: params}).encode()


def parse(raw: bytes) -> ClientBody:
    """The body as the router and the consumer will both read it; a client's top-level
    ``ec_transfer_params`` dropped. ValueError (json's) when it is not JSON,
    ``NotAnObject`` when it is JSON but not an object."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None:
        hook = _Objects()
        try:
            data = _loads(text, hook)
        except ValueError:
            pass
        else:
            if not isinstance(data, dict):
                raise NotAnObject("request body must be a JSON object")
            verbatim = not hook.repeated and EC_TRANSFER_PARAMS not in data
            data.pop(EC_TRANSFER_PARAMS, None)
            return ClientBody(raw, data, verbatim, utf8=True)
    # Not plain UTF-8 JSON (a BOM, another encoding, or garbage): exactly what the
    # router always did, json's detection of the encoding included; never sent as is.
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise NotAnObject("request body must be a JSON object")
    data.pop(EC_TRANSFER_PARAMS, None)
    return ClientBody(raw, data, verbatim=False, utf8=False)


# A string value this long is not scanned by json character by character: found with
# ``find`` (memchr) and sliced, it is put back after json parsed the rest.
LONG_VALUE = 64 << 10
# What stands in for a long value while json parses the rest: a secret of this process
# (no client can spell it) and the value's number; json.dumps escapes the NUL.
_STAND_IN = f"\x00encoderpool-long-{os.urandom(8).hex()}-"
# Bounds of the walk over the text's strings, so a body built to make it slow cannot:
# past them json parses the whole text as usual.
_STRINGS_WALKED = 4096
_RUN = 64  # backslashes before a quote, or whitespace before a value


def _loads(text: str, hook: _Objects) -> Any:
    """``json.loads(text, object_pairs_hook=hook)``, faster for long string values.

    A long string standing as an object's value, with no backslash in it, decodes
    to exactly the characters between its quotes: those are cut out with ``find``,
    json parses the rest with a stand-in in their place, and the hook puts them
    back. One difference from json, on purpose: such a value's raw control
    characters (invalid JSON) are not looked for; the consumer, parsing the same
    bytes with json, refuses that body, so nothing the router let through is read
    differently there.
    """
    spans = _long_values(text) if len(text) >= LONG_VALUE else []
    if not spans:
        return json.loads(text, object_pairs_hook=hook)
    pieces: list[str] = []
    prev = 0
    for n, (start, end) in enumerate(spans):
        stand_in = f"{_STAND_IN}{n}"
        hook.long[stand_in] = text[start:end]
        pieces += (text[prev:start], json.dumps(stand_in)[1:-1])
        prev = end
    pieces.append(text[prev:])
    data = json.loads("".join(pieces), object_pairs_hook=hook)
    if hook.put_back != len(spans):  # not where the walk said: let json do it all
        hook.reset()
        return json.loads(text, object_pairs_hook=hook)
    return data


def _long_values(text: str) -> list[tuple[int, int]]:
    """Where the long, backslash-free strings that are object values lie in ``text``
    (between their quotes), walking string by string as json tokenises a valid text;
    none when the walk would be long (``_STRINGS_WALKED``, ``_RUN``)."""
    spans: list[tuple[int, int]] = []
    i = 0
    for _ in range(_STRINGS_WALKED):
        start = text.find('"', i)
        if start < 0:
            return spans
        end = _closing_quote(text, start)
        if end is None:
            return []
        if end - start > LONG_VALUE and text.find("\\", start, end) < 0:
            k = start - 1
            while k >= 0 and start - k <= _RUN and text[k] in " \t\n\r":
                k -= 1
            if k >= 0 and text[k] == ":":
                spans.append((start + 1, end))
        i = end + 1
    return []


def _closing_quote(text: str, start: int) -> int | None:
    """The quote closing the string opened at ``start``; None if there is none or
    a run of backslashes before a quote is longer than ``_RUN``."""
    j = start + 1
    while True:
        q = text.find('"', j)
        if q < 0:
            return None
        run = q
        while text[run - 1] == "\\":
            run -= 1
            if q - run > _RUN:
                return None
        if (q - run) % 2 == 0:
            return q
        j = q + 1


def splice_last_field(raw: bytes, data: dict[str, Any], params: dict[str, Any]) -> bytes:
    """``raw`` (a JSON object whose parse is ``data``, free of ``ec_transfer_params``)
    with ``"ec_transfer_params": params`` added as its last member."""
    end = len(raw.rstrip(_JSON_WS)) - 1
    if end < 0 or raw[end] != 0x7D:  # "}": json.loads would not have given a dict
        raise ValueError("not a JSON object")
    field = json.dumps({EC_TRANSFER_PARAMS: params}).encode()  # b'{"ec_transfer_params": ...}'
    sep = b"," if data else b""
    return b"".join((memoryview(raw)[:end], sep, memoryview(field)[1:]))


# Long strings only: for short ones serialising is cheaper than looking.
LITERAL_MIN = 4096
# At most this many strings before the one looked for are walked past.
_WALK_BUDGET = 512


def string_literal(raw: bytes, value: str) -> memoryview | None:
    """``value``'s JSON string literal (quotes included) as it stands in ``raw``, so a
    long string can be copied into another document instead of serialised again.

    ``raw`` must be a valid JSON text in strict UTF-8 (``json.loads`` accepted it).
    Found only where ``value`` stands unescaped: it holds no ``"`` or backslash, its
    first occurrence after a ``"`` is followed by ``"``, and that first quote opens a
    string (counted from the start, escapes included). Such a literal decodes to
    exactly ``value``, and, being a whole literal of a valid text, holds no control
    characters. Anything else (an escaped ``/``, a body too full of strings to walk
    cheaply): None.
    """
    if len(value) < LITERAL_MIN or '"' in value or "\\" in value:
        return None
    needle = value.encode()
    at = raw.find(b'"' + needle[:256])
    end = at + 1 + len(needle)
    if at < 0 or end >= len(raw) or raw[end] != 0x22 or not raw.startswith(needle, at + 1):
        return None
    if not _opens_string(raw, at):
        return None
    return memoryview(raw)[at : end + 1]


def _opens_string(raw: bytes, at: int) -> bool:
    """Whether the ``"`` at ``raw[at]`` opens a string of the valid JSON text ``raw``.

    Outside strings a quote always opens one; inside, the next quote not escaped by
    an odd run of backslashes closes it. Walks string by string (``find``, not byte
    by byte); False when more than ``_WALK_BUDGET`` strings come first.
    """
    i = 0
    for _ in range(_WALK_BUDGET):
        start = raw.find(b'"', i, at + 1)  # opens a string (we are outside one)
        if start == at:
            return True
        if start < 0:
            return False
        i = start + 1
        while True:  # the quote that closes it
            q = raw.find(b'"', i)
            if q < 0:
                return False
            run = q
            while raw[run - 1] == 0x5C:  # backslashes just before it (inside the string)
                run -= 1
                if q - run > _RUN:
                    return False
            if (q - run) % 2 == 0:
                break  # not escaped: closes
            if q == at:
                return False  # an escaped quote inside a string
            i = q + 1
        if q >= at:
            return False  # raw[at] lies inside this string (or closes it)
        i = q + 1
    return False
