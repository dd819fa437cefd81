"""The control-plane store's server (:class:`StoreServer`): the keys of one job, in memory, in
the process that serves them, behind mutual TLS; and the frames both sides speak. Members reach
it through :class:`weight_transfer.security.secure_store.SecureStore` (module docstring there: the
protocol, the semantics, why it is hand-written).

Each connection is served in a thread of its own. A process without the job secret fails the
handshake and is closed before it can send one request. After the handshake the server sends
``[PROTOCOL, job id]``; then each request is one frame (4-byte big-endian length, then a msgpack
array ``[op, args...]``) answered by one frame ``[ok, result]`` (``setq``, a set, is not
answered). Data only: no frame is ever unpickled. Against a flood: at most :data:`MAX_PENDING`
handshakes at once, the first bytes within :data:`FIRST_BYTES_S` s and the handshake within
:data:`HANDSHAKE_S` s; a frame over :data:`MAX_FRAME` bytes closes the connection."""
from __future__ import annotations

import secrets
import socket
import struct
import threading
import time

import msgspec

from .secret import JobSecret

__all__ = ["StoreServer", "PROTOCOL", "MAX_FRAME", "MAX_KEY", "MAX_PENDING", "FIRST_BYTES_S", "HANDSHAKE_S",
           "CHECK_INLINE", "VALUE", "COUNTER"]

PROTOCOL = "weight-transfer-store/1"
MAX_FRAME = 1 << 30
"""Largest frame (bytes) either side accepts."""
MAX_KEY = 4096
"""Longest key (bytes)."""
MAX_PENDING = 256
"""Connections the server handshakes at a time; more are closed at once (a member's client
retries until its timeout): a flood of unauthenticated connections cannot take every thread."""
FIRST_BYTES_S = 1.0
"""Seconds a new connection has to send its first bytes (a TLS client sends its hello at once);
an idle one is closed then, so idle connections cannot hold the handshake slots."""
HANDSHAKE_S = 5.0
"""Seconds a connection has, in all, to complete its TLS handshake."""
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

    def watch(self, keys: list, seen: list, timeout: float) -> bool:
        """Block up to ``timeout`` seconds until a key's stored bytes differ from ``seen`` (None:
        absent); True if one does."""
        def changed() -> bool:
            return any((e[1] if (e := self.d.get(k)) is not None else None) != s for k, s in zip(keys, seen))
        with self.cv:
            return self.cv.wait_for(changed, timeout)

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
        if op == "watch":
            keys, seen = [_key(k) for k in _list(args[0])], _list(args[1])
            if len(seen) != len(keys) or any(v is not None and not isinstance(v, bytes) for v in seen):
                raise _OpError("watch: one seen value (bytes or None) per key")
            return self.watch(keys, seen, _secs(args[2]))
        if op == "getnow":
            return self.get(_key(args[0]), 0.0)
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
        import select

        try:
            if not select.select([raw], [], [], FIRST_BYTES_S)[0]:
                raise TimeoutError(f"sent nothing within {FIRST_BYTES_S:g} s")
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
