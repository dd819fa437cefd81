"""One training run against a vLLM server through
:class:`~weight_transfer.engines.vllm.trl.trainer.OneSidedWeightTransfer` without TRL's trainer loop
(case C32, tests/engines/vllm/trl/test_trainer.py): run as a script, one training rank.

It binds the checkpoint ``--model``'s tensors (``model.safetensors``, plain tensors: the
source), then per sync ``v`` in ``--versions`` changes every tensor in place (a seeded
perturbation: the bytes of version ``v`` are a function of ``v``), and does what TRL's sync does
(``pause``, ``push(v)``, ``resume``) with ``--shadow`` and end-to-end fingerprints of every
byte (``verify="full"``). After each sync it reads vLLM's weight version. ``--die-at V``: at
sync ``V`` the process kills itself (SIGKILL) at its first one-sided write -- the server paused
(without shadow targets), its update session open, the store gone. Writes ``--out/report.json``
(``syncs``: version, label, verify, seconds; ``http_calls``: the routes called) and
``--out/final/`` (the last synced weights, a checkpoint for a fresh vLLM) unless it died;
``--linger S``: after the last sync (``--out/synced`` written) it stays attached ``S`` seconds
before ``destroy()`` (another run meanwhile finds the server taken).
"""
import argparse
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path


def perturb(params: dict, v: int) -> None:
    """Version ``v``'s bytes: every tensor ``+= 0.01 * N(0, 1)`` seeded by ``v`` (in place)."""
    import torch

    g = torch.Generator().manual_seed(1000 + v)
    with torch.no_grad():
        for name in sorted(params):
            t = params[name]
            t.add_(0.01 * torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype))


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--versions", default="1,2", help="comma-separated versions to sync")
    p.add_argument("--shadow", default="off")
    p.add_argument("--die-at", type=int, default=None)
    p.add_argument("--linger", type=float, default=0.0, help="seconds to stay attached after the last sync")
    a = p.parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    from safetensors.torch import load_file, save_file

    from weight_transfer.engines.vllm.trl.trainer import OneSidedWeightTransfer

    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    params = load_file(str(Path(a.model) / "model.safetensors"))
    wt = OneSidedWeightTransfer(a.url, shadow=a.shadow, verify="full", timeout=60, http_timeout=120,
                                server_timeout=60).bind(params)
    syncs = []
    for v in [int(x) for x in a.versions.split(",")]:
        perturb(params, v)
        if v == a.die_at:
            die_at_first_write(wt)
        t0 = time.monotonic()
        wt.pause()
        wt.push(v)
        wt.resume()
        r = wt.last_result
        syncs.append({"version": v, "label": wt.weight_version(), "seconds": time.monotonic() - t0,
                      "verify": getattr(r, "verify", None), "verified_bytes": getattr(r, "verified_bytes", None)})
    (out / "synced").write_text(json.dumps(syncs))  # the last sync returned: what lingers is attached
    time.sleep(a.linger)
    wt.destroy()
    final = out / "final"
    final.mkdir(exist_ok=True)
    for f in Path(a.model).iterdir():
        if f.suffix in (".json", ".jinja"):
            shutil.copy(f, final / f.name)
    save_file({n: t.contiguous() for n, t in params.items()}, str(final / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "report.json").write_text(json.dumps({"syncs": syncs, "http_calls": wt.http_calls}, indent=1))


def die_at_first_write(wt) -> None:
    """SIGKILL this process at its first one-sided write of the next push (the update begun)."""
    real_send = wt.push

    def push(version=None):
        if wt.trainer is None:
            wt._setup()
        tx = wt.trainer.sender.transport
        real_write = tx.write

        def write(ops):
            real_write(ops)  # one batch lands: the live bytes (without shadow targets) are a mix now
            print(f"sync_job: killed at the first write of version {version}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        tx.write = write
        return real_send(version)
    wt.push = push


if __name__ == "__main__":
    main()
