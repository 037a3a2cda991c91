"""Fetching a request's http(s) image URL without letting the request use the server as a proxy.

    fetch(url, policy, where) -> bytes        ``ApiError`` 400 with one text for every failure
    fetch_failed(url, policy, where, reason)  raises that 400 (the reason logged)

What a URL may cost and reach (``image_inputs.ImagePolicy``):

* **time**: one deadline for the whole fetch (``url_timeout_s``), redirects and every read
  included. Reads return what one receive gives (``read1``) and each waits at most the time left,
  so a server that drips a byte a second is cut off at the deadline, not after 64 KiB;
* **bytes**: at most ``url_cap``, announced (``Content-Length``) or sent;
* **addresses**: only public ones unless ``allow_private_urls``. The address checked is the one
  the socket connected to (``getpeername``, after DNS), on every connection, so every redirect hop
  is checked too and a name that resolves to a private address once connected is still refused
  (no window between a check and the connection). Refused: loopback, private, link-local, shared,
  reserved, multicast and unspecified ranges (``ipaddress``'s ``is_global`` false), IPv4-mapped
  IPv6 included;
* **schemes**: http and https only, redirects included (no ftp, file or data handler is installed).

Every failure (refused address, connection error, HTTP status, timeout, too many bytes, a redirect
elsewhere, and bytes that do not decode as an image: ``fetch_failed``) answers the same text, so
the API cannot be used to probe which hosts and ports exist; the reason goes to the server's log
(``zoo.serve``, level info).
"""

from __future__ import annotations

import http.client
import ipaddress
import logging
import socket
import time
import urllib.error
import urllib.parse
import urllib.request

from zoo.server.validation import ApiError

log = logging.getLogger("zoo.serve")
MAX_REDIRECTS = 5


class _Refused(OSError):
    """A connection to an address the policy does not allow."""


def _check_peer(sock: socket.socket, allow_private: bool) -> None:
    if allow_private:
        return
    address = ipaddress.ip_address(sock.getpeername()[0].split("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if not address.is_global:
        sock.close()
        raise _Refused(f"address {address} is not public")


def _handlers(allow_private: bool, deadline: float):
    """urllib handlers whose connections check their peer and wait at most until ``deadline``."""

    def remaining() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the fetch's deadline passed")
        return left

    class GuardedHTTP(http.client.HTTPConnection):
        def connect(self):
            self.timeout = remaining()
            super().connect()
            _check_peer(self.sock, allow_private)

    class GuardedHTTPS(http.client.HTTPSConnection):
        def connect(self):
            self.timeout = remaining()
            super().connect()                    # TCP, then TLS: the peer is the TCP peer
            _check_peer(self.sock, allow_private)

    class HTTPHandler(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(GuardedHTTP, req)

    class HTTPSHandler(urllib.request.HTTPSHandler):
        def https_open(self, req):
            return self.do_open(GuardedHTTPS, req, context=self._context)

    class Redirects(urllib.request.HTTPRedirectHandler):
        max_redirections = MAX_REDIRECTS

        def redirect_request(self, req, fp, code, msg, headers, newurl):
            if urllib.parse.urlsplit(newurl).scheme not in ("http", "https"):
                raise urllib.error.URLError(f"redirect to a non-http(s) URL {newurl[:100]!r}")
            return super().redirect_request(req, fp, code, msg, headers, newurl)

    return [HTTPHandler(), HTTPSHandler(), Redirects(), urllib.request.HTTPDefaultErrorHandler(),
            urllib.request.HTTPErrorProcessor()], remaining


def _opener(allow_private: bool, deadline: float):
    opener = urllib.request.OpenerDirector()          # only these handlers: no ftp, file or data URLs
    handlers, remaining = _handlers(allow_private, deadline)
    for h in handlers:
        opener.add_handler(h)
    return opener, remaining


def fetch_failed(url: str, policy, where: str, reason) -> None:
    """Raise the one 400 of every failed fetch (module docstring), the ``reason`` logged."""
    log.info("image URL %.200s (%s) not fetched: %s", url, where, reason)
    raise ApiError(400, f"{where}: the image URL could not be fetched as an image (http(s), "
                        f"{'any' if policy.allow_private_urls else 'public'} addresses, at most "
                        f"{policy.url_cap} bytes in {policy.url_timeout_s:g}s)", param=where)


def fetch(url: str, policy, where: str) -> bytes:
    """GET an http(s) image URL under ``policy`` (module docstring); the body's bytes."""
    cap = policy.url_cap
    opener, remaining = _opener(policy.allow_private_urls, time.monotonic() + policy.url_timeout_s)
    request = urllib.request.Request(url, headers={"User-Agent": "zoo-serve", "Accept": "image/*"})
    try:
        with opener.open(request, timeout=remaining()) as response:
            length = response.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > cap:
                raise ValueError(f"it announces {length} bytes, more than {cap}")
            chunks, size = [], 0
            sock = getattr(getattr(response.fp, "raw", None), "_sock", None)
            while True:
                if sock is not None:
                    sock.settimeout(remaining())                # the time left, for this receive
                chunk = response.read1(1 << 16)
                if not chunk:
                    break
                size += len(chunk)
                if size > cap:
                    raise ValueError(f"it sent more than {cap} bytes")
                chunks.append(chunk)
        if not chunks:
            raise ValueError("it returned no bytes")
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
        fetch_failed(url, policy, where, getattr(e, "reason", None) or e)
    return b"".join(chunks)
