"""The control-plane store behind authentication: a key-value server that only the job's members
can reach, and its client, a ``torch.distributed.Store``.

:class:`StoreServer` keeps the keys in memory, in the process that serves them
(:func:`weight_transfer.serve_store`), and serves every connection in a thread of its own. A
connection is mutual TLS 1.3 between two certificates of the job's authority
(:meth:`weight_transfer.security.JobSecret.tls_context`): a process without the job secret fails
the handshake and is closed before it can send one request, so it can neither read nor write nor
delete a key. After the handshake the server sends ``[PROTOCOL, job id]``; then each request is
one frame (4-byte big-endian length, then a msgpack array ``[op, args...]``) answered by one
frame ``[ok, result]``. Data only: no frame is ever unpickled.

:class:`SecureStore` is what members hold: a ``torch.distributed.Store`` (so ``PrefixStore``,
``init_process_group(store=...)`` and every caller of the store API take it) whose values are
sealed with the job's value key (:class:`weight_transfer.security.Sealer`) before they leave the
process and opened after they come back: a value that does not open is refused with
:class:`weight_transfer.security.AuthenticationError` naming the key, in :meth:`get` and in
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
import secrets
import socket
import ssl
import struct
import threading
import time
from datetime import timedelta

import msgspec
import torch.distributed as dist

from .security import AuthenticationError, JobSecret, Sealer

__all__ = ["StoreServer", "SecureStore", "PROTOCOL", "MAX_FRAME", "MAX_PENDING", "HANDSHAKE_S"]

PROTOCOL = "weight-transfer-store/1"
MAX_FRAME = 1 << 30
"""Largest frame (bytes) either side accepts."""
MAX_KEY = 4096
"""Longest key (bytes)."""
MAX_PENDING = 64
"""Connections the server handshakes at a time; more are closed at once (a flood of
unauthenticated connections cannot starve the members' threads)."""
HANDSHAKE_S = 10.0
"""Seconds a connection has to complete its TLS handshake."""
CHECK_INLINE = 4096
"""``check`` returns values up to this many bytes for the client to verify (flags, states, small
messages: what is acted on by its presence); a larger value is verified when it is read."""
VALUE, COUNTER = 0, 1
_LEN = struct.Struct(">I")
_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder()


class _OpError(Exception):
    """A request the table refuses (sent back to the client as an error, the connection stays)."""


class _Table:
    """The keys: ``{key: (VALUE | COUNTER, bytes)}`` under one condition variable."""

    def __init__(self):
        self.d: dict[str, tuple[int, bytes]] = {}
        self.cv = threading.Condition()

    def _put(self, key: str, entry: tuple[int, bytes]) -> None:
        self.d[key] = entry
        self.cv.notify_all()

    def set(self, key: str, data: bytes) -> None:
        with self.cv:
            self._put(key, (VALUE, data))

    def mset(self, keys: list, datas: list) -> None:
        with self.cv:
            for k, v in zip(keys, datas):
                self.d[k] = (VALUE, v)
            self.cv.notify_all()

    def get(self, key: str, wait: float):
        with self.cv:
            if key not in self.d and not self.cv.wait_for(lambda: key in self.d, wait):
                return None
            return self.d[key]

    def check(self, keys: list) -> list:
        with self.cv:
            got = [self.d.get(k) for k in keys]
        return [e if e is None or len(e[1]) <= CHECK_INLINE else (e[0], None) for e in got]

    def add(self, key: str, n: int) -> int:
        with self.cv:
            e = self.d.get(key)
            if e is not None and e[0] != COUNTER:
                raise _OpError(f"add: key {key!r} holds a value, not a counter")
            v = (int(e[1]) if e is not None else 0) + n
            self._put(key, (COUNTER, str(v).encode()))
            return v

    def cas(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self.cv:
            e = self.d.get(key)
            if e is None:
                if expected == b"":
                    self._put(key, (VALUE, desired))
                    return desired
                return expected
            if e[1] == expected:
                self._put(key, (VALUE, desired))
                return desired
            return e[1]

    def delete(self, key: str) -> bool:
        with self.cv:
            found = self.d.pop(key, None) is not None
            self.cv.notify_all()
            return found

    def num_keys(self) -> int:
        with self.cv:
            return len(self.d)

    def keys(self) -> list[str]:
        with self.cv:
            return list(self.d)

    def wait(self, keys: list, timeout: float) -> bool:
        with self.cv:
            return self.cv.wait_for(lambda: all(k in self.d for k in keys), timeout)

    def call(self, op: str, args: list):
        """One request, as the server and the in-process client run it (``args`` checked here:
        they come from a member, but a malformed frame must not take the server down)."""
        if op in ("set", "setq"):
            key, data = _key(args[0]), _bytes(args[1])
            return self.set(key, data)
        if op == "get":
            return self.get(_key(args[0]), _secs(args[1]))
        if op == "check":
            return self.check([_key(k) for k in _list(args[0])])
        if op == "add":
            n = args[1]
            if not isinstance(n, int) or isinstance(n, bool):
                raise _OpError("add: the increment is not an int")
            return self.add(_key(args[0]), n)
        if op == "cas":
            return self.cas(_key(args[0]), _bytes(args[1]), _bytes(args[2]))
        if op == "del":
            return self.delete(_key(args[0]))
        if op == "num":
            return self.num_keys()
        if op == "keys":
            return self.keys()
        if op == "wait":
            return self.wait([_key(k) for k in _list(args[0])], _secs(args[1]))
        if op == "mset":
            keys, datas = [_key(k) for k in _list(args[0])], [_bytes(v) for v in _list(args[1])]
            if len(keys) != len(datas):
                raise _OpError("mset: as many values as keys")
            return self.mset(keys, datas)
        if op == "ping":
            return True
        raise _OpError(f"unknown operation {op!r}")


def _key(k) -> str:
    if not isinstance(k, str) or len(k) > MAX_KEY:
        raise _OpError("a key is a str of at most 4096 characters")
    return k


def _bytes(v) -> bytes:
    if not isinstance(v, bytes):
        raise _OpError("a value is bytes")
    return v


def _secs(v) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not (0 <= v <= 1e7):
        raise _OpError("a wait is a number of seconds in [0, 1e7]")
    return float(v)


def _list(v) -> list:
    if not isinstance(v, list):
        raise _OpError("a list of keys is expected")
    return v


def _recv_exact(sock, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed")
        got += k
    return bytes(buf)


def _recv_frame(sock):
    (n,) = _LEN.unpack(_recv_exact(sock, 4))
    if n > MAX_FRAME:
        raise ConnectionError(f"frame of {n} bytes (limit {MAX_FRAME})")
    return _DEC.decode(_recv_exact(sock, n))


def _send_frame(sock, obj) -> None:
    body = _ENC.encode(obj)
    sock.sendall(_LEN.pack(len(body)) + body)


class StoreServer:
    """The store's server: listens on ``(host, port)`` (``port`` 0: a free one, read
    :attr:`port`), accepts only members of the job whose ``secret`` it holds, and serves the
    table until :meth:`close` (or the process ends). ``job_id``: 16 random bytes naming this
    store's job in every sealed value. :attr:`refused` counts connections that failed the
    handshake; :attr:`last_refusals` keeps the last ten ``(peer, reason)``."""

    def __init__(self, host: str, port: int, secret: JobSecret):
        self.secret = secret
        self.job_id = secrets.token_bytes(16)
        self.table = _Table()
        self._ctx = secret.tls_context(server=True)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._sock = socket.create_server((host, port), family=family, backlog=256,
                                              dualstack_ipv6=family == socket.AF_INET6 and host in ("::", ""))
        except OSError as e:
            raise OSError(e.errno, f"serve_store: cannot listen on {host}:{port}: {e.strerror}") from e
        self.host, self.port = host, self._sock.getsockname()[1]
        self.refused = 0
        self.last_refusals: list[tuple[str, str]] = []
        self._pending = threading.BoundedSemaphore(MAX_PENDING)
        self._conns: set = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name=f"wt-store-{self.port}", daemon=True).start()

    def _refuse(self, peer, why: str) -> None:
        with self._lock:
            self.refused += 1
            self.last_refusals = (self.last_refusals + [(f"{peer[0]}:{peer[1]}", why)])[-10:]

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, peer = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)
                continue
            if not self._pending.acquire(blocking=False):
                self._refuse(peer, f"more than {MAX_PENDING} handshakes at once")
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(sock, peer), name=f"wt-store-conn-{peer[1]}",
                             daemon=True).start()

    def _serve(self, raw: socket.socket, peer) -> None:
        try:
            raw.settimeout(HANDSHAKE_S)
            conn = self._ctx.wrap_socket(raw, server_side=True)
        except (OSError, ValueError) as e:  # ssl.SSLError, a timeout, a reset: not a member
            self._refuse(peer, f"{type(e).__name__}: {e}")
            raw.close()
            return
        finally:
            self._pending.release()
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._conns.add(conn)
        try:
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _send_frame(conn, [PROTOCOL, self.job_id])
            while True:
                req = _recv_frame(conn)
                if not isinstance(req, list) or not req or not isinstance(req[0], str):
                    raise ConnectionError("malformed request")
                try:
                    out = [True, self.table.call(req[0], req[1:])]
                except (_OpError, IndexError) as e:
                    if req[0] == "setq":  # nobody waits for its answer: a malformed one ends the connection
                        raise ConnectionError(f"malformed set: {e}") from None
                    out = [False, str(e) or type(e).__name__]
                if req[0] != "setq":
                    _send_frame(conn, out)
        except (OSError, ConnectionError, ValueError, msgspec.DecodeError):
            pass  # the member closed (or died), or sent what is not a frame: drop the connection
        finally:
            with self._lock:
                self._conns.discard(conn)
            try:
                conn.close()
            except OSError:
                pass

    def close(self) -> None:
        """Stop listening and close every connection (members then get ``DistNetworkError``,
        as from a ``TCPStore`` whose server ended)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
        try:
            self._sock.close()
        except OSError:
            pass
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
                c.close()
            except OSError:
                pass


class _Local:
    """The serving process's connection: the table itself."""

    def __init__(self, server: StoreServer):
        self.server = server

    def send(self, op: str, *args) -> None:
        self.call(op, *args)

    def call(self, op: str, *args, wait: float = 0.0):
        try:
            return self.server.table.call(op, list(args))
        except _OpError as e:
            raise dist.DistStoreError(f"store: {e}") from None

    def close(self) -> None:
        pass


