"""Client bodies sent on as the client's bytes: when that is allowed, and the splice.

What the consumer parses (vLLM: Python's json, as here) must be exactly what the
router checked, plus the router's ``ec_transfer_params`` and nothing of the client's
under that name; every case that could make the two differ is re-serialised.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

import pytest

from encoderpool_router import body as body_mod
from encoderpool_router.body import NotAnObject, parse, splice_last_field, string_literal
from encoderpool_router.media import media_key
from encoderpool_router.producer_request import encoder_request, encoder_request_bytes

EC = "ec_transfer_params"
PARAMS = {"abc123": {"num_encoder_tokens": 16, "encoderpool": {"v": 1, "fingerprint": "0" * 16}}}


def pairs_of(data: bytes) -> list[tuple[str, Any]]:
    """The top-level members as the consumer's parser meets them, duplicates included."""
    top: list[list[tuple[str, Any]]] = []

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        top.append(pairs)
        return dict(pairs)

    json.loads(data, object_pairs_hook=hook)
    return top[-1]  # the outermost object is completed last


def consumer_view(data: bytes) -> tuple[dict[str, Any], list[Any]]:
    """What the consumer parses, and every value it meets under the router's key at the top."""
    return json.loads(data), [v for k, v in pairs_of(data) if k == EC]


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "m", "messages": []}',
        b'{"model":"m","messages":[]}',
        b'  {\n\t"model" : "m" ,\r\n "messages" : [ ] \n}\n\t\r ',
        b'{"text": "caf\\u00e9 \\ud83d\\ude00 \\" \\\\ \\/ \\n",'
        b' "raw": "caf\xc3\xa9 \xf0\x9f\x98\x80"}',
        b'{"x": "\\ud800", "n": NaN, "big": 123456789012345678901234567890, "f": 1e400}',
        b'{"nested": {"ec_transfer_params": {"k": 1}}, "list": [{"ec_transfer_params": 2}]}',
    ],
)
def test_plain_utf8_bodies_go_on_as_sent_with_the_params_spliced_last(raw: bytes) -> None:
    b = parse(raw)
    assert b.verbatim
    assert b.upstream() is raw  # no params: the very bytes
    out = b.upstream(PARAMS)
    end = len(raw.rstrip(b" \t\n\r")) - 1
    assert out.startswith(raw[:end])  # the client's bytes, untouched, then ours
    seen, ours = consumer_view(out)
    assert ours == [PARAMS]
    expected = json.loads(raw)
    for key in expected:
        a, b2 = seen[key], expected[key]
        assert a == b2 or (isinstance(a, float) and math.isnan(a) and math.isnan(b2))
    # A nested key of that name is the client's own data, not the router's field.
    if b"nested" in raw:
        assert seen["nested"] == {EC: {"k": 1}}
        assert seen["list"] == [{EC: 2}]


@pytest.mark.parametrize("raw", [b"{}", b"{ }", b" {\n} \n"])
def test_an_empty_object_gets_the_params_without_a_comma(raw: bytes) -> None:
    out = parse(raw).upstream(PARAMS)
    assert json.loads(out) == {EC: PARAMS}


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "m", "ec_transfer_params": {"evil": 1}}',
        b'{"ec_transfer_params": {"evil": 1}, "model": "m"}',
        b'{"model": "m", "ec\\u005ftransfer_params": {"evil": 1}}',  # an escaped spelling
        b'{"model": "m", "\\u0065c_transfer_params": {"evil": 1}}',
        b'{"ec_transfer_params": {"evil": 1}, "model": "m", "ec_transfer_params": {"evil": 2}}',
        b'{"ec_transfer_params": null, "model": "m"}',
    ],
)
def test_a_clients_own_params_in_any_spelling_never_reach_the_consumer(raw: bytes) -> None:
    b = parse(raw)
    assert not b.verbatim
    assert EC not in b.data
    for params in (PARAMS, {}):
        seen, ours = consumer_view(b.upstream(params))
        assert ours == ([PARAMS] if params else [])
        assert b"evil" not in b.upstream(params)
        assert seen["model"] == "m"


