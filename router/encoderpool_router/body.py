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
  anything else, e.g. UTF-16, is parsed with json's own detection of the
  encoding and re-serialised),
- no object anywhere repeats a key (a parser keeping the first duplicate
  instead of the last would otherwise see another request than the router
  checked), and
- none of the fields the router owns (``ROUTER_OWNED``, at the top level or in
  ``vllm_xargs``) is there in any spelling (escapes included: the parsed key is
  compared).

Otherwise, or once the router changed anything else (a dropped ``uuid``),
the parsed body is re-serialised.

More savings for large images: json's character-by-character scan skips long
string values, which are cut out of the bytes and decoded alone (``_loads``: the
body is never decoded whole); the media key hashes such a value's bytes as the
client sent them (``ClientBody.utf8_of``), and a producer request copies its
literal from them (``ClientBody.literal``) instead of serialising it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from encoderpool_contracts import EC_TRANSFER_PARAMS

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
    """The parsed body (``data``) and whether ``raw`` may still go upstream as is.

    ``cut``: the long values ``_loads`` cut out of ``raw``, by the identity of the
    ``str`` in ``data``: where each stands in ``raw``, between its quotes. Such a
    value holds no backslash, so those bytes are exactly its UTF-8 encoding and,
    quoted, its JSON literal: the media key hashes them and a producer request
    copies them, with no search and no encoding of a 2 MB string.
    """

    __slots__ = ("cut", "data", "raw", "utf8", "verbatim")

    def __init__(
        self,
        raw: bytes,
        data: dict[str, Any],
        verbatim: bool,
        utf8: bool,
        cut: dict[int, tuple[str, int, int]] | None = None,
    ) -> None:
        self.raw = raw
        self.data = data
        self.verbatim = verbatim
        self.utf8 = utf8  # raw is strict UTF-8 JSON, parsed as such: string_literal may look
        self.cut = cut or {}

    def _span(self, value: str) -> tuple[int, int] | None:
        found = self.cut.get(id(value))
        # Identity, not equality: hashing a 2 MB str for a dict would cost a scan of it.
        # The str is held in ``cut``, so its id cannot name another object meanwhile.
        return (found[1], found[2]) if found is not None and found[0] is value else None

    def utf8_of(self, value: str) -> memoryview | None:
        """``value.encode()`` as the client's own bytes, for a long value ``_loads`` cut out."""
        span = self._span(value)
        return memoryview(self.raw)[span[0] : span[1]] if span is not None else None

    def literal(self, value: str) -> memoryview | None:
        """``value``'s JSON literal as it stands in the client's bytes (see ``string_literal``)."""
        span = self._span(value)
        if span is not None:
            return memoryview(self.raw)[span[0] - 1 : span[1] + 1]  # with its quotes
        return string_literal(self.raw, value) if self.utf8 else None

    def changed(self) -> None:
        """The router edited ``data``: from now on it is what goes upstream."""
        self.verbatim = False

    def upstream(self, params: dict[str, Any] | None = None) -> bytes:
        """The bytes to send: the client's plus ``params`` as ``ec_transfer_params``,
        else the parsed body (with ``params``) serialised. ``data`` is never left changed."""
        parts = self.upstream_parts(params)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def upstream_parts(
        self, params: dict[str, Any] | None = None
    ) -> tuple[bytes] | tuple[memoryview, bytes]:
        """``upstream`` as the buffers it is made of, not joined: a view of the client's
        bytes and the spliced tail, so a 2 MB body is not copied to be sent."""
        if self.verbatim:
            return (self.raw,) if not params else splice_parts(self.raw, self.data, params)
        if not params:
            return (json.dumps(self.data).encode(),)
        return (json.dumps({**self.data, EC_TRANSFER_PARAMS: params}).encode(),)


# Top-level fields the router owns, also inside ``vllm_xargs`` (vLLM copies that
# object's pairs into the sampling parameters' extra args, where connectors read them):
# a client's are dropped, so nobody outside the pool points a consumer at producer
# memory or cache entries of their choosing.
ROUTER_OWNED = (EC_TRANSFER_PARAMS, "kv_transfer_params")
XARGS = "vllm_xargs"


