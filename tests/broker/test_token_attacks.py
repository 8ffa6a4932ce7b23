"""The token-attack list of TESTING.md, at the broker (``POST /sandbox/refresh {token}``)."""

from __future__ import annotations

import base64
import json
import time

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tests.broker.conftest import Harness
from tests.figures import RecordProperty, report


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _forge(header: dict, claims: dict, signature: bytes = b"") -> str:
    return ".".join(
        [_b64(json.dumps(header).encode()), _b64(json.dumps(claims).encode()), _b64(signature)]
    )


async def _grant(h: Harness) -> tuple[dict, dict, dict]:
    k = h.key("alice")
    r = await h.client.post("/sandbox/acquire", json={"thread_id": "thr_t"}, headers=k)
    assert r.status_code == 200
    g = r.json()
    return k, g, jwt.decode(g["token"], options={"verify_signature": False})


def _attacks(h: Harness, token: str, claims: dict) -> dict[str, str]:
    header = jwt.get_unverified_header(token)
    jwk = h.broker.keyring.jwks()["keys"][0]
    public_raw = base64.urlsafe_b64decode(jwk["x"] + "==")
    other = Ed25519PrivateKey.generate()
    now = int(time.time())

    def resign(**changes: object) -> str:
        key = next(k for k in h.broker.keyring._keys.values() if k.kid == header["kid"])
        return jwt.encode(
            {**claims, **changes}, key.private, algorithm="EdDSA", headers={"kid": header["kid"]}
        )

    head, _payload, sig = token.split(".")
    edited_claims = {**claims, "caps": ["fs_read", "fs_write", "exec", "shell", "admin"]}
    return {
        "alg none": _forge({"alg": "none", "typ": "JWT", "kid": header["kid"]}, claims),
        "hs256 with public key": jwt.encode(
            claims, public_raw, algorithm="HS256", headers={"kid": header["kid"]}
        ),
        "unknown kid": jwt.encode(claims, other, algorithm="EdDSA", headers={"kid": "k_nope"}),
        "right kid, wrong key": jwt.encode(
            claims, other, algorithm="EdDSA", headers={"kid": header["kid"]}
        ),
        "expired": resign(exp=now - 120, iat=now - 1000, nbf=now - 1000),
        "future nbf": resign(nbf=now + 3600),
        "wrong iss": resign(iss="https://evil.example"),
        "wrong aud": resign(aud="someone-else"),
        "wrong typ": resign(typ="JWT"),
        "edited payload": f"{head}.{_b64(json.dumps(edited_claims).encode())}.{sig}",
        "oversized": token + "A" * 9000,
        "garbage": "not.a.token",
        "empty segments": "..",
    }


@pytest.mark.reliability
async def test_token_attacks_rejected_at_broker(
    harness: Harness, record_property: RecordProperty
) -> None:
    k, g, claims = await _grant(harness)
    attacks = _attacks(harness, g["token"], claims)
    for name, forged in attacks.items():
        r = await harness.client.post("/sandbox/refresh", json={"token": forged}, headers=k)
        assert r.status_code in (400, 401), (name, r.status_code, r.text)
        assert r.json()["error"]["code"] in (
            "UNAUTHENTICATED",
            "TOKEN_EXPIRED",
            "INVALID_REQUEST",
        ), name
    report(
        record_property,
        f"broker: {len(attacks)} token attacks ({', '.join(attacks)}) all rejected "
        "with 400/401 and the error envelope",
    )


async def test_replay_after_release_and_recreation(harness: Harness) -> None:
    k, g, _claims = await _grant(harness)
    r = await harness.client.post(
        "/sandbox/release", json={"session_id": g["session_id"]}, headers=k
    )
    assert r.status_code == 204
    r = await harness.client.post("/sandbox/refresh", json={"token": g["token"]}, headers=k)
    assert r.status_code == 410
    # Terminate and re-create: a new sandbox, a new binding; the old token stays dead.
    g2 = (
        await harness.client.post("/sandbox/acquire", json={"thread_id": "thr_t"}, headers=k)
    ).json()
    r = await harness.client.delete(
        f"/v1/sandbox/sessions/{g2['session_id']}?terminate=true", headers=k
    )
    assert r.status_code == 204
    g3 = (
        await harness.client.post("/sandbox/acquire", json={"thread_id": "thr_t"}, headers=k)
    ).json()
    assert g3["sandbox_id"] != g2["sandbox_id"]
    for old in (g["token"], g2["token"]):
        r = await harness.client.post("/sandbox/refresh", json={"token": old}, headers=k)
        assert r.status_code == 410


@pytest.mark.parametrize("who", ["other principal"])
async def test_token_of_another_principal(harness: Harness, who: str) -> None:
    _k, g, _ = await _grant(harness)
    r = await harness.client.post(
        "/sandbox/refresh", json={"token": g["token"]}, headers=harness.key("bob")
    )
    assert r.status_code == 403
