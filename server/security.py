"""The server's locks: a bearer token for every ``/admin/`` route (off without one), and a
directory that reload paths must stay inside. Both are set at start-up only."""

from __future__ import annotations

import hmac
import json
import os
from pathlib import Path
from urllib.parse import urlsplit

from .model import UsageError
from .protocol import RequestError

TOKEN_ENV = "GRAPHPLAN_ADMIN_TOKEN"
ADMIN_PREFIX = "/admin/"
ROUTES = {
    "/healthz": "GET",
    "/metrics": "GET",
    "/generate": "POST",
    "/admin/reload": "POST",
    "/v1/models": "GET",
    "/v1/completions": "POST",
}
"""Path -> its method: a known path asked with another method answers 405."""


class AdminGate:
    """``Authorization: Bearer <token>`` on admin routes, compared in constant time. With no
    token configured the admin routes are off (403), so a forgotten flag never opens them."""

    def __init__(self, token: str | None):
        if token is not None and len(token) < 16:
            raise UsageError(
                "the admin token must be at least 16 characters (make one with "
                "python -c 'import secrets; print(secrets.token_urlsafe())')"
            )
        self._token = token.encode() if token else None

    @property
    def enabled(self) -> bool:
        return self._token is not None

    def check(self, authorization: str | None) -> None:
        """Raise RequestError (403 when admin routes are off, 401 for a missing or wrong token)."""
        if self._token is None:
            raise RequestError(
                403,
                "admin endpoints are off: start the server with "
                f"--admin-token or the {TOKEN_ENV} environment variable",
            )
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise RequestError(401, "admin endpoints need 'Authorization: Bearer <token>'")
        if not hmac.compare_digest(given.strip().encode(), self._token):
            raise RequestError(401, "wrong admin token")


def admin_token(flag: str | None) -> str | None:
    """The token from ``--admin-token``, else from the environment; None turns admin off."""
    return flag or os.environ.get(TOKEN_ENV) or None


class ReloadDir:
    """Reload paths resolve (symlinks followed) inside one directory, given at start-up."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).resolve()

    def confine(self, path: str) -> str:
        """The resolved path of ``path`` (relative paths are relative to the directory), or a
        RequestError 403 if it lies outside."""
        try:
            p = Path(path)
            resolved = (p if p.is_absolute() else self.root / p).resolve()
        except (OSError, ValueError, RuntimeError) as e:  # NUL bytes, symlink loops
            raise RequestError(400, f"'path' is not a usable file name: {e}") from None
        if not resolved.is_relative_to(self.root):
            raise RequestError(
                403,
                f"'path' {path!r} is outside the reload directory "
                f"{self.root}; put the plan there, or restart the server with "
                "--reload-dir",
            )
        return str(resolved)


class GuardedHandler:
    """Mixed into the HTTP handler: socket timeouts, JSON for every error the standard library
    answers itself (bad request lines, unknown methods), 405 for a known path with the wrong
    method, and the admin gate. The app's server object carries ``admin`` and ``idle_timeout``."""

    def setup(self):
        self.timeout = self.server.app.idle_timeout  # read/idle timeout of the socket
        super().setup()

    def send_error(self, code, message=None, explain=None):
        self.close_connection = True
        phrase = self.responses.get(code, ("error",))[0]
        self._send_json(code, {"error": message or explain or phrase, "status": code}, {})

    def _wrong_method(self, path: str) -> bool:
        """Answer 405 for a known path asked with another method; False if the path is unknown."""
        allowed = ROUTES.get(path)
        if allowed is None:
            return False
        self.close_connection = True  # a body, if any, was not read
        self._send_json(
            405,
            {"error": f"{self.command} is not allowed on {path}; use {allowed}", "status": 405},
            {"Allow": allowed},
        )
        return True

    def _admin(self, path: str) -> bool:
        """Check the admin token for /admin/ routes; True if the request was answered."""
        if not path.startswith(ADMIN_PREFIX):
            return False
        try:
            self.server.app.admin.check(self.headers.get("Authorization"))
        except RequestError as e:
            self.close_connection = True
            extra = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
            self._send_json(e.status, {"error": e.message, "status": e.status}, extra)
            return True
        return False

    def _other_method(self):
        path = urlsplit(self.path).path
        if self._admin(path) or self._wrong_method(path):
            return
        self.send_error(501, f"method {self.command} is not supported")

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _other_method

    def _send_json(self, status: int, obj, headers: dict):
        data = (json.dumps(obj) + "\n").encode()
        self.send_response(status)
        for k, v in {
            "Content-Type": "application/json",
            "Content-Length": str(len(data)),
            "Connection": "close",
            **headers,
        }.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)