@pytest.mark.parametrize(
    "raw",
    [
        # The consumer must check what the router checked: with repeated keys a parser
        # keeping the first would see the private URL, so the body is re-serialised.
        b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url":'
        b' {"url": "http://10.0.0.1/x", "url": "https://example.com/a.png"}}]}]}',
        b'{"messages": [], "messages": [{"role": "user", "content": "hi"}]}',
        b'{"a": {"b": 1, "b": 2}}',
    ],
)
def test_repeated_keys_anywhere_mean_the_parsed_body_is_sent(raw: bytes) -> None:
    b = parse(raw)
    assert not b.verbatim
    out = b.upstream(PARAMS)
    assert b"10.0.0.1" not in out
    seen, ours = consumer_view(out)
    assert ours == [PARAMS]
    assert {k: v for k, v in seen.items() if k != EC} == json.loads(raw)


def test_other_encodings_are_parsed_as_before_and_re_serialised() -> None:
    doc = {"model": "m", "text": "café"}
    for raw in (
        json.dumps(doc).encode("utf-16"),
        json.dumps(doc).encode("utf-32-le"),
        b"\xef\xbb\xbf" + json.dumps(doc).encode(),  # a UTF-8 BOM
    ):
        b = parse(raw)
        assert not b.verbatim
        assert b.data == doc
        assert json.loads(b.upstream(PARAMS)) == {**doc, EC: PARAMS}
        assert b.literal("x" * 5000) is None  # never looked for in such bytes


@pytest.mark.parametrize("raw", [b"", b"{", b'{"a": 1} x', b'{"a": "\xff"}', b"nope"])
def test_not_json_is_a_value_error(raw: bytes) -> None:
    with pytest.raises(ValueError, match=r"\w") as e:
        parse(raw)
    assert not isinstance(e.value, NotAnObject)


@pytest.mark.parametrize("raw", [b"[]", b'"text"', b"1", b"null", b"[{}]"])
def test_json_that_is_not_an_object_says_so(raw: bytes) -> None:
    with pytest.raises(NotAnObject, match="must be a JSON object"):
        parse(raw)


def test_once_the_router_edits_the_body_it_sends_its_edit() -> None:
    b = parse(b'{"messages": [{"content": [{"type": "image_url", "uuid": "u"}]}]}')
    del b.data["messages"][0]["content"][0]["uuid"]
    b.changed()
    assert b"uuid" not in b.upstream(PARAMS)
    assert json.loads(b.upstream(PARAMS))[EC] == PARAMS


def test_splicing_refuses_what_is_not_an_object() -> None:
    with pytest.raises(ValueError, match="not a JSON object"):
        splice_last_field(b"[1] ", {}, PARAMS)


def _random_value(rng: random.Random, depth: int) -> Any:
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice([None, True, False, 0, -1, 2.5, 10**20])
    if kind in (1, 2, 3):
        alphabet = 'ab "\\/\n\t\x01é€😀\u2028'
        return "".join(rng.choice(alphabet) for _ in range(rng.randrange(6)))
    if kind in (4, 5):
        return {_random_key(rng): _random_value(rng, depth + 1) for _ in range(rng.randrange(4))}
    return [_random_value(rng, depth + 1) for _ in range(rng.randrange(4))]


def _random_key(rng: random.Random) -> str:
    return rng.choice(["model", "messages", "a", "é", "ec_transfer_params", 'q"', "\\"])


def test_random_documents_reach_the_consumer_as_the_router_read_them() -> None:
    """Any object, any whitespace and escaping: the consumer parses the router's view
    (client fields as the router parsed them, its params once, no client params)."""
    rng = random.Random(15)  # noqa: S311
    for i in range(500):
        doc = {_random_key(rng): _random_value(rng, 0) for _ in range(rng.randrange(5))}
        raw = json.dumps(
            doc,
            ensure_ascii=rng.random() < 0.5,
            indent=rng.choice([None, 0, 2, "\t"]),
            separators=rng.choice([None, (",", ":"), (" ,\n", " :  ")]),
        ).encode() + rng.choice([b"", b"\n", b" \r\n\t"])
        b = parse(raw)
        assert b.verbatim == (EC not in doc), (i, raw)
        expected = {k: v for k, v in doc.items() if k != EC}
        for params in (PARAMS, {}):
            seen, ours = consumer_view(b.upstream(params))
            assert ours == ([PARAMS] if params else []), (i, raw)
            assert {k: v for k, v in seen.items() if k != EC} == expected, (i, raw)


