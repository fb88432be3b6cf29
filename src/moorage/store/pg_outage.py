"""PostgreSQL going away under a running host: a lost connection is found before use, and reads as a 503.

A restart, a failover, ``pg_terminate_backend`` or a pooler's idle timeout closes every connection a host holds;
the server says so on the socket, so an idle connection with something to read is checked before it is used.
"""

from __future__ import annotations

import contextlib
import logging
import select
import time
from typing import Callable, Iterator

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import PoolTimeout

from moorage.errors import StoreUnreachable
from moorage.log import STILL_FAILING_EVERY_S
from moorage.observability import events

#: How long a request waits for a connection to PostgreSQL before it is answered 503 (a restart takes a second or
#: two; a longer wait would only hold the caller and a worker thread).
CONNECT_WAIT_S = 5.0
#: What the 503 asks a caller to wait before retrying.
RETRY_AFTER_S = StoreUnreachable.retry_after
_HINT = "retry in a few seconds; the host reconnects by itself once PostgreSQL is back"
#: SQLSTATEs of a server that is shutting down, starting or gone (class 08: the connection; 57P0x: shutdown).
_LOST_STATES = ("57P01", "57P02", "57P03", "57P05")
#: libpq's TCP settings for a server that goes silent (a network partition, a host gone without a reset): without
#: them a statement already sent waits out the kernel's retransmissions (about 15 minutes on Linux), holding its
#: request and its connection. Sent data unacknowledged for 20 s fails the connection (longer than any ordinary
#: stall of a network, short enough that a caller's retry comes within a minute); an idle connection, or one
#: waiting on a reply whose statement was acknowledged, is probed after 10 s of silence, every 5 s, and fails
#: once 20 s pass unanswered (Linux; three probes elsewhere), so an idle one is found dead before it is drawn.
#: A long statement is not cut: the server's kernel acknowledges the probes meanwhile.
TCP_DEFAULTS = {"keepalives": "1", "keepalives_idle": "10", "keepalives_interval": "5", "keepalives_count": "3",
                "tcp_user_timeout": "20000"}
#: How long the server lets a session sit idle inside a transaction before it ends the session (SQLSTATE 25P03).
#: A host frozen or stalled in the middle of one (between two of its statements: its connection stays open, its
#: kernel answers) otherwise holds the rows it locked for good: a fenced turn's commit share-locks its instance's
#: record, and every other host's takeover or forget of that instance waited on the lock forever. moorage's
#: transactions are a few statements sent back to back; this is the default lease (``lease_ttl_s``), so a host
#: that stalls that long inside one has lost its lease too.
IDLE_IN_TRANSACTION_S = 15
SESSION_DEFAULTS = {"options": f"-c idle_in_transaction_session_timeout={IDLE_IN_TRANSACTION_S * 1000}"}


class QuietPoolWarnings(logging.Filter):
    """psycopg_pool warns of each failed attempt to connect and each connection it discards: several lines a second
    while PostgreSQL is down, for the whole outage. The first passes, then at most one per ``every_s``, saying how
    many were held back (the store's background loops say when it works again: ``moorage.log.FailingRounds``)."""

    def __init__(self, every_s: float = STILL_FAILING_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.every_s = every_s
        self.clock = clock
        self.held = 0
        self._said: float | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        now = self.clock()
        if self._said is not None and now - self._said < self.every_s:
            self.held += 1
            return False
        if self.held:
            record.msg = f"{record.msg} ({self.held} more warnings of the pool held back since the last one)"
            self.held = 0
        self._said = now
        return True


_POOL_LOGGER = "psycopg.pool"


def quiet_pool_warnings() -> None:
    """Install ``QuietPoolWarnings`` on psycopg_pool's logger (once per process)."""
    pool_log = logging.getLogger(_POOL_LOGGER)
    if not any(isinstance(f, QuietPoolWarnings) for f in pool_log.filters):
        pool_log.addFilter(QuietPoolWarnings())


def connect_defaults(url: str) -> dict[str, str]:
    """The ``TCP_DEFAULTS`` and ``SESSION_DEFAULTS`` that the store URL ``url`` does not set itself (an operator's
    own values win: a URL with ``options`` keeps its own), as keyword arguments of ``psycopg.connect``."""
    own = conninfo_to_dict(url)
    return {k: v for k, v in (TCP_DEFAULTS | SESSION_DEFAULTS).items() if k not in own}


def is_connection_lost(e: BaseException) -> bool:
    """Whether ``e`` says the connection to the server is gone (not a statement's own failure)."""
    if not isinstance(e, psycopg.OperationalError):
        return False
    state = getattr(e, "sqlstate", None)
    # No SQLSTATE: libpq's own failure (refused, closed unexpectedly, "the connection is lost"), or the pool's.
    return state is None or state.startswith("08") or state in _LOST_STATES


def stale(conn: psycopg.Connection) -> bool:
    """Whether an idle connection is no longer usable. An idle connection has nothing to read: something to read
    is the server's goodbye (an error and the socket's end), checked with one round trip. Blocking."""
    if conn.closed or conn.broken:
        return True
    try:
        poller = select.poll()  # not select.select: a busy host's descriptors go past its limit of 1024
        poller.register(conn.fileno(), select.POLLIN)
        if poller.poll(0):
            conn.execute("")  # a notice or a parameter change passes; a closed connection raises
    except (psycopg.Error, OSError, ValueError):
        return True
    return conn.closed or conn.broken


def read_only(conn: psycopg.Connection) -> bool:
    """Whether the connection's server takes no writes (a standby). One round trip. Blocking."""
    try:
        row = conn.execute("SHOW transaction_read_only").fetchone()
    except psycopg.Error:
        return True
    return row is None or row[0] != "off"


@contextlib.contextmanager
def unreachable_as_503(what: str = "PostgreSQL") -> Iterator[None]:
    """Turn a lost connection (or no connection within the wait) into ``StoreUnreachable``; other errors pass."""
    try:
        yield
    except psycopg.errors.ReadOnlySqlTransaction as e:
        events.unreachable("store")  # /metrics: moorage_unreachable_total
        # Connected to a standby: a failover in progress, or a pooler still pointing at the old primary.
        raise StoreUnreachable(f"{what} takes no writes right now (read-only: a standby, or a failover in progress)",
                               hint=_HINT) from e
    except psycopg.OperationalError as e:
        if not is_connection_lost(e):
            raise
        if isinstance(e, PoolTimeout):  # every attempt to connect failed meanwhile (or every connection is busy)
            reason = f"no connection within {CONNECT_WAIT_S:.0f} s"
        else:
            reason = (str(e).strip().splitlines() or ["connection lost"])[0]
        events.unreachable("store")  # /metrics: moorage_unreachable_total
        raise StoreUnreachable(f"the store cannot reach {what} right now ({reason})", hint=_HINT) from e
