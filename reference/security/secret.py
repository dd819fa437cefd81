"""Who may speak on the control plane: the job secret, what is derived from it, and the
warning of the one opt-out (docs/SECURITY.md).

A job has one **secret** of 32 random bytes (256 bits), made by whoever starts the job
(:func:`weight_transfer.serve_store` when none is set; the harness and the vLLM backend do it
for their users) and handed to every member through a channel the job already trusts: the
environment variable :data:`ENV_SECRET` (64 hex digits) or a file only its owner can read
(:data:`ENV_SECRET_FILE`; :meth:`JobSecret.write_file`). It never travels through the store or
vLLM's HTTP routes. Two things are derived from it, with HKDF-SHA256 (RFC 5869):

- the job's **certificate authority**: an Ed25519 key (RFC 8032) and a self-signed certificate,
  byte-identical in every member (Ed25519 signatures are deterministic, the certificate's
  fields fixed). Every connection to the store is mutual TLS 1.3 between two certificates this
  authority signed (each process makes its own leaf key at connect): a process without the
  secret cannot complete the handshake, so it can neither read nor write nor delete a key.
- the **value key**: every value a member puts in the store is sealed with AES-SIV (RFC 5297,
  deterministic authenticated encryption: the same key and value seal to the same bytes, which
  ``compare_set`` needs) with the store's job id and the key's name as associated data
  (:class:`Sealer`): a value is readable only by members, and one moved to another key or
  another job's store fails to open (:class:`AuthenticationError` naming the key).

The crypto is the ``cryptography`` package's (HKDF, Ed25519, X.509, AES-SIV) and OpenSSL's TLS
through Python's ``ssl``; nothing here is hand-written cryptography. Why this and not torch's
``TCPStore``: it has no authentication, so any process that reaches its port is a member
(vLLM CVE-2025-32444 and CVE-2025-30165 are this class of bug); :mod:`weight_transfer.security.secure_store`
serves the same key-value interface behind the TLS above.

The one opt-out, :data:`ENV_INSECURE` (or ``insecure=True``), keeps torch's plain ``TCPStore``
for a trusted lab and prints :func:`warn_insecure` every time it is used.
"""
from __future__ import annotations

import datetime
import os
import secrets
import ssl
import stat
import sys
import tempfile
import threading
from dataclasses import dataclass, field

from ..errors import ControlError

__all__ = ["JobSecret", "Sealer", "AuthenticationError", "ENV_SECRET", "ENV_SECRET_FILE", "ENV_INSECURE",
           "resolve_secret", "scrubbed_env", "insecure_requested", "warn_insecure", "SECRET_BYTES"]

ENV_SECRET = "WEIGHT_TRANSFER_SECRET"
"""Environment variable holding the job secret as hex (64 digits or more)."""
ENV_SECRET_FILE = "WEIGHT_TRANSFER_SECRET_FILE"
"""Environment variable naming a file that holds the job secret as hex; the file must be a
regular file owned by this user and readable by no one else (mode 0600 or 0400)."""
ENV_INSECURE = "WEIGHT_TRANSFER_INSECURE"
"""``1``: no authentication (torch's plain ``TCPStore``) -- a trusted lab's explicit opt-out;
a warning is printed every time a store is served or connected this way."""
SECRET_BYTES = 32
"""Bytes of a job secret (256 bits)."""
HOW = (f"set {ENV_SECRET} (the hex secret the store's process holds) or {ENV_SECRET_FILE} (a file only you can "
       "read) in this process's environment, or pass secret=; see docs/SECURITY.md")
"""How to pass the secret, for error messages."""


class AuthenticationError(ControlError):
    """A process could not prove membership of the job (no secret, a wrong one, a store that is
    not this job's), or a value read from the store does not open with the job's key (written by
    a non-member, moved from another key or job, or altered): it is refused, never acted on."""


def _hkdf(secret: bytes, info: bytes, length: int = 32) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=length, salt=b"weight-transfer job secret v1", info=info).derive(secret)