# --- a long string's literal, copied instead of serialised ----------------------------------


def long_url(n: int = 6000, seed: int = 1) -> str:
    rng = random.Random(seed)  # noqa: S311
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    return "data:image/png;base64," + "".join(rng.choice(alphabet) for _ in range(n))


def chat(url: str, text: str = "Describe this.", **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": 'You are "careful".\nBe brief \\ exact.'},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": text},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            },
        ],
        **extra,
    }


def test_a_long_url_is_found_as_its_literal_past_escaped_strings() -> None:
    url = long_url()
    raw = json.dumps(chat(url, text='a \\" tricky \\\\" one "')).encode()
    found = string_literal(raw, url)
    assert found is not None
    assert bytes(found) == json.dumps(url).encode()


@pytest.mark.parametrize(
    "make",
    [
        # The producer must get exactly the client's URL, or a fresh serialisation of it.
        lambda url: json.dumps(chat(url)).replace("/", "\\/"),  # escaped slashes
        lambda url: json.dumps(chat(url, text=url[:-1] + "Y")),  # a text that starts the same
        lambda url: json.dumps(chat("x", text='say "' + url + '"')),  # inside another string
        lambda url: json.dumps(chat("x", text='say "' + url)),  # after an escaped quote
    ],
)
def test_a_url_not_standing_plainly_in_the_bytes_is_not_copied(make: Any) -> None:
    url = long_url()
    raw = make(url).encode()
    assert string_literal(raw, url) is None


def test_structure_between_two_strings_is_never_taken_for_a_literal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(body_mod, "LITERAL_MIN", 1)
    raw = b'["a", 1, 2, "b"]'
    assert string_literal(raw, ", 1, 2, ") is None
    assert bytes(string_literal(raw, "b") or b"") == b'"b"'


def test_short_strings_and_crowded_bodies_are_serialised(monkeypatch: pytest.MonkeyPatch) -> None:
    url = long_url()
    assert string_literal(json.dumps(chat("short")).encode(), "short") is None
    crowded = json.dumps({"a": ["s"] * 600, "url": url}).encode()
    assert string_literal(crowded, url) is None  # past the walk's budget
    monkeypatch.setattr(body_mod, "_WALK_BUDGET", 10_000)
    assert string_literal(crowded, url) is not None


@pytest.mark.parametrize("uuid", [None, "item-7"])
def test_the_producer_request_holds_the_clients_literal_and_equals_the_serialised_one(
    uuid: str | None,
) -> None:
    url = long_url()
    doc = chat(url, mm_processor_kwargs={"max_pixels": 1000})
    part = doc["messages"][1]["content"][1]
    if uuid is not None:
        part["uuid"] = uuid
    b = parse(json.dumps(doc).encode())
    out = encoder_request_bytes(b.data, b.data["messages"][1]["content"][1], b.literal)
    assert json.loads(out) == encoder_request(b.data, part)
    assert out.count(url.encode()) == 1
    # Without the client's bytes: plain serialisation, the same document.
    assert json.loads(encoder_request_bytes(b.data, part)) == json.loads(out)


def test_a_client_string_equal_to_the_marker_falls_back_to_serialising() -> None:
    url = long_url()
    doc = chat(url, model="\u0000encoderpool-url\u0000")
    b = parse(json.dumps(doc).encode())
    part = b.data["messages"][1]["content"][1]
    out = encoder_request_bytes(b.data, part, b.literal)
    assert json.loads(out) == encoder_request(b.data, part)


# --- long values cut out of json's scan ------------------------------------------------------


