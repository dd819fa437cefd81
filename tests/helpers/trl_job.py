"""One TRL async GRPO job for tests/engines/vllm/trl/test_trainer.py, run as a script on each training
rank (``python trl_job.py ...`` for one rank, ``torchrun --nproc-per-node 2 trl_job.py ...``
for two: accelerate's FSDP2 on the CPU over gloo).

It trains the checkpoint ``--model`` (a tiny Qwen3 with :func:`weight_transfer.engines.vllm.trl.cpu.write_tokenizer`'s
tokenizer) against the vLLM server ``--url`` for ``--steps`` steps, with
:func:`~weight_transfer.engines.vllm.trl.cpu.even_token_reward`, through
:class:`~weight_transfer.engines.vllm.trl.trainer.OneSidedWeightTransfer` -- ``--trainer trl``: TRL's own
``AsyncGRPOTrainer`` (one rank), ``--trainer one_sided``: ``OneSidedAsyncGRPOTrainer``. TRL's
GPU-only pieces are shimmed (:func:`~weight_transfer.engines.vllm.trl.cpu.apply_cpu_shims`, in
this process only).

Probes, in this process only: the calls of TRL's ``_streaming_iter`` and the tensors it yielded;
per weight sync the bytes ``DTensor.full_tensor()`` returned while the sync ran, this rank's
update report (``gather_bytes``), and on rank 0 vLLM's weight version after the sync, the plan's
``gather_bytes`` and the update's per-rank report. Writes ``--out/rank{r}.json`` and, on rank 0,
``--out/final/`` (the trainer's weights after the last step, cast to bf16 as vLLM serves them,
with the model's config and tokenizer: a checkpoint for a fresh vLLM).

``--probe`` (rank 0): a streaming request generating from before train begin to the end (every
token's arrival time), and after each sync the engine's step clock over it (the server started
with the project's worker extension and the clock installed): the steps that computed tokens
between the sync's start and its go-live (``--hold S`` holds each shadow sync open ``S`` seconds
before it), and the go-lives marked with their versions.

``--outsider FILE`` (case C30): on rank 0, after sync 1 returned and before sync 2 starts (in a
thread, beside the training step; sync 2 waits for it to end), and inside sync 2 (at rank 0's first write: the update started, not yet committed), the outsider
battery of tests/helpers/outsider.py runs against the job's store (training rank 0 serves it)
from a process holding only its ``host:port``, its rows appended to FILE (``--outsider-tcpstore``:
with torch's own TCPStore client inside sync 2); the report's ``outsider`` holds what the
members read after each run (the store's published state; vLLM's weight version between syncs),
each run's seconds and the times sync 2's ``send_weights`` began, the battery began and ``send_weights`` returned.
"""
import argparse
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The checkout (for tests.helpers.outsider: run as a script, only this file's folder is on the path)."""


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--trainer", choices=("trl", "one_sided"), default="trl")
    p.add_argument("--outsider", metavar="FILE", help="C30: run the outsider battery between and inside sync 2")
    p.add_argument("--outsider-tcpstore", action="store_true", help="with torch's TCPStore client inside sync 2")
    p.add_argument("--shadow", default="off", help="OneSidedWeightTransfer(shadow=...)")
    p.add_argument("--hold", type=float, default=0.0,
                   help="shadow: hold every sync open this many seconds before its go-live (rank 0)")
    p.add_argument("--probe", action="store_true",
                   help="rank 0: a streaming request generating the whole job (every token's arrival time)")
    a = p.parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

    import torch
    from datasets import Dataset
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params

    from weight_transfer.engines.vllm.trl.cpu import apply_cpu_shims, even_token_reward
    from weight_transfer.engines.vllm.trl.trainer import OneSidedAsyncGRPOTrainer, OneSidedWeightTransfer

    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    apply_cpu_shims(fsdp2=world > 1)

    streamed = {"calls": 0, "tensors": 0}
    real_stream = AsyncGRPOTrainer._streaming_iter

    def counting_stream(self):
        streamed["calls"] += 1
        for item in real_stream(self):
            streamed["tensors"] += 1
            yield item

    AsyncGRPOTrainer._streaming_iter = counting_stream
    gathered = {"in_sync": False, "bytes": 0, "calls": 0}
    real_full = DTensor.full_tensor

    def counting_full(self, *args, **kwargs):
        t = real_full(self, *args, **kwargs)
        if gathered["in_sync"]:
            gathered["bytes"] += t.numel() * t.element_size()
            gathered["calls"] += 1
        return t

    DTensor.full_tensor = counting_full
    wt = OneSidedWeightTransfer(a.url, timeout=120, shadow=a.shadow)
    go_lives: list[float] = []
    if a.hold and rank == 0:
        from weight_transfer.engines.vllm.backend import recover

        real_go_live = recover.go_live_http

        def held_go_live(base_url, version, **kw):  # the sync held open before its go-live
            time.sleep(a.hold)
            go_lives.append(time.time())
            return real_go_live(base_url, version, **kw)
        recover.go_live_http = held_go_live
    probe = Probe(a.url, a.model) if a.probe and rank == 0 else None
    syncs = []
    attacked = {"seen": [], "push": None, "seconds": []}

    def outsider(stage: str, *, n: int, v: int, tcpstore: bool = False, label: bool = True) -> None:
        """C30: the battery against this job's store from a process without the secret, then what members read."""
        from weight_transfer.control import protocol as control

        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))  # this script's folder is on the path, the checkout is not
        from tests.helpers.outsider import run_outsider

        st, t0 = wt.trainer.store, time.monotonic()
        run_outsider(st.host, st.port, stage, a.outsider, n=n, v=v, tcpstore=tcpstore)
        state, took = control.read_state(st), time.monotonic() - t0
        attacked["seen"].append([stage, state.state, state.version, wt.weight_version() if label else None])
        attacked["seconds"].append(round(took, 3))

    def start_between() -> None:
        """Rank 0, sync 1 returned: the battery in a thread, beside the training step (joined before sync 2)."""
        eng = wt.trainer
        n, v = eng.sender._pushes, eng.version + 1  # the next push's keys

        def run():
            try:
                outsider("between", n=n, v=v)
            except BaseException as e:  # raised in the main thread at sync 2
                attacked["error"] = e

        attacked["thread"] = threading.Thread(target=run, name="c30-outsider", daemon=True)
        attacked["thread"].start()

    def attack_next_sync() -> None:
        """Rank 0, sync 2 about to start: the battery between syncs ended; it runs again inside sync 2, at this
        rank's first write."""
        attacked.pop("thread").join()
        if "error" in attacked:
            raise attacked.pop("error")
        eng = wt.trainer
        tx = eng.sender.transport
        real_write, real_send, fired, lock = tx.write, eng.send_weights, [], threading.Lock()

        def attacked_write(ops):
            with lock:  # the first write waits for the battery (other writers too)
                if not fired:
                    fired.append(time.monotonic())
                    outsider("write", n=eng.sender._pushes - 1, v=eng.version + 1, tcpstore=a.outsider_tcpstore,
                             label=False)  # vLLM's HTTP server is inside the update: read the store only
            return real_write(ops)

        def attacked_send(version=None):
            t = time.monotonic()
            try:
                return real_send(version)
            finally:
                tx.write = real_write
                del eng.send_weights  # the class's method again
                attacked["push"] = [t, fired[0] if fired else None, time.monotonic()]

        tx.write, eng.send_weights = attacked_write, attacked_send

    base = OneSidedAsyncGRPOTrainer if a.trainer == "one_sided" else AsyncGRPOTrainer

    class Probed(base):
        def _sync_weight(self):
            if a.outsider and rank == 0 and len(syncs) == 1:
                attack_next_sync()
            t_begin = time.time()
            b0, c0 = gathered["bytes"], gathered["calls"]
            gathered["in_sync"] = True
            try:
                super()._sync_weight()
            finally:
                gathered["in_sync"] = False
            rec = {"full_tensor_bytes": gathered["bytes"] - b0, "full_tensor_calls": gathered["calls"] - c0,
                   "version": wt.version, "seconds": wt.seconds[-1] if wt.seconds else None,
                   "gather_bytes": getattr(wt.last_stats, "gather_bytes", None),
                   "bytes_sent": getattr(wt.last_stats, "bytes_sent", None), "t_begin": t_begin, "t_end": time.time(),
                   "go_live": go_lives[-1] if go_lives and go_lives[-1] > t_begin else None}
            if rank == 0 and a.probe:  # the engine's step clock over this sync, read now (it keeps the newest steps)
                import requests

                clock = requests.post(f"{a.url}/collective_rpc", json={"method": "wt_steps", "args": [str(t_begin)]},
                                      timeout=120).json()["results"][0]
                end = rec["go_live"] or rec["t_end"]
                rec["steps_before_go_live"] = sum(1 for x in clock["steps"] if t_begin <= x[0] and x[1] <= end
                                                  and x[2] > 0)
                rec["go_live_marks"] = [m[3].get("version") for m in clock["marks"] if m[0] == "go_live"]
            if rank == 0:
                rec["vllm_version"] = wt.weight_version()
                rec["plan_gather_bytes"] = wt.schedule.gather_bytes
                rec["report_gather_bytes"] = {str(r): s.gather_bytes for r, s in wt.last_result.stats.items()}
                rec["update_bytes"], rec["update_seconds"] = wt.last_result.bytes, wt.last_result.seconds
            syncs.append(rec)
            if a.outsider and rank == 0 and len(syncs) == 1:
                start_between()

    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"count to {i}"}] for i in range(16)]})
    args = AsyncGRPOConfig(
        output_dir=str(out / "trainer"), vllm_server_base_url=a.url, max_steps=a.steps, learning_rate=a.lr,
        per_device_train_batch_size=8, num_generations=4, max_completion_length=16, token_budget=0, seed=0,
        use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none", save_strategy="no",
        logging_steps=1, ddp_backend="gloo" if world > 1 else None,
        **({"fsdp": "full_shard", "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"]}}
           if world > 1 else {}))
    trainer = Probed(model=a.model, reward_funcs=even_token_reward, args=args, train_dataset=ds, weight_transfer=wt)
    t0 = time.monotonic()
    if probe is not None:
        probe.start()
    try:
        trainer.train()
    finally:
        if probe is not None:
            probe.stop()
    train_seconds = time.monotonic() - t0

    model = trainer.accelerator.unwrap_model(trainer.model)
    dtensors = sum(isinstance(t, DTensor) for _, t in _iter_vllm_named_params(model))
    param_bytes = sum(t.numel() * t.element_size() for _, t in _iter_vllm_named_params(model))  # global sizes
    served = {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().to(torch.bfloat16)
              for n, t in _iter_vllm_named_params(model)}
    if rank == 0:
        final = out / "final"
        final.mkdir(exist_ok=True)
        for f in Path(a.model).iterdir():
            if f.suffix in (".json", ".jinja"):
                shutil.copy(f, final / f.name)
        save_file({n: t.contiguous() for n, t in served.items()}, str(final / "model.safetensors"),
                  metadata={"format": "pt"})
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    report = {"rank": rank, "world": world, "trainer": a.trainer, "syncs": syncs, "streamed": streamed,
              "rewards": rewards, "version": wt.version, "dtensors": dtensors, "train_seconds": train_seconds,
              "params": len(served), "param_bytes": param_bytes, "outsider": attacked,
              "http_calls": wt.http_calls, "probe": None if probe is None else {"tokens": probe.tokens,
                                                                               "errors": probe.errors}}
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    if world > 1:
        torch.distributed.barrier()


class Probe:
    """A streaming greedy request after the other against the server (rank 0), from before train
    begin to the job's end: every token's arrival time (``time.time()`` seconds) in
    :attr:`tokens`, failures in :attr:`errors`."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model, self.tokens, self.errors = url, model, [], []
        self._stop = threading.Event()
        self._th = threading.Thread(target=self._run, name="probe", daemon=True)

    def start(self) -> None:
        self._th.start()

    def stop(self) -> None:
        self._stop.set()
        self._th.join(120)

    def _run(self) -> None:
        import requests

        while not self._stop.is_set():
            try:
                with requests.post(f"{self.url}/v1/completions", stream=True, timeout=300, json={
                        "model": self.model, "prompt": [5, 6, 7], "max_tokens": 400, "temperature": 0.0,
                        "ignore_eos": True, "stream": True}) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():
                        if line.startswith(b"data: {"):
                            self.tokens.append(time.time())
                        if self._stop.is_set():
                            break
            except Exception as e:  # the test fails on it
                self.errors.append(repr(e))
                time.sleep(0.5)


if __name__ == "__main__":
    main()
