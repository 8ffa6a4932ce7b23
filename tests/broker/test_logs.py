import json
import logging

from sandlot.broker.logs import JsonFormatter, RedactingFilter, redact

JWT = "eyJhbGciOiJFZERTQSJ9.eyJzdWIiOiJodW1hbjphbGljZSJ9.c2lnbmF0dXJlLWJ5dGVz"
KEY = "sl_82d35fff09f1_-xho7OC4NWDv6HijEjWSWyqvZE3LQ_3meRzjdX_NGpI"


def test_redact_tokens_keys_and_headers() -> None:
    text = f"token={JWT} key {KEY} Authorization: Bearer abc.def X-Api-Key: {KEY[:20]}zz"
    out = redact(text)
    assert JWT not in out and KEY not in out and "abc.def" not in out
    assert "[REDACTED-TOKEN]" in out and "[REDACTED-KEY]" in out
    assert "sl_82d35fff09f1" not in out


def test_filter_and_json_lines() -> None:
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "got %s", (JWT,), None)
    assert RedactingFilter().filter(record)
    line = JsonFormatter().format(record)
    entry = json.loads(line)
    assert entry["message"] == "got [REDACTED-TOKEN]" and entry["level"] == "info"