@pytest.fixture
def short_long_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every string of 2+ characters counts as long: the random documents exercise the cut."""
    monkeypatch.setattr(body_mod, "LONG_VALUE", 2)


@pytest.mark.usefixtures("short_long_values")
def test_random_documents_parse_as_json_parses_them_with_long_values_cut_out() -> None:
    rng = random.Random(16)  # noqa: S311
    cut = 0
    for i in range(1500):
        doc = {_random_key(rng): _random_value(rng, 0) for _ in range(1 + rng.randrange(5))}
        raw = json.dumps(
            doc,
            ensure_ascii=rng.random() < 0.5,
            indent=rng.choice([None, 0, 2, "\t"]),
            separators=rng.choice([None, (",", ":"), (" ,\n", " :  ")]),
        ).encode()
        cut += bool(body_mod._long_values(raw))
        b = parse(raw)
        assert b.data == {k: v for k, v in json.loads(raw).items() if k != EC}, (i, raw)
        assert b.verbatim == (EC not in doc), (i, raw)
    assert cut > 150  # the cut was taken, not only the fallback


@pytest.mark.usefixtures("short_long_values")
@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": "xy", "a": "zw"}',  # repeated, cut both times: still noted
        b'{"k": ["list", "of", "strings"], "v": {"w": "nested"}}',  # in lists: json's
        b'{"xyz": 1, "esc": "a\\"b", "bs": "a\\\\", "u": "\\u00e9t\\u00e9"}',
        b'{"s": "caf\xc3\xa9 \xf0\x9f\x98\x80", "t" :\n\t "spaced"}',
    ],
)
def test_cut_and_put_back_equals_json(raw: bytes) -> None:
    b = parse(raw)
    assert b.data == json.loads(raw)
    assert b.verbatim == (b'"a"' not in raw)


@pytest.mark.usefixtures("short_long_values")
def test_a_client_cannot_spell_the_stand_in() -> None:
    """A value that looks like a stand-in of another process is the client's text."""
    fake = "\u0000encoderpool-long-0000000000000000-0"
    raw = json.dumps({"a": fake, "b": "real value"}).encode()
    assert parse(raw).data == {"a": fake, "b": "real value"}


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": "' + b"\\\\" * 100 + b'", "b": "' + b"x" * 70_000 + b'"}',  # a long run
        b'{"a": [' + b'"s",' * 5000 + b'"t"], "b": "' + b"x" * 70_000 + b'"}',  # many strings
        b'{"a":' + b" " * 100 + b'"' + b"x" * 70_000 + b'"}',  # much whitespace before
    ],
)
def test_bodies_built_to_make_the_walk_long_are_parsed_by_json(raw: bytes) -> None:
    assert body_mod._long_values(raw) == []
    assert parse(raw).data == json.loads(raw)


def test_a_long_value_with_a_raw_control_character_is_the_consumers_to_refuse() -> None:
    """The one difference from json, on purpose: not looked for inside a long value.
    json (the consumer's parser) refuses the very bytes the router would send on."""
    raw = b'{"a": "' + b"x" * 70_000 + b'\x01"}'
    b = parse(raw)
    assert b.verbatim
    with pytest.raises(ValueError, match="Invalid control character"):
        json.loads(b.upstream(PARAMS))


def test_a_large_image_body_is_cut_and_equals_json() -> None:
    url = long_url(2_000_000)
    raw = json.dumps(chat(url)).encode()
    (span,) = body_mod._long_values(raw)
    assert raw[span[0] : span[1]] == url.encode()
    assert parse(raw).data == json.loads(raw)


# --- long values read from the client's bytes: key, literal, strict UTF-8 ---------------------


def test_a_long_urls_key_and_literal_come_from_the_clients_bytes() -> None:
    url = long_url(100_000)
    raw = json.dumps(chat(url, text="caf\u00e9 \U0001f600"), ensure_ascii=False).encode()
    b = parse(raw)
    part = b.data["messages"][1]["content"][1]
    seen = b.data["messages"][1]["content"][1]["image_url"]["url"]
    view = b.utf8_of(seen)
    assert view is not None
    assert view.obj is raw
    assert bytes(view) == url.encode()
    assert media_key(part, b.utf8_of) == media_key(part)  # the same key either way
    assert media_key(part, b.utf8_of) == media_key(json.loads(raw)["messages"][1]["content"][1])
    literal = b.literal(seen)
    assert literal is not None
    assert bytes(literal) == json.dumps(url).encode()
    # An equal string that is not the parsed one is not taken for it (identity, not value).
    assert b.utf8_of(url) is None
    assert b.utf8_of("x") is None