@dataclass(frozen=True, eq=False)
class JobSecret:
    """A job's secret (``raw``: at least :data:`SECRET_BYTES` bytes). Its ``repr`` hides it.
    Build one with :meth:`generate`, :meth:`parse` (hex), :meth:`from_file` or :meth:`from_env`."""

    raw: bytes = field(repr=False)
    source: str = field(default="secret=", compare=False)
    """Where this process got it (``$WEIGHT_TRANSFER_SECRET``, the file, generated, ``secret=``):
    named by the errors of a secret that differs from the store's."""
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.raw, bytes) or len(self.raw) < SECRET_BYTES:
            raise ValueError(f"a job secret is at least {SECRET_BYTES} bytes ({2 * SECRET_BYTES} hex digits)")

    def __repr__(self) -> str:
        return "JobSecret(<hidden>)"

    @classmethod
    def generate(cls) -> JobSecret:
        """A fresh secret from the OS's CSPRNG (``secrets.token_bytes``)."""
        return cls(secrets.token_bytes(SECRET_BYTES), source="generated by this process")

    @classmethod
    def parse(cls, text: str, *, where: str = "secret=") -> JobSecret:
        """The secret written as hex (surrounding whitespace ignored). ValueError naming
        ``where`` for anything else or fewer than 64 digits (the value is never echoed)."""
        t = text.strip() if isinstance(text, str) else ""
        try:
            raw = bytes.fromhex(t)
        except ValueError:
            raw = b""
        if len(raw) < SECRET_BYTES:
            raise ValueError(f"{where}: not a job secret (hex, at least {2 * SECRET_BYTES} digits: "
                             "`weight-transfer secret` makes one)")
        return cls(raw, source=where)

    @classmethod
    def from_file(cls, path) -> JobSecret:
        """The secret in file ``path`` (hex). ValueError naming the path when it is missing, not
        a regular file, not owned by this user, or readable or writable by anyone else (a
        secret others can read is not one)."""
        p = os.fspath(path)
        try:
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError as e:
            raise ValueError(f"job secret file {p!r}: {e.strerror or e} (make one: weight-transfer secret --out PATH)") from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"job secret file {p!r}: not a regular file")
            if hasattr(os, "getuid") and st.st_uid != os.getuid():
                raise ValueError(f"job secret file {p!r}: owned by uid {st.st_uid}, not by this user ({os.getuid()})")
            if st.st_mode & 0o077:
                raise ValueError(f"job secret file {p!r}: mode {stat.S_IMODE(st.st_mode):04o} lets others read or "
                                 "write it; chmod 600 it")
            text = os.read(fd, 4096).decode("ascii", "replace")
        finally:
            os.close(fd)
        return cls.parse(text, where=f"job secret file {p!r}")

    @classmethod
    def from_env(cls, environ=None) -> JobSecret | None:
        """The secret :data:`ENV_SECRET` or :data:`ENV_SECRET_FILE` names (the variable first),
        None when neither is set. ValueError naming the variable when it holds no secret."""
        env = os.environ if environ is None else environ
        if env.get(ENV_SECRET):  # the variable wins over the file (errors name which was used)
            return cls.parse(env[ENV_SECRET], where=f"${ENV_SECRET}")
        if env.get(ENV_SECRET_FILE):
            return cls.from_file(env[ENV_SECRET_FILE])
        return None

    def hex(self) -> str:
        """The secret as hex: what :data:`ENV_SECRET` holds."""
        return self.raw.hex()

    def env(self) -> dict[str, str]:
        """``{ENV_SECRET: hex}``: add it to the environment of a process you start (a member)."""
        return {ENV_SECRET: self.hex()}

    def export(self) -> None:
        """Put this secret in this process's environment (:data:`ENV_SECRET`), so the processes
        it starts from now on inherit it."""
        os.environ[ENV_SECRET] = self.hex()
        os.environ.pop(ENV_SECRET_FILE, None)

    def write_file(self, path) -> str:
        """Write the secret to ``path`` (created mode 0600, replacing a file of this user's);
        returns the path. Point :data:`ENV_SECRET_FILE` of every member at it."""
        p = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(p)), mode=0o700, exist_ok=True)
        tmp = f"{p}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, (self.hex() + "\n").encode())
        finally:
            os.close(fd)
        os.replace(tmp, p)
        return p

    # -- derived material (cached per secret)

    def _derived(self, what: str, make):
        with _LOCK:
            if what not in self._cache:
                self._cache[what] = make()
            return self._cache[what]

    def _ca(self):
        def make():
            from cryptography import x509
            from cryptography.hazmat.primitives import serialization
            from cryptography.hazmat.primitives.asymmetric import ed25519
            from cryptography.x509.oid import NameOID

            key = ed25519.Ed25519PrivateKey.from_private_bytes(_hkdf(self.raw, b"store ca ed25519"))
            name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "weight-transfer job")])
            cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                    .serial_number(1).not_valid_before(datetime.datetime(2020, 1, 1))
                    .not_valid_after(datetime.datetime(2100, 1, 1))
                    .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                    .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                                 key_encipherment=False, data_encipherment=False, key_agreement=False,
                                                 key_cert_sign=True, crl_sign=False, encipher_only=False,
                                                 decipher_only=False), critical=True)
                    .sign(key, None))
            return key, name, cert.public_bytes(serialization.Encoding.PEM).decode()
        return self._derived("ca", make)

    def tls_context(self, *, server: bool) -> ssl.SSLContext:
        """A TLS 1.3 context that presents a fresh leaf certificate of the job's authority and
        accepts only peers with one (mutual TLS; the host name is not checked: membership is
        the authority's signature). Cached per process and role."""
        return self._derived(f"tls-{server}-{os.getpid()}", lambda: self._make_context(server))

    def _make_context(self, server: bool) -> ssl.SSLContext:
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
        from cryptography.x509.oid import NameOID

        ca_key, ca_name, ca_pem = self._ca()
        key = ed25519.Ed25519PrivateKey.generate()
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "weight-transfer member")]))
                .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=365))
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .sign(ca_key, None))
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        if not server:
            ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cadata=ca_pem)
        pem = cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        # ssl loads a certificate chain from a file only: one only this user can read, removed at once
        d = tempfile.mkdtemp(prefix="wt-tls-")
        try:
            path = os.path.join(d, "leaf.pem")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, pem)
            finally:
                os.close(fd)
            ctx.load_cert_chain(path)
        finally:
            for f in os.listdir(d):
                os.unlink(os.path.join(d, f))
            os.rmdir(d)
        return ctx

    def sealer(self, job_id: bytes) -> Sealer:
        """The :class:`Sealer` of values in the store of job ``job_id``."""
        return self._derived(f"sealer-{job_id.hex()}", lambda: Sealer(_hkdf(self.raw, b"store values aes-siv", 64), job_id))


