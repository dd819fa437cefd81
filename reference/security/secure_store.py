"""The control-plane store behind authentication: a key-value server that only the job's members
can reach, and its client, a ``torch.distributed.Store``.

:class:`StoreServer` keeps the keys in memory, in the process that serves them
(:func:`weight_transfer.serve_store`), and serves every connection in a thread of its own. A
connection is mutual TLS 1.3 between two certificates of the job's authority
(:meth:`weight_transfer.security.secret.JobSecret.tls_context`): a process without the job secret fails
the handshake and is closed before it can send one request, so it can neither read nor write nor
delete a key. After the handshake the server sends ``[PROTOCOL, job id]``; then each request is
one frame (4-byte big-endian length, then a msgpack array ``[op, args...]``) answered by one
frame ``[ok, result]``. Data only: no frame is ever unpickled.

:class:`SecureStore` is what members hold: a ``torch.distributed.Store`` (so ``PrefixStore``,
``init_process_group(store=...)`` and every caller of the store API take it) whose values are
sealed with the job's value key (:class:`weight_transfer.security.secret.Sealer`) before they leave the
process and opened after they come back: a value that does not open is refused with
:class:`weight_transfer.security.secret.AuthenticationError` naming the key, in :meth:`get` and in
:meth:`check` alike (a key's mere presence is acted on, so a flag or small value is verified
there too; a value over :data:`CHECK_INLINE` bytes, which only :meth:`get` makes use of, when read). Counters
(:meth:`add`) are integers the server adds to; they carry no MAC (only members reach the server).

Semantics follow torch's ``TCPStore`` (torch 2.13): ``get`` and ``wait`` block until the keys
exist or the store's timeout passes (``DistStoreError``), ``compare_set`` sets ``desired`` when
the key holds ``expected`` (or is missing and ``expected`` is empty) and returns the value the key
then holds (``expected`` itself for a missing key), a closed or unreachable server is a
``DistNetworkError``. The serving process's own :class:`SecureStore` reaches the table directly,
without a socket.

Why hand-written: torch's ``TCPStore`` cannot authenticate a peer, and no maintained key-value
server with mutual TLS ships with torch or Python; this one is a table, a condition variable and
a frame loop (the cryptography is OpenSSL's and ``cryptography``'s). Against a flood: at most
:data:`MAX_PENDING` handshakes at once, each within :data:`HANDSHAKE_S` s; a frame over
:data:`MAX_FRAME` bytes closes the connection.
"""
from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from datetime import timedelta

import msgspec
import torch.distributed as dist

from .secret import AuthenticationError, JobSecret, Sealer
from .store_server import (
    CHECK_INLINE,
    COUNTER,
    HANDSHAKE_S,
    MAX_FRAME,
    MAX_PENDING,
    PROTOCOL,
    StoreServer,
    _OpError,
    _recv_frame,
    _send_frame,
)

__all__ = ["StoreServer", "SecureStore", "StoreBusy", "PROTOCOL", "MAX_FRAME", "MAX_PENDING", "HANDSHAKE_S", "CHECK_INLINE"]


class _Local:
    """The serving process's connection: the table itself."""

    def __init__(self, server: StoreServer):
        self.server = server

    def send(self, op: str, *args) -> None:
        self.call(op, *args)

    def side(self, op: str, *args, wait: float):
        return self.call(op, *args, wait=wait)

    def call(self, op: str, *args, wait: float = 0.0):
        try:
            return self.server.table.call(op, list(args))
        except _OpError as e:
            raise dist.DistStoreError(f"store: {e}") from None

    def close(self) -> None:
        pass


class StoreBusy(ConnectionError):
    """The server closed a connection during its handshake without refusing this process's
    credentials (its handshake slots were taken, it was closing): worth another try."""


