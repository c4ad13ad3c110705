"""Where the ledgers' database is: a SQLite file or a PostgreSQL URL (`resolve_location`).

- ``privacy.ledger: postgresql://user@host/db`` -> PostgreSQL (driver ``psycopg``; the
  password comes from ``PGPASSWORD`` or ``~/.pgpass``, never from the recipe);
- ``privacy.ledger: /path/ledger.sqlite`` -> that SQLite file;
- otherwise ``$LLMDP_HOME/ledger.sqlite`` (`llmdp_home`: default under the user's data
  directory), the same file whatever the working directory.

`describe_location` is the location as messages, reports and plan.json show it (a URL's
password masked). The database itself is `llmdp.privacy.ledger.database`.
"""

from __future__ import annotations

import os
import sys
from urllib.parse import urlsplit, urlunsplit

__all__ = ["llmdp_home", "default_location", "is_url", "resolve_location", "describe_location",
           "registry_path", "register", "registered", "same_location"]


def llmdp_home() -> str:
    """``$LLMDP_HOME``, else the user's data directory: ``$XDG_DATA_HOME/llmdp`` or
    ``~/.local/share/llmdp`` (``~/Library/Application Support/llmdp`` on macOS)."""
    home = os.environ.get("LLMDP_HOME")
    if home:
        return os.path.abspath(os.path.expanduser(home))
    if sys.platform == "darwin":
        base = os.path.expanduser("~/Library/Application Support")
    else:
        base = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return os.path.join(base, "llmdp")


def registry_path() -> str:
    """The user's list of every ledger database written to (`llmdp.privacy.ledger.registry`),
    in the user's data directory whatever ``$LLMDP_HOME`` is: a run under another
    ``LLMDP_HOME`` is listed in the same file."""
    base = os.environ.get("XDG_DATA_HOME") or (
        os.path.expanduser("~/Library/Application Support") if sys.platform == "darwin"
        else os.path.expanduser("~/.local/share"))
    return os.path.join(os.path.abspath(base), "llmdp", "ledger_databases.txt")


def default_location() -> str:
    return os.path.join(llmdp_home(), "ledger.sqlite")


def is_url(location: str) -> bool:
    return location.startswith(("postgresql://", "postgres://"))


def resolve_location(ledger: str | None) -> str:
    """The database of ``privacy.ledger`` (None: the per-user default)."""
    if ledger is None or ledger.endswith(".jsonl"):
        return default_location()  # a .jsonl is a legacy ledger, imported into the default
    return ledger if is_url(ledger) else os.path.abspath(os.path.expanduser(ledger))


def describe_location(location: str) -> str:
    """The location without a password (for messages, reports and plan.json)."""
    if not is_url(location):
        return location
    parts = urlsplit(location)
    if parts.password is None:
        return location
    netloc = parts.netloc.split("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}" if user else netloc))


# The user's registry of ledger databases (`llmdp.privacy.ledger.registry` searches them).

def _stored(location: str) -> str:
    """A location as the registry keeps it: a SQLite file's real path; a URL without its
    password (the connection takes it from PGPASSWORD or ~/.pgpass, as llmdp's always do)."""
    if not is_url(location):
        return os.path.realpath(location)
    parts = urlsplit(location)
    if parts.password is None:
        return location
    user = parts.username or ""
    host = parts.netloc.split("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}@{host}" if user else host))


def same_location(a: str, b: str) -> bool:
    return _stored(a) == _stored(b)


def registered() -> list[str]:
    """The databases listed (in the order first written to), without duplicates."""
    try:
        with open(registry_path(), encoding="utf-8") as f:
            lines = [x.strip() for x in f]
    except FileNotFoundError:
        return []
    return list(dict.fromkeys(x for x in lines if x))


def register(location: str) -> None:
    """List ``location`` in the registry if it is not there (one append of one line: atomic
    against concurrent runs). A registry that cannot be written is not fatal: the
    database is then not found by runs that name another."""
    loc = _stored(location)
    if "\n" in loc or loc in registered():
        return
    path = registry_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (loc + "\n").encode("utf-8"))
        finally:
            os.close(fd)
    except OSError:
        pass