_LOCK = threading.RLock()


class Sealer:
    """Seals and opens the values of one job's store: AES-SIV (``cryptography``'s ``AESSIV``,
    512-bit key) over the value, with the format tag, the job id and the key's name as associated
    data. Sealed bytes: ``b"\\x01"`` (format 1) + the SIV (16 bytes) + the ciphertext (the
    value's length). Deterministic, so ``compare_set`` can compare sealed values."""

    FORMAT = b"\x01"
    OVERHEAD = 17
    """Bytes a sealed value has beyond its plaintext."""

    def __init__(self, key: bytes, job_id: bytes):
        from cryptography.hazmat.primitives.ciphers.aead import AESSIV

        self._siv = AESSIV(key)
        self.job_id = job_id
        self._ad_head = [b"weight-transfer store value", job_id]

    def seal(self, key: str, value: bytes) -> bytes:
        return self.FORMAT + self._siv.encrypt(bytes(value), [*self._ad_head, key.encode()])

    def open(self, key: str, sealed: bytes) -> bytes:
        """The value sealed under ``key``; :class:`AuthenticationError` naming ``key`` when it
        was not sealed by a member for this key of this job."""
        from cryptography.exceptions import InvalidTag

        if sealed[:1] != self.FORMAT or len(sealed) < self.OVERHEAD:
            raise AuthenticationError(f"store key {key!r}: refused a value that is not sealed by a member of this job "
                                      "(not the job's format)")
        try:
            return self._siv.decrypt(sealed[1:], [*self._ad_head, key.encode()])
        except InvalidTag:
            raise AuthenticationError(f"store key {key!r}: refused a value that does not authenticate with this job's "
                                      "key (written by a non-member, moved from another key or job, or altered)") from None


def scrubbed_env(environ=None) -> dict[str, str]:
    """A copy of the environment (default ``os.environ``) without the job secret's variables:
    for a process you start that is not a member of the job (a reward sandbox, a code executor),
    which would otherwise inherit the secret that :func:`weight_transfer.serve_store` exported."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if k not in (ENV_SECRET, ENV_SECRET_FILE)}


def resolve_secret(secret=None, *, where: str, required: bool = True) -> JobSecret | None:
    """The job secret to use: ``secret`` (a :class:`JobSecret`, hex ``str`` or ``bytes``) when
    given, else :meth:`JobSecret.from_env`. :class:`AuthenticationError` naming ``where`` and
    how to pass one when none is found and ``required``; ValueError / TypeError for a malformed one."""
    if secret is not None:
        if isinstance(secret, JobSecret):
            return secret
        if isinstance(secret, bytes):
            return JobSecret(secret, source=f"{where}: secret=")
        if isinstance(secret, str):
            return JobSecret.parse(secret, where=f"{where}: secret")
        raise TypeError(f"{where}: secret is {type(secret).__name__}; a JobSecret, a hex str or bytes")
    found = JobSecret.from_env()
    if found is None and required:
        raise AuthenticationError(f"{where}: no job secret: {HOW}")
    return found


def insecure_requested(insecure: bool | None = None) -> bool:
    """``insecure`` when given, else whether :data:`ENV_INSECURE` is ``1`` / ``true`` / ``yes``."""
    if insecure is not None:
        return bool(insecure)
    return os.environ.get(ENV_INSECURE, "").strip().lower() in ("1", "true", "yes")


def warn_insecure(what: str) -> None:
    """Print the opt-out's warning (every time a store is served or connected without authentication)."""
    print(f"weight-transfer: WARNING: {what} WITHOUT authentication ({ENV_INSECURE}=1 / insecure=True): any "
          "process that reaches the store's port can read what grants write access to inference memory and "
          "can forge the job's decisions and versions. Use it only on a network you trust (docs/SECURITY.md).",
          file=sys.stderr, flush=True)
