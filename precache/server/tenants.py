"""Tenants: whose cache a request may reuse.

A tenant is the request's ``cache_salt`` (vLLM's field) and/or, when the server has API keys
(``--api-key`` / ``--api-keys FILE``, bearer tokens as vLLM's ``--api-key``), the key that
authenticated it; with both, the pair. Requests with neither belong to one default tenant (None),
so a single-user server keeps sharing across its agents. The tenant becomes the session's
``cache_salt`` (:mod:`precache.cache.prefix`) and picks the session trie the server searches
(:class:`~precache.server.sessions.SessionPool`): a request never reads, nor is told about, another
tenant's cache.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from pathlib import Path

from precache.errors import PrecacheError

MAX_SALT_CHARS = 1024


class APIKeyError(PrecacheError):
    """``--api-keys FILE`` cannot be read, or holds no key."""


def _fingerprint(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def read_api_keys(path: str | Path) -> list[str]:
    """Keys of ``--api-keys FILE``: one per line; blank lines and lines starting with ``#`` skipped.

    Raises:
        APIKeyError: the file cannot be read or holds no key.
    """
    try:
        lines = Path(path).expanduser().read_text().splitlines()
    except OSError as exc:
        raise APIKeyError(f"--api-keys {path}: {exc.strerror or exc}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise APIKeyError(f"--api-keys {path}: no key in the file (one key per line)")
    return keys


class Tenants:
    """The server's API keys (none: no authentication) and the tenant of each request.

    Keys are kept as SHA-256 fingerprints and compared in constant time; a tenant id never holds a
    key itself.
    """

    def __init__(self, api_keys: Iterable[str] = ()):
        self._keys = {_fingerprint(k) for k in api_keys if k}

    @property
    def required(self) -> bool:
        """Requests must carry a key."""
        return bool(self._keys)

    def authenticate(self, authorization: str | None) -> str | None:
        """The key fingerprint of an ``Authorization: Bearer KEY`` header, or None when keys are
        required and it is missing or wrong (None as well when no key is required)."""
        if not self._keys or not authorization:
            return None
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        given = _fingerprint(key.strip())
        found = None
        for known in self._keys:  # every key compared: the time does not depend on which matched
            if hmac.compare_digest(known, given):
                found = known
        return found

    @staticmethod
    def tenant(key_fingerprint: str | None, cache_salt: str | None) -> str | None:
        """The tenant id of a request (None: the default tenant)."""
        parts = []
        if key_fingerprint is not None:
            parts.append(f"key:{key_fingerprint}")
        if cache_salt is not None:
            parts.append(f"salt:{cache_salt}")
        return "|".join(parts) or None