class _Remote:
    """TLS connections to a :class:`StoreServer`: one for the process's requests, in order (a
    lock serializes its threads', as torch's ``TCPStore`` client does), and spares for
    :meth:`SecureStore.watch`, which blocks at the server without holding the first one."""

    def __init__(self, host: str, port: int, secret: JobSecret, timeout: float):
        self.host, self.port, self.timeout = host, port, timeout
        self.lock = threading.Lock()
        self.sock, self.job_id = self._connect(secret, timeout)
        self.secret = secret
        self._spares: list = []
        self._spares_lock = threading.Lock()

    def _connect(self, secret: JobSecret, timeout: float) -> tuple[ssl.SSLSocket, bytes]:
        """One TLS connection and the server's hello. AuthenticationError when the peer refuses
        this process's certificate or presents one of another authority (the secrets differ) or
        speaks no TLS; :class:`StoreBusy` (an OSError: retried by :func:`weight_transfer.connect_store`
        until its deadline) when the server closes the connection during the handshake without a
        word (all its handshake slots taken: a flood)."""
        where = f"the store at {self.host}:{self.port}"
        mine = f"this process's job secret came from {secret.source}"
        raw = socket.create_connection((self.host, self.port), timeout=timeout)
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock = secret.tls_context(server=False).wrap_socket(raw)
        except ssl.SSLCertVerificationError as e:
            raw.close()
            raise AuthenticationError(f"{where} is not this job's: its certificate is not signed by the job "
                                      f"secret's authority (the secret differs from the store's: {e.verify_message}; "
                                      f"{mine})") from e
        except (ssl.SSLEOFError, ConnectionResetError) as e:
            raw.close()
            raise StoreBusy(f"{where} closed the connection during the TLS handshake") from e
        except ssl.SSLError as e:
            raw.close()
            if "ALERT" in str(e).upper():
                raise AuthenticationError(f"{where} refused this process's credentials: the job secret differs "
                                          f"from the one the store was started with ({e.reason}; {mine})") from e
            if e.reason == "UNEXPECTED_EOF_WHILE_READING":
                raise StoreBusy(f"{where} closed the connection during the TLS handshake") from e
            raise AuthenticationError(f"{where} did not complete a TLS handshake ({e.reason}): a store started "
                                      "without authentication (WEIGHT_TRANSFER_INSECURE=1), or another service") from e
        except (OSError, ValueError):
            raw.close()
            raise
        try:
            sock.settimeout(timeout)
            hello = _recv_frame(sock)
        except ssl.SSLError as e:
            sock.close()
            if "ALERT" in str(e).upper():  # TLS 1.3: a refused client certificate arrives here
                raise AuthenticationError(f"{where} refused this process's credentials: the job secret differs "
                                          f"from the one the store was started with ({e.reason}; {mine})") from e
            raise StoreBusy(f"{where} closed the connection before its hello ({e.reason})") from e
        except (OSError, ConnectionError, msgspec.DecodeError) as e:
            sock.close()
            if isinstance(e, (ConnectionError, msgspec.DecodeError)) and not isinstance(e, ConnectionRefusedError):
                raise StoreBusy(f"{where} closed the connection before its hello") from e
            raise
        if not (isinstance(hello, list) and len(hello) == 2 and hello[0] == PROTOCOL and isinstance(hello[1], bytes)):
            sock.close()
            raise AuthenticationError(f"{where} does not speak {PROTOCOL}")
        return sock, hello[1]

    def side(self, op: str, *args, wait: float):
        """A request that blocks at the server up to ``wait`` seconds (``watch``, ``wait``), on a
        spare connection (opened on first use, kept for the next)."""
        with self._spares_lock:
            sock = self._spares.pop() if self._spares else None
        if sock is None:
            try:
                sock, _ = self._connect(self.secret, min(self.timeout, 5.0))
            except (StoreBusy, TimeoutError):  # a busy server: this round waits here, the caller looks again
                time.sleep(min(wait, 0.05))
                return op == "watch"  # watch: "may have changed"; wait: "not yet"
        try:
            sock.settimeout(self.timeout + wait)
            _send_frame(sock, [op, *args])
            ok, out = _recv_frame(sock)
        except (OSError, ConnectionError, ValueError, msgspec.DecodeError) as e:
            if sock is not None:
                sock.close()
            raise dist.DistNetworkError(f"the control-plane store at {self.host}:{self.port} closed the "
                                        f"connection ({type(e).__name__}: {e})") from e
        with self._spares_lock:
            self._spares.append(sock)
        if not ok:
            raise dist.DistStoreError(f"store: {out}")
        return out

    def send(self, op: str, *args) -> None:
        """A request nobody waits for (``setq``: torch's ``TCPStore`` client does not wait for a
        set either); the server handles a connection's requests in order, so the next call of
        this process sees it."""
        with self.lock:
            if self.sock is None:
                raise dist.DistNetworkError(f"the control-plane store at {self.host}:{self.port} closed the connection")
            try:
                self.sock.settimeout(self.timeout)
                _send_frame(self.sock, [op, *args])
            except (OSError, ValueError) as e:
                self._drop()
                raise dist.DistNetworkError(f"the control-plane store at {self.host}:{self.port} closed the "
                                            f"connection ({type(e).__name__}: {e})") from e

    def call(self, op: str, *args, wait: float = 0.0):
        with self.lock:
            if self.sock is None:
                raise dist.DistNetworkError(f"the control-plane store at {self.host}:{self.port} closed the connection")
            try:
                self.sock.settimeout(self.timeout + wait)
                _send_frame(self.sock, [op, *args])
                ok, out = _recv_frame(self.sock)
            except TimeoutError as e:
                self._drop()
                raise dist.DistNetworkError(f"the control-plane store at {self.host}:{self.port} did not answer "
                                            f"{op!r} within {self.timeout + wait:.0f} s") from e
            except (OSError, ConnectionError, ValueError, msgspec.DecodeError) as e:
                self._drop()
                raise dist.DistNetworkError(f"the control-plane store at {self.host}:{self.port} closed the "
                                            f"connection ({type(e).__name__}: {e})") from e
        if not ok:
            raise dist.DistStoreError(f"store: {out}")
        return out

    def _drop(self) -> None:
        self.sock.close()  # socket.close swallows the OS's errors
        self.sock = None

    def close(self) -> None:
        with self.lock:
            if self.sock is not None:
                self._drop()
        with self._spares_lock:
            for sock in self._spares:
                sock.close()
            self._spares.clear()


