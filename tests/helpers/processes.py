"""Finding a command's processes by their session: the command is started as a session leader
(``start_new_session=True``), and every process it starts stays in that session, also once
orphaned (nothing in this project calls ``setsid``)."""
import os
import signal
import time
from pathlib import Path


def tagged(sid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every live process of session ``sid`` (the command is started as
    a session leader; its children, vLLM's and orphans reparented to pid 1 stay in its session:
    nothing here calls ``setsid``). Not the environment: vLLM's ``setproctitle`` overwrites the
    memory ``/proc/<pid>/environ`` reads. Zombies are skipped (no memory; their parent reaps them)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] == "Z" or int(fields[3]) != sid:
                continue
            out.append((int(d.name), (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")))
        except (OSError, IndexError, ValueError):
            continue
    return out


def wait_none_left(sid: int, seconds: float = 30.0) -> list:
    deadline = time.monotonic() + seconds
    while (left := tagged(sid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def kill_session(sid: int) -> None:
    """SIGKILL every live process of session ``sid``."""
    for pid, _ in tagged(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
