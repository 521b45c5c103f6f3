"""The server's locks: a bearer token for every ``/admin/`` route (off without one), and a
directory that reload paths must stay inside. Both are set at start-up only."""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from ..core.model import UsageError
from ..errors import RequestError

TOKEN_ENV = "GRAPHPLAN_ADMIN_TOKEN"
ADMIN_PREFIX = "/admin/"
ADMIN_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
"""Routes outside /admin/ behind the same token (vLLM's paths for LoRA adapters)."""


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

    @property
    def token(self) -> str | None:
        """The token as given (handed to the extra front end processes)."""
        return self._token.decode() if self._token is not None else None

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
