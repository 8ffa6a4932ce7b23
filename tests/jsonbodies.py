"""Hostile JSON bodies: nested, huge and malformed, for every route that takes a body.

Shared by the broker's and the dataplane's JSON fuzz (``test_json_fuzz.py``). No
body names a field a route needs with a valid value, so none asks for work; a route
whose fields are all optional (``POST /v1/sandboxes``) may take one that parses as
a request with unknown fields only.
"""

from __future__ import annotations

import random

#: Nesting depths tried, from harmless to far beyond any parser's recursion limit.
DEPTHS = (10, 31, 33, 100, 200, 1_000, 10_000, 100_000)
#: Bodies nested at least this deep must be refused with 400 by a route that reads JSON.
REFUSED_DEPTH = 100
#: Larger than any route accepts (the broker and dataplane take at most 1 MiB of JSON).
HUGE = 2 * 1024 * 1024 + 1


def nested(depth: int, kind: str) -> bytes:
    """``depth`` levels of arrays, objects, or both, around a scalar."""
    if kind == "array":
        return b"[" * depth + b"1" + b"]" * depth
    if kind == "object":
        return b'{"a":' * depth + b"1" + b"}" * depth
    return b'[{"a":' * (depth // 2) + b"1" + b"}]" * (depth // 2)


def deep_bodies() -> list[tuple[str, int, bytes]]:
    """(label, depth, body): nested values alone, under a key, and truncated."""
    out = []
    for depth in DEPTHS:
        for kind in ("array", "object", "mixed"):
            out.append((f"{kind}-{depth}", depth, nested(depth, kind)))
        out.append((f"in-object-{depth}", depth + 1, b'{"x":' + nested(depth, "array") + b"}"))
    # Opened and never closed: the parser sees the depth before it sees the end.
    out.append(("unclosed-100000", 100_000, b"[" * 100_000))
    out.append(("unclosed-objects", 50_000, b'{"a":' * 50_000))
    return out


def malformed_bodies(seed: int = 17) -> list[tuple[str, bytes]]:
    """(label, body): not JSON, not UTF-8, not an object, wrong types, odd numbers."""
    rng = random.Random(seed)
    bodies = [
        ("empty", b""),
        ("blank", b"   \n\t "),
        ("truncated-object", b'{"name": "x'),
        ("truncated-key", b'{"na'),
        ("truncated-after-colon", b'{"name":'),
        ("trailing-comma", b'{"name": "x",}'),
        ("trailing-garbage", b'{"name": "x"} x'),
        ("two-documents", b"{}{}"),
        ("single-quotes", b"{'name': 'x'}"),
        ("comment", b'{"name": "x" /* c */}'),
        ("bom", b'\xef\xbb\xbf{"name": "x"}'),
        ("invalid-utf8", b'{"name": "\xff\xfe"}'),
        ("invalid-utf8-key", b'{"\xc3\x28": 1}'),
        ("overlong-utf8", b'{"name": "\xc0\xaf"}'),
        ("utf16", '{"name": "x"}'.encode("utf-16")),
        ("lone-surrogate", b'{"name": "\\ud800"}'),
        ("bad-escape", b'{"name": "\\x41"}'),
        ("nul-in-string", b'{"name": "a\\u0000b"}'),
        ("raw-control-char", b'{"name": "a\x01b"}'),
        ("nan", b'{"timeout": NaN}'),
        ("infinity", b'{"timeout": Infinity}'),
        ("minus-infinity", b'{"timeout": -Infinity}'),
        ("bare-nan", b"NaN"),
        ("huge-exponent", b'{"timeout": 1e999999}'),
        ("huge-int", b'{"timeout": ' + b"9" * 5000 + b"}"),
        ("negative-zero", b'{"timeout": -0.0}'),
        ("duplicate-keys", b'{"name": "a", "name": 5, "name": null}'),
        ("many-duplicate-keys", b"{" + b",".join([b'"k": 1'] * 20_000) + b"}"),
        ("null", b"null"),
        ("true", b"true"),
        ("number", b"12"),
        ("string", b'"text"'),
        ("array", b"[]"),
        ("array-of-objects", b'[{"name": "x"}]'),
        ("wrong-types", b'{"name": 5, "thread_id": [], "mode": {}, "scope": "x", "path": 1}'),
        ("null-fields", b'{"name": null, "thread_id": null, "scope": null, "command": null}'),
        ("object-for-string", b'{"command": {"a": 1}, "pattern": {}, "user_id": {}}'),
        ("bool-for-number", b'{"timeout": true, "min_ready": false, "depth": "1"}'),
        ("long-string", b'{"name": "' + b"x" * 500_000 + b'"}'),
        ("many-keys", b"{" + b",".join(b'"k%d": %d' % (i, i) for i in range(40_000)) + b"}"),
        ("long-array", b'{"x": [' + b",".join([b"0"] * 200_000) + b"]}"),
        ("huge", b'{"x": "' + b"y" * HUGE + b'"}'),
    ]
    for i in range(20):
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
        bodies.append((f"random-bytes-{i}", raw))
    return bodies
