"""Credentials in URIs (`postgresql://user:pw@host/db`, `https://user:pw@host/`, `s3://b/k?X-Amz-Signature=..`):
redacted to `***` wherever a run writes or prints them (config.yaml, MLflow, state.json, logs, the console), kept
only in the process's memory. A redacted password of `tracking.uri` is read back from MLFLOW_TRACKING_PASSWORD,
the variable MLflow itself reads for an http(s) server."""

from __future__ import annotations

import re

REDACTED = "***"
PASSWORD_ENV = "MLFLOW_TRACKING_PASSWORD"
USERNAME_ENV = "MLFLOW_TRACKING_USERNAME"

# scheme://user:password@host: the password runs to the last '@' of the authority (a raw '@' in a password too)
_USERINFO = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.-]*://[^\s:/?#@]*:)(?P<secret>[^\s/?#]*)"
                       r"(?P<tail>@[^\s@/?#]*(?=[/?#\s]|$))")
# ?token=..., &password=..., X-Amz-Signature=..., sig=... (a SAS)
_QUERY = re.compile(r"(?P<head>[?&;][^\s=&#?;]*(?:passw(?:or)?d|pwd|token|secret|signature|\bsig|credential|"
                    r"api[_-]?key|access[_-]?key)[^\s=&#?;]*=)(?P<secret>[^\s&#;]*)", re.IGNORECASE)
_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://\S*")


def redact(text: str) -> str:
    """`text` with every URI password (`user:***@`, the user kept) and secret query value (`token=***`) hidden."""
    hide = lambda m: m["head"] + (REDACTED if m["secret"] else "") + m.groupdict().get("tail", "")  # noqa: E731
    return _QUERY.sub(hide, _USERINFO.sub(hide, text))


def redact_value(value):
    """A config value as it may be written: a string that is one URI redacted (`redact`), anything else as is (a
    prompt that quotes a URI is the user's text, not a credential)."""
    return redact(value) if isinstance(value, str) and _URI.fullmatch(value) else value


def hidden(value) -> bool:
    """Whether `value` is a URI whose password or secret query value was redacted (as a saved config.yaml keeps it)."""
    return (isinstance(value, str) and _URI.fullmatch(value) is not None
            and any(m["secret"] == REDACTED for p in (_USERINFO, _QUERY) for m in p.finditer(value)))


def split_password(uri: str) -> tuple[str, str | None, str | None]:
    """(`uri` without `user:password@`, user, password); the user and password percent-decoded, (uri, None, None)
    when it carries no password."""
    from urllib.parse import unquote

    m = _USERINFO.search(uri)
    if m is None:
        return uri, None, None
    user = m["head"].split("://", 1)[1][:-1]
    bare = uri[:m.start()] + m["head"].split("://", 1)[0] + "://" + m["tail"][1:] + uri[m.end():]
    return bare, unquote(user), unquote(m["secret"])


def with_password(uri: str, password: str) -> str:
    """`uri` whose redacted password (`user:***@`) is `password` (percent-encoded as a URI needs)."""
    from urllib.parse import quote

    m = _USERINFO.search(uri)
    assert m is not None and m["secret"] == REDACTED, "no redacted password in the URI"
    return uri[:m.start()] + m["head"] + quote(password, safe="") + m["tail"] + uri[m.end():]
