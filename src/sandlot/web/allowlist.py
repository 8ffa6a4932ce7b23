"""What may pass the gateway: upstreams, their paths and methods, and headers.

An :class:`Upstream` is configuration, never a browser's input. :meth:`Allowlist.match`
finds the upstream a URL may go to (its scheme, host and port are the upstream's, its
path lies under one of the upstream's prefixes, its method is one of the upstream's)
or raises :class:`~sandlot.protocol.errors.Forbidden` with ``metadata.reason``:
``url``, ``scheme``, ``host``, ``port``, ``path``, ``method``. Headers pass by name
from a list (:func:`forwarded_headers`, :func:`returned_headers`), and never the
hop-by-hop ones, those a ``Connection`` header names, or the browser's credentials.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import httpx

from sandlot.protocol.errors import Forbidden


def _names(text: str) -> frozenset[str]:
    return frozenset(text.split())


HOP_BY_HOP = _names(
    "connection keep-alive proxy-authenticate proxy-authorization proxy-connection te "
    "trailer trailers transfer-encoding upgrade"
)
#: Never sent upstream, whatever the settings say: the browser's credentials, and what
#: the gateway sets itself.
NEVER_FORWARDED = HOP_BY_HOP | _names(
    "authorization cookie x-api-key x-sandlot-on-behalf-of origin host content-length "
    "accept-encoding expect x-request-id"
)
#: Never returned to the browser, whatever the settings say.
NEVER_RETURNED = HOP_BY_HOP | _names("set-cookie set-cookie2 x-request-id")
#: The browser's request headers sent upstream by default.
FORWARD_REQUEST_HEADERS = _names(
    "accept accept-language cache-control content-type idempotency-key if-match "
    "if-modified-since if-none-match if-range if-unmodified-since last-event-id range"
)
#: The upstream's answer headers returned to the browser by default.
RETURN_RESPONSE_HEADERS = _names(
    "accept-ranges cache-control content-disposition content-encoding content-length "
    "content-range content-type etag last-modified retry-after"
)
DEFAULT_PORTS = {"http": 80, "https": 443}

REFUSALS = {
    "url": "the gateway refuses this URL",
    "scheme": "the gateway does not reach this scheme",
    "host": "the gateway does not reach this host",
    "port": "the gateway does not reach this port",
    "path": "the gateway does not reach this path",
    "method": "the gateway does not allow this method there",
    "redirect": "the sandbox host answered with a redirect, which the gateway does not follow",
    "dns_changed": "the sandbox host's address changed; the gateway refuses to follow it",
}


def refused(reason: str) -> Forbidden:
    """The gateway's refusal, with a stable message per reason."""
    return Forbidden(REFUSALS[reason], metadata={"reason": reason})


