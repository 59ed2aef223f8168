"""S3 credentials that renew: the standard AWS chain, with the shared credentials file read again.

Why: session credentials expire and keys are rotated; credentials read once at start make every
request fail after that (and uploads retry them for ever). So credentials from the shared
credentials file are handed to obstore through a ``credential_provider``: obstore calls it
before a request whenever the credentials it holds expire within its refresh margin; this one
answers from a cache, ``stat``s the file on each call (a rewrite, by ``aws configure``, a
Vault agent or any sidecar, is used from the next request on) and gives every answer a short
expiry (``RECHECK_S``, or the expiry the file states if sooner) so obstore keeps asking. A refresh
that fails (the file gone or unreadable, no keys for the profile, its stated expiry passed with
no new credentials) raises: obstore fails that request, the log says why once per reason (never
a secret: the access key id's last 4 characters at most), and ``failure`` holds the reason for
the caller (s3_store.CredentialsError).

Sources, in the standard AWS order (``resolve``):

1. ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (/ ``AWS_SESSION_TOKEN``): static, since a
   process's environment cannot change; an expired session token there is reported as such.
2. ``AWS_WEB_IDENTITY_TOKEN_FILE``: left to obstore, whose web-identity provider renews them.
3. The shared credentials file (``AWS_SHARED_CREDENTIALS_FILE`` or ``~/.aws/credentials``,
   profile ``AWS_PROFILE`` or ``default``): ``FileCredentials``, renewed as above.
4. Nothing: obstore's own chain (ECS container credentials, EC2 instance metadata), renewed by it.
"""
from __future__ import annotations

import configparser
import logging
import os
import threading
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

log = logging.getLogger("ckptd")
RECHECK_S = 60.0          # the expiry given to obstore: it asks again at least this often
EXPIRY_KEYS = ("aws_expiration", "expiration", "x_security_token_expires")   # written by aws-vault, saml2aws…


class CredentialsUnusable(Exception):
    """The credentials cannot be read or renewed; the message says why, with no secret in it."""


def hint(access_key_id: str) -> str:
    """What a log may show of a key: its last 4 characters."""
    return "…" + access_key_id[-4:]


def _parse_expiry(text: str, path: str) -> datetime:
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise CredentialsUnusable(f"{path}: the credentials' expiry {text.strip()[:40]!r} is not an ISO 8601 "
                                  "time") from None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def read_profile(path: str, profile: str) -> dict[str, Any] | None:
    """The profile's credentials in the file (``expires_at`` None unless the file states one);
    None when the file or the profile is not there. CredentialsUnusable when unparseable."""
    parser = configparser.ConfigParser(interpolation=None)
    try:
        with open(path, encoding="utf-8") as f:
            parser.read_file(f)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise CredentialsUnusable(f"cannot read the shared credentials file {path}: "
                                  f"{getattr(e, 'strerror', None) or type(e).__name__}") from None
    except configparser.Error as e:
        raise CredentialsUnusable(f"cannot parse the shared credentials file {path}: {type(e).__name__}") from None
    if not parser.has_section(profile) or not parser.has_option(profile, "aws_access_key_id"):
        return None
    s = parser[profile]
    if not s.get("aws_secret_access_key"):
        raise CredentialsUnusable(f"{path}: profile {profile!r} has an aws_access_key_id but no aws_secret_access_key")
    stated = next((s[k] for k in EXPIRY_KEYS if s.get(k)), None)
    return {"access_key_id": s["aws_access_key_id"].strip(), "secret_access_key": s["aws_secret_access_key"].strip(),
            "token": (s.get("aws_session_token") or "").strip() or None,
            "expires_at": _parse_expiry(stated, path) if stated else None}


class FileCredentials:
    """obstore's ``credential_provider`` for the shared credentials file (see the module doc)."""

    def __init__(self, path: str, profile: str) -> None:
        self.path, self.profile = path, profile
        self.failure: str | None = None        # the last refresh's failure, None once one succeeds
        self.renewals = 0                      # new credentials picked up after the first
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int] | None = None
        self._creds: dict[str, Any] | None = None

    def __call__(self) -> dict[str, Any]:
        with self._lock:
            try:
                creds = self._current()
            except CredentialsUnusable as e:
                if str(e) != self.failure:
                    log.error("S3 credentials refresh failed; requests to the bucket fail until it is fixed",
                              extra={"ctx": {"file": self.path, "profile": self.profile, "error": str(e)}})
                self.failure = str(e)
                raise
            if self.failure is not None:
                log.info("S3 credentials usable again", extra={"ctx": {"file": self.path, "profile": self.profile}})
                self.failure = None
        recheck = datetime.now(timezone.utc) + timedelta(seconds=RECHECK_S)
        stated = creds["expires_at"]
        return {**creds, "expires_at": recheck if stated is None else min(stated, recheck)}

    def _current(self) -> dict[str, Any]:
        try:
            st = os.stat(self.path)
        except OSError as e:
            raise CredentialsUnusable(f"cannot read the shared credentials file {self.path}: {e.strerror}") from None
        seen = (st.st_ino, st.st_size, st.st_mtime_ns)
        creds = self._creds
        if seen != self._seen or creds is None:
            creds = read_profile(self.path, self.profile)
            if creds is None:
                raise CredentialsUnusable(f"the shared credentials file {self.path} has no credentials for profile "
                                          f"{self.profile!r} (aws_access_key_id, aws_secret_access_key)")
            old = self._creds
            if old is not None and (old["access_key_id"], old["secret_access_key"], old["token"]) != (
                    creds["access_key_id"], creds["secret_access_key"], creds["token"]):
                self.renewals += 1
                log.info("S3 credentials renewed", extra={"ctx": {"file": self.path, "profile": self.profile,
                                                                  "key": hint(creds["access_key_id"])}})
            self._creds, self._seen = creds, seen
        stated = creds["expires_at"]
        if stated is not None and stated <= datetime.now(timezone.utc):
            raise CredentialsUnusable(f"the credentials in {self.path} (profile {self.profile!r}) expired at "
                                      f"{stated.isoformat()} and the file has not been renewed")
        return creds


def resolve(env: Mapping[str, str]) -> tuple[dict[str, str], FileCredentials | None]:
    """(static credentials for obstore's config, a renewing provider): at most one is non-empty;
    neither: obstore's own chain (web identity, container, instance metadata)."""
    if env.get("AWS_ACCESS_KEY_ID") and env.get("AWS_SECRET_ACCESS_KEY"):
        creds = {"access_key_id": env["AWS_ACCESS_KEY_ID"], "secret_access_key": env["AWS_SECRET_ACCESS_KEY"]}
        if env.get("AWS_SESSION_TOKEN"):
            creds["token"] = env["AWS_SESSION_TOKEN"]
        return creds, None
    if env.get("AWS_WEB_IDENTITY_TOKEN_FILE"):
        return {}, None
    path = env.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.expanduser("~/.aws/credentials")
    profile = env.get("AWS_PROFILE") or "default"
    if read_profile(path, profile) is None:      # CredentialsUnusable: the file is there but broken
        return {}, None
    return {}, FileCredentials(path, profile)
