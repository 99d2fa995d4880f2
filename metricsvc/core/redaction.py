"""One redaction rule for everything the service shows or stores: ``health()``, its logs,
the run folder's ``config.yaml``, dead letters and the CLI.

A value is secret when its field has a secret name (exactly ``password``, ``token``,
``api_key``, ... or a name ending in ``_password``, ``_token``, ``_api_key``, ...; never
a name that merely contains "key", such as ``max_keys_per_batch``), or when it is the
password in a URI's user-info (``http://user:S3CRET@host``). Numbers are never hidden.
Text (an error message, a log line) loses every URI password and every secret value the
config holds, wherever it appears.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

MASK = "***"
_NAMES = frozenset({
    "password", "passwd", "pwd", "secret", "token", "api_key", "apikey", "access_key",
    "secret_key", "private_key", "access_token", "auth_token", "refresh_token",
    "credentials", "authorization", "auth", "client_secret",
})
_SUFFIXES = tuple(f"_{name}" for name in ("password", "passwd", "secret", "token", "api_key",
                                          "apikey", "access_key", "secret_key", "private_key"))
_URI = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:/?#@\s]*)"
                  r"(?::(?P<password>[^/?#@\s]*))?@")


def is_secret_name(name: str) -> bool:
    """Return True for a field name whose value is a secret."""
    name = name.lower().replace("-", "_")
    return name in _NAMES or name.endswith(_SUFFIXES)


def _hide_userinfo(match: re.Match[str]) -> str:
    if match["password"] is not None:
        return f"{match['scheme']}{match['user']}:{MASK}@"
    return f"{match['scheme']}{MASK}@" if match["user"] else match[0]  # a bare token


class Redactor:
    """Hide the secrets of one config in any value or text the service emits."""

    def __init__(self, config: Any = None) -> None:
        self._known: set[str] = set()
        self._collect(config, "")

    def _collect(self, value: Any, name: str) -> None:
        if isinstance(value, Mapping):
            for key, item in value.items():
                self._collect(item, str(key))
        elif isinstance(value, (list, tuple)):
            for item in value:
                self._collect(item, name)
        elif isinstance(value, str):
            if is_secret_name(name) and len(value) >= 4:
                self._known.add(value)
            for match in _URI.finditer(value):
                secret = match["password"] or (match["user"] if match["password"] is None
                                               else None)
                if secret and len(secret) >= 4:
                    self._known.add(secret)

    def text(self, text: str) -> str:
        """Return ``text`` without URI passwords or any secret value of the config."""
        text = _URI.sub(_hide_userinfo, text)
        for secret in self._known:
            text = text.replace(secret, MASK)
        return text

    def value(self, value: Any, name: str = "") -> Any:
        """Return a copy of ``value`` (dicts, lists, strings) with every secret hidden."""
        if isinstance(value, Mapping):
            return {key: self.value(item, str(key)) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.value(item, name) for item in value]
        if isinstance(value, str):
            return MASK if value and is_secret_name(name) else self.text(value)
        return value
