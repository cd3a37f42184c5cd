"""[pool] Remote image URLs, fetched without letting a request reach the server's own network (SSRF).

A host is resolved once, every address it resolves to must be public, and the connection goes to
the address that was checked (so a second DNS answer cannot swap in ``127.0.0.1``). Redirects are
followed by hand, each hop checked the same way. Hosts named in ``--allowed-media-domains`` are the
only ones allowed when that list is given, and they may be private: naming one is the operator's
explicit choice.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from typing import Any
from urllib.parse import urljoin, urlsplit, urlunsplit

import httpx

from vlmserve.preprocess.images import ImageError

MAX_REDIRECTS = 5


def fetch_remote(url: str, allowed_domains: tuple[str, ...], max_bytes: int, timeout_s: float, label: str) -> bytes:
    """The body of ``url`` (at most ``max_bytes``), or an ``ImageError`` saying why not."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=timeout_s, follow_redirects=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            target, headers, extensions = _checked_target(url, allowed_domains, label)
            try:
                request = client.build_request("GET", target, headers=headers, extensions=extensions)
                response = client.send(request, stream=True)
                try:
                    if response.is_redirect and "location" in response.headers:
                        url = urljoin(url, response.headers["location"])
                        continue
                    response.raise_for_status()
                    return _read_body(response, max_bytes, deadline, label)
                finally:
                    response.close()
            except httpx.HTTPError as exc:
                raise ImageError(f"{label}: could not fetch {url}: {exc}") from None
    raise ImageError(f"{label}: more than {MAX_REDIRECTS} redirects")


def _read_body(response: httpx.Response, max_bytes: int, deadline: float, label: str) -> bytes:
    data = bytearray()
    for chunk in response.iter_bytes():
        data += chunk
        if len(data) > max_bytes:
            raise ImageError(f"{label}: remote image is over the {max_bytes}-byte limit")
        if time.monotonic() > deadline:
            raise ImageError(f"{label}: remote image took too long to download")
    return bytes(data)


def _checked_target(url: str, allowed_domains: tuple[str, ...], label: str) -> tuple[str, dict[str, str], dict[str, Any]]:
    """``(url to connect to, headers, httpx extensions)``: pinned to a checked public address,
    or as given for a host on the allow-list."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower().rstrip(".")
    if parts.scheme not in ("http", "https") or not host:
        raise ImageError(f"{label}: {url!r} is not an http(s) URL with a host")
    if allowed_domains:
        if not any(host == d or host.endswith("." + d) for d in allowed_domains):
            raise ImageError(f"{label}: host {host!r} is not in --allowed-media-domains")
        return url, {}, {}
    address = _public_address(host, parts.port or (443 if parts.scheme == "https" else 80), label)
    netloc = f"[{address}]" if ":" in address else address
    if parts.port:
        netloc += f":{parts.port}"
    pinned = urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))
    extensions = {"sni_hostname": host} if parts.scheme == "https" else {}
    return pinned, {"Host": parts.netloc.rsplit("@", 1)[-1]}, extensions


def _public_address(host: str, port: int, label: str) -> str:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ImageError(f"{label}: cannot resolve {host!r}: {exc}") from None
    addresses = [str(info[4][0]) for info in infos]
    for address in addresses:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        if not ip.is_global or ip.is_multicast:  # loopback, private, link-local (metadata), reserved
            raise ImageError(f"{label}: host {host!r} resolves to {ip}, a non-public address; "
                             "name it in --allowed-media-domains to allow it")
    return addresses[0]
