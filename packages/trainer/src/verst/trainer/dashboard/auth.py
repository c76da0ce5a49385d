"""Access tokens for a dashboard bound beyond loopback.

On 127.0.0.1 (the default) the dashboard needs no token: only this machine can reach it. Bound
to any other address (`--host 0.0.0.0`), anyone who can reach the port could read the runs, so
every request must carry the token: `?token=<t>` in the URL (the page then keeps it in a
cookie, so its own requests carry it) or `Authorization: Bearer <t>`. `verst dashboard` makes a
random token unless `--token` gives one, and prints the URL with it, the way Jupyter does.
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

COOKIE = "verst_dashboard_token"
"""The cookie the page keeps the token in."""


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and `localhost`."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def new_token() -> str:
    """A random URL-safe token."""
    return secrets.token_urlsafe(24)


def token_middleware(token: str) -> Any:
    """An aiohttp middleware answering 401 to a request without `token`."""
    expected = token.encode()

    @web.middleware
    async def check(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        given = request.query.get("token")
        header = request.headers.get("Authorization", "")
        candidates = [
            given,
            request.cookies.get(COOKIE),
            header[7:] if header.startswith("Bearer ") else None,
        ]
        if not any(c is not None and hmac.compare_digest(c.encode(), expected) for c in candidates):
            raise web.HTTPUnauthorized(
                text="this dashboard needs its access token: open the URL `verst dashboard` printed "
                "(…/?token=…), or send `Authorization: Bearer <token>`"
            )
        response = await handler(request)
        if given is not None:
            response.set_cookie(COOKIE, token, httponly=True, samesite="Strict")
        return response

    return check
