"""The job's secret, and the proof of it that tfdist's network messages carry.

Every task of a job shares one secret: a random key that the launcher makes (or the user sets).
A message to a tfdist endpoint (a parameter server's RPCs) carries a token: a fresh nonce and an
HMAC-SHA256 of (the server it is for, method, worker, nonce) under the secret, so a token made
for one server is refused by every other. The endpoint recomputes the HMAC and
compares in constant time, refuses a nonce it has seen (a replay) or one older than `WINDOW`
seconds, and a refused message changes nothing. The secret itself never travels.

How a task gets the secret, first found wins:

* `TFDIST_JOB_SECRET`: the secret (what `python -m tfdist.launch` and the emulated cluster set
  for the processes they start on this machine);
* `TFDIST_JOB_SECRET_FILE`: a file holding it, readable by its owner only (mode 0600 or
  stricter): what remote hosts get, so the secret is never on a command line.

What this does not do: the messages are not encrypted, and a machine that can read and alter
traffic between two tasks can still change the gradients in flight; run jobs on a private
network (see the Security page of the docs).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
import threading
import time
from collections.abc import Mapping

SECRET_ENV = "TFDIST_JOB_SECRET"
SECRET_FILE_ENV = "TFDIST_JOB_SECRET_FILE"
WINDOW = 120.0  # seconds a token stays valid (the job's hosts' clocks may differ this much)
MIN_LENGTH = 16  # characters of a secret, at least
HINT = (f"set {SECRET_ENV} to the same random value on every task (e.g. `export {SECRET_ENV}="
        "$(python -c 'import secrets; print(secrets.token_hex(32))')`), or "
        f"{SECRET_FILE_ENV} to a file holding it (mode 0600); `python -m tfdist.launch` "
        "makes one for the tasks it starts")


def new_secret() -> str:
    """A fresh random job secret (256 bits, hex)."""
    return secrets.token_hex(32)


def job_secret(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The job's secret from the environment (`SECRET_ENV`, else the file `SECRET_FILE_ENV`
    names), or None when neither is set.

    Raises:
        ValueError: the secret is too short, or its file is missing, unreadable or readable
            by others than its owner.
    """
    environ = os.environ if environ is None else environ
    text = environ.get(SECRET_ENV)
    source = SECRET_ENV
    if not text and environ.get(SECRET_FILE_ENV):
        path = os.path.expanduser(environ[SECRET_FILE_ENV])  # "~/..." as the launcher gives it
        source = f"{SECRET_FILE_ENV}={path}"
        try:
            mode = os.stat(path).st_mode
            with open(path) as f:
                text = f.read().strip()
        except OSError as e:
            raise ValueError(f"{source}: cannot read the job's secret ({e.strerror}); "
                             f"{HINT}.") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(f"{source}: the file is readable by others (mode "
                             f"{stat.S_IMODE(mode):o}); `chmod 600 {path}`.")
    if not text:
        return None
    if len(text) < MIN_LENGTH:
        raise ValueError(f"{source}: the job's secret has {len(text)} characters; use at least "
                         f"{MIN_LENGTH} random ones: {HINT}.")
    return text.encode()


def require_secret(secret: bytes | str | None, who: str) -> bytes:
    """`secret` as bytes; a clear error naming `who` needs it when it is missing."""
    if secret is None or not secret:
        raise ValueError(f"{who} needs the job's secret, which is not set: {HINT}.")
    return secret.encode() if isinstance(secret, str) else bytes(secret)


def _mac(secret: bytes, server: str, method: str, worker: int, nonce: str) -> str:
    message = f"tfdist/2|{server}|{method}|{worker}|{nonce}".encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def sign(secret: bytes, method: str, worker: int, *, server: str) -> str:
    """A token proving the secret for one message to `server` (its name, e.g. "ps-0"):
    `method` from `worker` (-1: none)."""
    nonce = f"{time.time():.6f}-{secrets.token_hex(12)}"
    return f"{nonce}:{_mac(secret, server, method, worker, nonce)}"


class Verifier:
    """Checks the tokens sent to `server` (its name, as the callers sign for it) against the
    job's secret; remembers the nonces of the last `window` seconds (by the second they were
    made), so a token is taken once."""

    def __init__(self, secret: bytes, *, server: str, window: float = WINDOW):
        self._secret = secret
        self.server = server
        self.window = window
        self._seen: dict[int, set[str]] = {}  # second of the token's stamp -> its nonces
        self._lock = threading.Lock()
        self.refused = 0

    def check(self, token: str | bytes, method: str, worker: int) -> bool:
        """Whether `token` proves the secret for this message (and was not seen before)."""
        if isinstance(token, bytes):
            token = token.decode("ascii", "replace")
        nonce, _, mac = token.rpartition(":")
        try:
            stamp = float(nonce.partition("-")[0])
        except ValueError:
            stamp = float("nan")
        ok = hmac.compare_digest(mac.encode(), _mac(self._secret, self.server, method, worker,
                                                    nonce).encode())
        now = time.time()
        with self._lock:
            fresh = ok and abs(now - stamp) <= self.window  # (False for nan)
            bucket = self._seen.setdefault(int(stamp), set()) if fresh else set()
            fresh = fresh and nonce not in bucket
            if fresh:
                bucket.add(nonce)
            else:
                self.refused += 1
            for second in [k for k in self._seen if k < now - self.window - 1]:
                del self._seen[second]  # too old to be accepted anyway
            return fresh