class SecureStore(dist.Store):
    """A member's handle on the job's store (see the module docstring): the ``torch.distributed.Store``
    interface over an authenticated connection, every value sealed with the job's key.
    :attr:`host` / :attr:`port`: the server's address; :attr:`secret`: the job secret (for a
    new connection, :meth:`clone`); :attr:`job_id`: the store's job. Build it with
    :func:`weight_transfer.serve_store` / :func:`weight_transfer.connect_store`."""

    def __init__(self, conn, *, host: str, port: int, secret: JobSecret, job_id: bytes, timeout: float,
                 server: StoreServer | None = None):
        super().__init__()
        self._conn, self._server = conn, server
        self.host, self.port, self.secret, self.job_id = host, port, secret, job_id
        self._sealer: Sealer = secret.sealer(job_id)
        self._timeout_s = float(timeout)
        self._pid = os.getpid()
        self.set_timeout(timedelta(seconds=timeout))

    @classmethod
    def serve(cls, host: str, port: int, secret: JobSecret, *, timeout: float) -> SecureStore:
        """Start a :class:`StoreServer` here and return this process's handle on it."""
        server = StoreServer(host, port, secret)
        return cls(_Local(server), host=host, port=server.port, secret=secret, job_id=server.job_id,
                   timeout=timeout, server=server)

    @classmethod
    def connect(cls, host: str, port: int, secret: JobSecret, *, timeout: float) -> SecureStore:
        """One connection to the server at ``host:port`` (a single attempt; see
        :func:`weight_transfer.connect_store` for retries). AuthenticationError when either side
        refuses the other's credentials; OSError when nothing answers."""
        conn = _Remote(host, port, secret, timeout)
        return cls(conn, host=host, port=port, secret=secret, job_id=conn.job_id, timeout=timeout)

    # -- plumbing

    def _with_timeout(self, timeout: float) -> SecureStore:
        self.set_timeout(timedelta(seconds=timeout))  # connecting used what was left of the deadline
        return self

    @property
    def server(self) -> StoreServer | None:
        """The :class:`StoreServer` when this process serves the store, else None."""
        return self._server

    def _call(self, op: str, *args, wait: float = 0.0):
        if os.getpid() != self._pid:  # a forked child must not share its parent's TLS stream
            self._reconnect()
        return self._conn.call(op, *args, wait=wait)

    def _reconnect(self) -> None:
        self._pid = os.getpid()
        if self._server is not None and isinstance(self._conn, _Local):
            host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
            self._server, self._conn = None, _Remote(host, self.port, self.secret, self._timeout_s)
        else:
            self._conn = _Remote(self.host, self.port, self.secret, self._timeout_s)

    def set_timeout(self, timeout: timedelta) -> None:
        """Seconds a call may block (``get``, ``wait``, a server that does not answer)."""
        super().set_timeout(timeout)
        self._timeout_s = timeout.total_seconds()
        if isinstance(self._conn, _Remote):
            self._conn.timeout = self._timeout_s

    def _open(self, key: str, entry) -> bytes:
        kind, data = entry
        return data if kind == COUNTER else self._sealer.open(key, data)

    @staticmethod
    def _b(value) -> bytes:
        return value.encode() if isinstance(value, str) else bytes(value)

    def _timed_out(self, keys) -> dist.DistStoreError:
        return dist.DistStoreError(f"wait timeout after {self._timeout_s * 1e3:.0f}ms, keys: {list(keys)}")

    # -- the torch.distributed.Store interface

    def set(self, key: str, value) -> None:
        if os.getpid() != self._pid:
            self._reconnect()
        self._conn.send("setq", key, self._sealer.seal(key, self._b(value)))

    def get(self, key: str) -> bytes:
        entry = self._call("get", key, self._timeout_s, wait=self._timeout_s)
        if entry is None:
            raise self._timed_out([key])
        return self._open(key, entry)

    def check(self, keys) -> bool:
        """True when every key exists; each present value up to :data:`CHECK_INLINE` bytes is
        opened first (AuthenticationError naming a key whose value does not authenticate)."""
        keys = list(keys)
        entries = self._call("check", keys)
        for k, e in zip(keys, entries):
            if e is not None and e[1] is not None:  # a large value is verified when it is read
                self._open(k, e)
        return all(e is not None for e in entries)

    def get_nowait(self, key: str) -> bytes | None:
        """The value of ``key``, or None at once when it is missing (one request, where
        ``check`` + ``get`` take two)."""
        entry = self._call("getnow", key)
        return None if entry is None else self._open(key, entry)

    def watch(self, keys, seen=None, timeout: float = 0.0) -> bool:
        """Block up to ``timeout`` seconds, at the server, until one of ``keys`` holds something
        other than ``seen`` (its value as this process last read it; None: absent, the default
        for every key); True as soon as one does, False at the timeout. Serves the control
        plane's waits without polling: a waiter asks once per slice and wakes when a key
        changes. Runs on a spare connection, so the process's other requests go on meanwhile."""
        keys = list(keys)
        seen = [None] * len(keys) if seen is None else list(seen)
        sealed = [None if v is None else self._sealer.seal(k, self._b(v)) for k, v in zip(keys, seen)]
        if os.getpid() != self._pid:
            self._reconnect()
        return bool(self._conn.side("watch", keys, sealed, float(timeout), wait=float(timeout)))

    def wait_all(self, keys, timeout: float) -> bool:
        """Block up to ``timeout`` seconds, at the server, until every one of ``keys`` exists;
        True if they do (:meth:`wait` without raising, on a spare connection like :meth:`watch`)."""
        if os.getpid() != self._pid:
            self._reconnect()
        return bool(self._conn.side("wait", list(keys), float(timeout), wait=float(timeout)))

    def add(self, key: str, value: int) -> int:
        return int(self._call("add", key, int(value)))

    def compare_set(self, key: str, expected, desired) -> bytes:
        exp, des = self._b(expected), self._b(desired)
        got = self._call("cas", key, self._sealer.seal(key, exp) if exp else b"", self._sealer.seal(key, des))
        return self._sealer.open(key, got) if got else b""

    def delete_key(self, key: str) -> bool:
        return bool(self._call("del", key))

    def num_keys(self) -> int:
        return int(self._call("num"))

    def list_keys(self) -> list[str]:
        return list(self._call("keys"))

    def wait(self, keys, timeout: timedelta | None = None) -> None:
        t = self._timeout_s if timeout is None else timeout.total_seconds()
        if not self._call("wait", list(keys), t, wait=t):
            raise self._timed_out(keys)

    def multi_get(self, keys) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys, values) -> None:
        keys = list(keys)
        self._call("mset", keys, [self._sealer.seal(k, self._b(v)) for k, v in zip(keys, values)])

    def append(self, key: str, value) -> None:
        for _ in range(10000):  # a sealed value is appended to as a whole: read, extend, compare_set
            cur = self._call("get", key, 0.0)
            old = self._open(key, cur) if cur is not None else b""
            new = old + self._b(value)
            if self.compare_set(key, old, new) == new:
                return
        raise dist.DistStoreError(f"append: key {key!r} contended")

    def clone(self) -> SecureStore:
        """A new handle with a connection of its own (the serving process's own clone reaches
        the table directly, like this one)."""
        if isinstance(self._conn, _Local) and os.getpid() == self._pid:
            return SecureStore(self._conn, host=self.host, port=self.port, secret=self.secret, job_id=self.job_id,
                               timeout=self._timeout_s, server=self._server)
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        return SecureStore.connect(host, self.port, self.secret, timeout=self._timeout_s)

    def close(self) -> None:
        """Close this handle's connection; in the serving process, stop the server."""
        self._conn.close()
        if self._server is not None:
            self._server.close()

    def __repr__(self) -> str:
        return f"SecureStore({self.host}:{self.port}{', serving' if self._server is not None else ''})"