class _Remote:
    """One TLS connection to a :class:`StoreServer` (a lock serializes the requests of the
    process's threads, as torch's ``TCPStore`` client does)."""

    def __init__(self, host: str, port: int, secret: JobSecret, timeout: float):
        self.host, self.port, self.timeout = host, port, timeout
        self.lock = threading.Lock()
        self.sock = None
        self.job_id = self._connect(secret, timeout)
        self.secret = secret

    def _connect(self, secret: JobSecret, timeout: float) -> bytes:
        where = f"the store at {self.host}:{self.port}"
        raw = socket.create_connection((self.host, self.port), timeout=timeout)
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock = secret.tls_context(server=False).wrap_socket(raw)
        except ssl.SSLCertVerificationError as e:
            raw.close()
            raise AuthenticationError(f"{where} is not this job's: its certificate is not signed by the job "
                                      f"secret's authority (the secret differs from the store's: {e.verify_message})") from e
        except ssl.SSLError as e:
            raw.close()
            if "ALERT" in str(e).upper():
                raise AuthenticationError(f"{where} refused this process's credentials: the job secret differs "
                                          f"from the one the store was started with ({e.reason})") from e
            raise AuthenticationError(f"{where} did not complete a TLS handshake ({e.reason}): a store started "
                                      "without authentication (WEIGHT_TRANSFER_INSECURE=1), or another service") from e
        except (OSError, ValueError):
            raw.close()
            raise
        try:
            sock.settimeout(timeout)
            hello = _recv_frame(sock)
        except (OSError, ConnectionError, msgspec.DecodeError) as e:
            sock.close()
            if isinstance(e, ConnectionError) and not isinstance(e, (ConnectionRefusedError, ConnectionResetError)):
                raise AuthenticationError(f"{where} closed the connection after the handshake: it refused this "
                                          "process's credentials (the job secret differs?)") from e
            raise
        if not (isinstance(hello, list) and len(hello) == 2 and hello[0] == PROTOCOL and isinstance(hello[1], bytes)):
            sock.close()
            raise AuthenticationError(f"{where} does not speak {PROTOCOL}")
        self.sock = sock
        return hello[1]

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