def parse(raw: bytes, reserve: Reserve | None = None) -> ClientBody:
    """The body as the router and the consumer will both read it; the fields the router
    owns dropped (``ROUTER_OWNED``). ValueError (json's) when it is not JSON,
    ``NotAnObject`` when it is JSON but not an object. ``reserve`` is called with what
    the parse will cost in memory (``parse_cost``) before it is spent, and may refuse."""
    hook = _Objects()
    cut: dict[int, tuple[str, int, int]] = {}
    try:
        data = _loads(raw, hook, cut, reserve)
    except ValueError:  # not strict UTF-8 (UnicodeDecodeError), or not JSON as such
        pass
    else:
        if not isinstance(data, dict):
            raise NotAnObject("request body must be a JSON object")
        dropped = _drop_owned(data)
        return ClientBody(raw, data, not hook.repeated and not dropped, utf8=True, cut=cut)
    # Not plain UTF-8 JSON (a BOM, another encoding, or garbage): json.loads of the
    # bytes, its detection of the encoding included, as vLLM reads them; never sent as is.
    if reserve is not None:
        reserve(parse_cost(len(raw), raw) + 4 * len(raw))  # and the text decoded whole
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise NotAnObject("request body must be a JSON object")
    _drop_owned(data)
    return ClientBody(raw, data, verbatim=False, utf8=False)


def _drop_owned(data: dict[str, Any]) -> bool:
    """Drop the client's ``ROUTER_OWNED`` fields, top level and in ``vllm_xargs``;
    whether there were any."""
    dropped = False
    for holder in (data, data.get(XARGS)):
        if isinstance(holder, dict):
            for name in ROUTER_OWNED:
                if name in holder:
                    del holder[name]
                    dropped = True
    return dropped


# What a parse may cost in memory beyond the text, per JSON value: a value follows a
# "[", "," or ":" and an object opens with "{", and none of Python's objects for one
# (a dict, a list, a float, a short str, with the pointer to it) costs more than this
# (measured: 64 bytes per such character for nested empty lists or one-key objects,
# 84 for short escaped strings).
VALUE_BYTES = 96
# A str holds at most 4 bytes per character, a character takes at least 1 byte of text.
STR_BYTES_PER_BYTE = 4
Reserve = Callable[[int], None]


# Texts this short are charged as if every other byte began a value (a value and its
# separator take two bytes at least), not counted: cheaper than looking, and small.
COUNTED_TEXT = 64 << 10