def test_a_long_url_with_escapes_is_json_parsed_and_hashed_from_its_value() -> None:
    url = long_url(100_000)
    raw = json.dumps(chat(url)).replace("/", "\\/").encode()  # every slash escaped
    b = parse(raw)
    assert b.verbatim
    part = b.data["messages"][1]["content"][1]
    assert part["image_url"]["url"] == url
    assert b.utf8_of(part["image_url"]["url"]) is None  # not cut out: json decoded it
    assert media_key(part, b.utf8_of) == media_key(chat(url)["messages"][1]["content"][1])
    assert b.literal(part["image_url"]["url"]) is None  # not standing plainly in the bytes
    out = encoder_request_bytes(b.data, part, b.literal)
    assert json.loads(out) == encoder_request(b.data, part)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": "' + b"x" * 70_000 + b'\xff"}',  # invalid UTF-8 inside the long value
        b'{"a": "' + b"x" * 70_000 + b'\xc3"}',  # a character cut short by the quote
        b'{"b": "\xff", "a": "' + b"x" * 70_000 + b'"}',  # in the skeleton
        b'{"a": "' + b"x" * 70_000 + b'", "b": "\xed\xa0\x80"}',  # an encoded surrogate
    ],
)
def test_a_body_not_strict_utf8_anywhere_is_parsed_as_before_never_sent_as_is(raw: bytes) -> None:
    """As when the body was decoded whole: json's own decoding of the bytes decides
    (it passes an encoded surrogate), and what it accepts is re-serialised."""
    with pytest.raises(ValueError, match=r"\w"):
        raw.decode("utf-8")
    assert body_mod._long_values(raw)  # the cut is taken: each piece is checked
    try:
        expected = json.loads(raw)
    except ValueError:
        with pytest.raises(ValueError, match=r"\w"):
            parse(raw)
        return
    b = parse(raw)
    assert b.data == expected
    assert not b.verbatim
    assert b.literal(b.data["a"]) is None
    assert b.utf8_of(b.data["a"]) is None


def test_a_bom_before_a_long_value_is_parsed_as_before_and_re_serialised() -> None:
    url = long_url(100_000)
    raw = b"\xef\xbb\xbf" + json.dumps(chat(url)).encode()
    b = parse(raw)
    assert not b.verbatim
    assert b.data == chat(url)
    part = b.data["messages"][1]["content"][1]
    assert b.utf8_of(part["image_url"]["url"]) is None
    assert b.literal(part["image_url"]["url"]) is None


def test_multibyte_characters_next_to_a_long_value_are_cut_intact() -> None:
    value = "\u00e9" * 40_000 + "\U0001f600" * 20_000  # long in bytes, no backslash
    doc = {"\u00e9": "\u20ac", "v": value, "w": "\U0001f600"}
    raw = json.dumps(doc, ensure_ascii=False).encode()
    b = parse(raw)
    assert b.data == doc
    assert b.verbatim
    view = b.utf8_of(b.data["v"])
    assert view is not None
    assert bytes(view) == value.encode()


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-16-be", "utf-32-le", "utf-32"])
def test_other_encodings_with_a_long_value_are_parsed_as_before(encoding: str) -> None:
    """Their quote bytes are found by the walk too, but the skeleton is no JSON as
    UTF-8 (NULs between the characters): json's own detection parses the body."""
    doc = chat(long_url(100_000))
    raw = json.dumps(doc).encode(encoding)
    b = parse(raw)
    assert not b.verbatim
    assert b.data == doc
    part = b.data["messages"][1]["content"][1]
    assert b.utf8_of(part["image_url"]["url"]) is None
    assert json.loads(b.upstream(PARAMS)) == {**doc, EC: PARAMS}


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "m", "vllm_xargs": {"ec_transfer_params": "x", "keep": 1}}',
        b'{"model": "m", "vllm_xargs": {"kv_transfer_params": "x", "keep": 1}}',
        b'{"model": "m", "vllm_xargs": {"ec\\u005ftransfer_params": "x", "keep": 1}}',
        b'{"model": "m", "kv_transfer_params": {"remote": 1}, "vllm_xargs": {"keep": 1}}',
    ],
)
def test_the_fields_the_router_owns_are_dropped_inside_vllm_xargs_too(raw: bytes) -> None:
    """vLLM copies ``vllm_xargs`` into the sampling parameters' extra args, where the
    connectors read ``ec_transfer_params``: a client's never reaches a consumer that way."""
    body = parse(raw)
    sent = json.loads(body.upstream({"mm_hash": "router's"}))
    assert sent["vllm_xargs"] == {"keep": 1}
    assert "kv_transfer_params" not in sent
    assert sent["ec_transfer_params"] == {"mm_hash": "router's"}
    assert not body.verbatim
