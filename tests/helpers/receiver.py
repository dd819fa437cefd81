"""The spawned receiver process the transport tests write into, and the test's handle on it.

Each transport test module has its own receiver function (``target(conn, *args)``: build the
transport, register its buffers, ``conn.send`` the descriptors once, then answer commands such
as ``("bytes", name)``, ``("reset",)``, ``("exit",)`` until told to exit): it runs no code for
the writes themselves. :class:`Receiver` starts it in a fresh process (``spawn``: no state,
CUDA context or transport inherited from the test process), waits for the descriptors, and
carries the request/answer exchange. Used by tests/transport/test_base.py,
tests/transport/test_cma.py and tests/transport/test_nixl.py.
"""
from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable


class Receiver:
    """A receiver process running ``target(child_conn, *args)`` (a module-level function, as
    ``spawn`` pickles it by name). ``desc``: what it sent first (its region descriptors, by
    name). RuntimeError naming ``what`` when nothing arrives within ``start_timeout`` seconds."""

    def __init__(self, target: Callable, args: tuple = (), *, start_timeout: float = 30.0,
                 what: str = "receiver"):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(start_timeout):
            self.proc.kill()
            self.proc.join(10)
            raise RuntimeError(f"{what} did not start within {start_timeout} s")
        self.desc = self.conn.recv()

    def ask(self, *msg):
        """Send one command tuple and return the receiver's answer."""
        self.conn.send(msg)
        return self.conn.recv()

    def bytes(self, name: str = "buf") -> bytes:
        """Every byte of the receiver's tensor ``name`` (on the host)."""
        return self.ask("bytes", name)

    def stop(self) -> None:
        """Ask the receiver to exit; kill it if it does not within 10 s (or is already gone)."""
        if self.proc.is_alive():
            try:
                self.ask("exit")
            except (EOFError, BrokenPipeError, ConnectionResetError):
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