def parse_cost(held: int, text: bytes | memoryview) -> int:
    """The memory a parse of ``text`` may take at most, with ``held`` bytes already held
    (the body as read): ``text`` decoded, its strings, and an object per value."""
    if len(text) < COUNTED_TEXT:
        return held + (STR_BYTES_PER_BYTE + VALUE_BYTES // 2) * len(text)
    b = text if isinstance(text, bytes) else bytes(text)
    values = b.count(b",") + b.count(b":") + b.count(b"[") + b.count(b"{")
    return held + STR_BYTES_PER_BYTE * len(b) + VALUE_BYTES * values


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


def _loads(
    raw: bytes,
    hook: _Objects,
    cut: dict[int, tuple[str, int, int]],
    reserve: Reserve | None = None,
) -> Any:
    """``json.loads(raw.decode(), object_pairs_hook=hook)``, faster for long string values;
    each long value put back is noted in ``cut`` (see ``ClientBody``). ``reserve``: see
    ``parse``.

    A long string standing as an object's value, with no backslash in it, decodes
    to exactly the characters between its quotes: those bytes are decoded alone,
    the rest (the skeleton, with a stand-in in their place) is decoded and parsed
    by json, and the hook puts the values back. The body is never decoded whole:
    the pieces are cut at quotes, which in UTF-8 are never part of another
    character, so the body is strict UTF-8 exactly when every piece is (a
    UnicodeDecodeError otherwise, as for the whole). One difference from json, on
    purpose: such a value's raw control characters (invalid JSON) are not looked
    for; the consumer, parsing the same bytes with json, refuses that body, so
    nothing the router let through is read differently there.
    """
    spans = _long_values(raw) if len(raw) >= LONG_VALUE else []
    if not spans:
        if reserve is not None:
            reserve(parse_cost(len(raw), raw))
        return json.loads(raw.decode("utf-8"), object_pairs_hook=hook)
    view = memoryview(raw)
    pieces: list[bytes | memoryview] = []
    where: dict[str, tuple[int, int]] = {}
    prev = 0
    for start, end in spans:
        pieces.append(view[prev:start])
        prev = end
    pieces.append(view[prev:])
    # The skeleton's cost, and each long value's as one byte per byte (base64, ASCII);
    # a value that is not ASCII may take up to 4: reserved once it is decoded.
    skeleton = b"".join(pieces)
    cost = parse_cost(len(raw) + sum(end - start for start, end in spans), skeleton)
    if reserve is not None:
        reserve(cost)
    pieces = []
    prev = 0
    for n, (start, end) in enumerate(spans):
        stand_in = f"{_STAND_IN}{n}"
        value = str(view[start:end], "utf-8")
        if reserve is not None and not value.isascii():
            cost += (STR_BYTES_PER_BYTE - 1) * (end - start)
            reserve(cost)
        hook.long[stand_in] = value
        where[stand_in] = (start, end)
        pieces += (view[prev:start], json.dumps(stand_in)[1:-1].encode())
        prev = end
    pieces.append(view[prev:])
    data = json.loads(b"".join(pieces).decode("utf-8"), object_pairs_hook=hook)
    if hook.put_back != len(spans):  # not where the walk said: let json do it all
        hook.reset()
        if reserve is not None:
            reserve(cost + parse_cost(0, raw))
        return json.loads(raw.decode("utf-8"), object_pairs_hook=hook)
    for stand_in, value in hook.long.items():
        cut[id(value)] = (value, *where[stand_in])
    return data


def _long_values(raw: bytes) -> list[tuple[int, int]]:
    """Where the long, backslash-free strings that are object values lie in ``raw``
    (between their quotes), walking string by string as json tokenises a valid text;
    none when the walk would be long (``_STRINGS_WALKED``, ``_RUN``). Bytes, not
    characters: in UTF-8 the quote, backslash, colon and whitespace bytes only ever
    stand for themselves."""
    spans: list[tuple[int, int]] = []
    i = 0
    for _ in range(_STRINGS_WALKED):
        start = raw.find(b'"', i)
        if start < 0:
            return spans
        end = _closing_quote(raw, start)
        if end is None:
            return []
        if end - start > LONG_VALUE and raw.find(b"\\", start, end) < 0:
            k = start - 1
            while k >= 0 and start - k <= _RUN and raw[k] in _JSON_WS:
                k -= 1
            if k >= 0 and raw[k] == 0x3A:  # ":"
                spans.append((start + 1, end))
        i = end + 1
    return []


def _closing_quote(raw: bytes, start: int) -> int | None:
    """The quote closing the string opened at ``start``; None if there is none or
    a run of backslashes before a quote is longer than ``_RUN``."""
    j = start + 1
    while True:
        q = raw.find(b'"', j)
        if q < 0:
            return None
        run = q
        while raw[run - 1] == 0x5C:  # a backslash
            run -= 1
            if q - run > _RUN:
                return None
        if (q - run) % 2 == 0:
            return q
        j = q + 1


def splice_last_field(raw: bytes, data: dict[str, Any], params: dict[str, Any]) -> bytes:
    """``raw`` (a JSON object whose parse is ``data``, free of ``ec_transfer_params``)
    with ``"ec_transfer_params": params`` added as its last member."""
    return b"".join(splice_parts(raw, data, params))


def splice_parts(
    raw: bytes, data: dict[str, Any], params: dict[str, Any]
) -> tuple[memoryview, bytes]:
    """``splice_last_field`` unjoined: ``raw`` up to its final ``}`` (a view), then the
    field and the ``}``."""
    end = len(raw.rstrip(_JSON_WS)) - 1
    if end < 0 or raw[end] != 0x7D:  # "}": json.loads would not have given a dict
        raise ValueError("not a JSON object")
    field = json.dumps({EC_TRANSFER_PARAMS: params}).encode()  # b'{"ec_transfer_params": ...}'
    return memoryview(raw)[:end], (b"," if data else b"") + field[1:]


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