@dataclass(frozen=True)
class Upstream:
    """One upstream the gateway may reach.

    ``base_url`` gives its scheme, host and port, and the path under which it answers
    ``GET {base_url}/__meta/version`` (``http://127.0.0.1:8000/dp`` for the dataplane of
    ``sandlot serve``); ``path_prefixes`` the paths calls may address (``("/dp/",)``);
    ``methods`` the HTTP methods they may use (a WebSocket needs ``GET``).
    """

    name: str
    base_url: str
    path_prefixes: tuple[str, ...]
    methods: frozenset[str] = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE"})
    #: Scheme, host (lower case, IDNA) and port.
    origin: tuple[str, str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        url = httpx.URL(self.base_url)
        if url.scheme not in DEFAULT_PORTS or not url.host or url.userinfo or url.query:
            raise ValueError(f"upstream {self.name}: base_url is http(s)://host[:port][/path]")
        prefixes = tuple(self.path_prefixes)
        if not prefixes or not all(p.startswith("/") for p in prefixes):
            raise ValueError(f"upstream {self.name}: path prefixes are absolute paths")
        object.__setattr__(self, "path_prefixes", prefixes)
        object.__setattr__(self, "methods", frozenset(m.upper() for m in self.methods))
        object.__setattr__(self, "origin", origin_of(url))

    @property
    def version_url(self) -> httpx.URL:
        """Where it says which API version it speaks."""
        url = httpx.URL(self.base_url)
        return url.copy_with(path=url.path.rstrip("/") + "/__meta/version")


def origin_of(url: httpx.URL) -> tuple[str, str, int]:
    """Scheme, host (lower case, IDNA) and port of an http(s) URL."""
    return url.scheme, url.raw_host.decode("ascii").lower(), url.port or DEFAULT_PORTS[url.scheme]


class Allowlist:
    """The upstreams calls may go to."""

    def __init__(self, upstreams: Iterable[Upstream]) -> None:
        self.upstreams = list(upstreams)
        names = [u.name for u in self.upstreams]
        if len(set(names)) != len(names):
            raise ValueError("two upstreams have one name")

    def match(
        self, method: str, url: str, *, websocket: bool = False
    ) -> tuple[Upstream, httpx.URL]:
        """The upstream ``method url`` may go to, and the URL (``http``/``https`` for a
        ``ws``/``wss`` one); else ``Forbidden``. URLs are normalized by httpx first
        (``.``/``..`` segments removed); encoded ones left after that are refused."""
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, TypeError, ValueError):
            raise refused("url") from None
        scheme = parsed.scheme
        if websocket:
            scheme = {"ws": "http", "wss": "https"}.get(scheme, scheme)
        if scheme not in DEFAULT_PORTS:
            raise refused("scheme")
        if parsed.userinfo or parsed.fragment or not parsed.host:
            raise refused("url")
        parsed = parsed.copy_with(scheme=scheme)
        _, host, port = origin_of(parsed)
        candidates = [u for u in self.upstreams if u.origin[1] == host]
        if not candidates:
            raise refused("host")
        candidates = [u for u in candidates if u.origin[2] == port]
        if not candidates:
            raise refused("port")
        candidates = [u for u in candidates if u.origin[0] == scheme]
        if not candidates:
            raise refused("scheme")
        path = parsed.path
        if not _clean(path):
            raise refused("path")
        candidates = [u for u in candidates if any(_under(path, p) for p in u.path_prefixes)]
        if not candidates:
            raise refused("path")
        for upstream in candidates:
            if method in upstream.methods:
                return upstream, parsed
        raise refused("method")


def _clean(path: str) -> bool:
    """No ``.``/``..`` segment (httpx removed the literal ones: these were encoded), no
    backslash, no control character."""
    if any(ord(c) < 0x20 or c in "\\\x7f" for c in path):
        return False
    return not any(segment in (".", "..") for segment in path.split("/"))


def _under(path: str, prefix: str) -> bool:
    base = prefix.rstrip("/")
    return path == base or path.startswith(base + "/")


def _nominated(items: Iterable[tuple[str, str]]) -> set[str]:
    """The headers a ``Connection`` header names (hop-by-hop for this connection)."""
    return {
        token.strip().lower()
        for name, value in items
        if name.lower() == "connection"
        for token in value.split(",")
    }


def forwarded_headers(
    headers: Mapping[str, str] | None, allowed: frozenset[str]
) -> list[tuple[str, str]]:
    """The browser's headers that may go upstream."""
    items = list((headers or {}).items())
    passing = allowed - NEVER_FORWARDED - _nominated(items)
    return [(k, v) for k, v in items if k.lower() in passing and not k.lower().startswith("proxy-")]


def returned_headers(
    headers: Sequence[tuple[bytes, bytes]], allowed: frozenset[str], request_id: str
) -> dict[str, str]:
    """The upstream's answer headers that may reach the browser (lower-case names), and
    ``x-request-id``."""
    items = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in headers]
    passing = allowed - NEVER_RETURNED - _nominated(items)
    out = {k: v for k, v in items if k in passing and not k.startswith("proxy-")}
    out["x-request-id"] = request_id
    return out
