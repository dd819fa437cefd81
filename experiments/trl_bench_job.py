"""One TRL async GRPO job of ``weight-transfer bench-trl``, run on each training rank::

    python -m weight_transfer.experiments.trl_bench_job --url URL --model DIR --out DIR --shadow auto
    python -m torch.distributed.run --nproc-per-node 2 -m weight_transfer.experiments.trl_bench_job ...

TRL 1.16's asynchronous GRPO (``OneSidedAsyncGRPOTrainer``, every rank pushing its own shards;
two ranks: accelerate's FSDP2 on the CPU over gloo) trains the checkpoint ``--model`` (a Qwen3
with :func:`~weight_transfer.engines.vllm.trl.cpu.write_tokenizer`'s byte-level tokenizer) for
``--steps`` optimizer steps against the vLLM server ``--url``, rewarded by
:func:`~weight_transfer.engines.vllm.trl.cpu.even_token_reward`, every weight sync through
``OneSidedWeightTransfer(url, shadow=--shadow)``: ``off`` pauses the server for each sync
(``/pause?mode=keep`` ... ``/resume``), ``auto`` never does (shadow targets, go-live between two
engine steps). TRL's GPU-only pieces are shimmed in this process
(:func:`~weight_transfer.engines.vllm.trl.cpu.apply_cpu_shims`).

``--cpus 1,2``: this process (and the rollout worker TRL spawns from rank 0) runs on those CPUs
only (``sched_setaffinity``), off the server's worker CPU.

Writes ``--out/rank{r}.json`` on every rank; rank 0's holds, all times ``time.time()`` seconds:

- ``syncs``: per weight sync ``{"t0", "t1"}`` (the start and end of TRL's ``_sync_weight`` on
  rank 0: its wall window), ``version``, ``push_s`` (the update call, seconds),
  ``update_s`` / ``update_bytes`` (the backend's own account of the update);
  sync 1 is TRL's at train begin, before its rollout worker starts;
- ``step_ends``: the end of every optimizer step (after that step's sync), ``train_begin`` /
  ``train_end``; ``log_history``: TRL's logged metrics per step (``reward``,
  ``perf/weight_sync_s``, ``sample/dropped_stale_total`` when a sample was dropped, ...);
- ``http_calls``: the routes the integration called on the server, in order
  (``OneSidedWeightTransfer.http_calls``: ``pause``, ``reset_prefix_cache``, ``resume``);
- ``params``, ``param_bytes``: the model's (global) parameters and their bytes as trained.

Rank 0 also writes ``--out/final/``: the trained weights after the last step, cast to bf16 as
vLLM serves them, with the checkpoint's config and tokenizer (a checkpoint for a fresh vLLM).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

__all__ = ["main", "build_args"]


def build_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m weight_transfer.experiments.trl_bench_job",
                                description="One TRL async GRPO job of bench-trl (one process per training rank).")
    p.add_argument("--url", required=True, help="the vLLM server (one_sided backend, VLLM_SERVER_DEV_MODE=1)")
    p.add_argument("--model", required=True, help="the checkpoint directory (with its tokenizer)")
    p.add_argument("--out", required=True, help="directory for rank{r}.json and final/")
    p.add_argument("--shadow", default="off", choices=("off", "auto", "copy", "flip"))
    p.add_argument("--steps", type=int, default=4, help="optimizer steps (one weight sync after each)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=8, help="per-device train batch size (samples)")
    p.add_argument("--generations", type=int, default=4, help="completions per prompt")
    p.add_argument("--completion-tokens", type=int, default=32, help="max completion length (tokens)")
    p.add_argument("--cpus", default="", help="comma-separated CPUs this process runs on ('': unchanged)")
    return p.parse_args(argv)


def _pin(cpus: str) -> None:
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


def _save_final(trainer, model_dir: str, out: Path, rank: int) -> tuple[int, int]:
    """Rank 0: the trained weights as vLLM serves them (bf16) in ``out/final`` with the
    checkpoint's config and tokenizer files; every rank takes part in the gathers. Returns
    (parameters, bytes as trained)."""
    import torch
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params

    model = trainer.accelerator.unwrap_model(trainer.model)
    named = list(_iter_vllm_named_params(model))
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    served = {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().to(torch.bfloat16) for n, t in named}
    if rank == 0:
        final = out / "final"
        final.mkdir(exist_ok=True)
        for f in Path(model_dir).iterdir():
            if f.suffix in (".json", ".jinja"):
                shutil.copy(f, final / f.name)
        save_file({n: t.contiguous() for n, t in served.items()}, str(final / "model.safetensors"),
                  metadata={"format": "pt"})
    return len(served), nbytes


def main(argv=None) -> int:
    a = build_args(argv)
    _pin(a.cpus)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from weight_transfer.engines.vllm.trl.cpu import apply_cpu_shims, even_token_reward
    from weight_transfer.engines.vllm.trl.trainer import OneSidedAsyncGRPOTrainer, OneSidedWeightTransfer

    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    apply_cpu_shims(fsdp2=world > 1)
    wt = OneSidedWeightTransfer(a.url, timeout=300, shadow=a.shadow)
    syncs: list[dict] = []
    times: dict = {"step_ends": []}

    class Timed(OneSidedAsyncGRPOTrainer):
        def _sync_weight(self):
            t0 = time.time()
            super()._sync_weight()
            t1 = time.time()
            rec = {"t0": t0, "t1": t1, "version": wt.version, "push_s": wt.seconds[-1] if wt.seconds else None}
            if rank == 0 and wt.last_result is not None:
                rec.update(update_s=wt.last_result.seconds, update_bytes=wt.last_result.bytes)
            syncs.append(rec)

    class Steps(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            times.setdefault("train_begin", time.time())

        def on_step_end(self, args, state, control, **kw):
            times["step_ends"].append(time.time())

    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"count to {i}"}] for i in range(64)]})
    args = AsyncGRPOConfig(
        output_dir=str(out / "trainer"), vllm_server_base_url=a.url, max_steps=a.steps, learning_rate=a.lr,
        per_device_train_batch_size=a.batch, num_generations=a.generations, max_completion_length=a.completion_tokens,
        token_budget=0, seed=0, use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
        save_strategy="no", logging_steps=1, ddp_backend="gloo" if world > 1 else None,
        **({"fsdp": "full_shard", "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"]}}
           if world > 1 else {}))
    trainer = Timed(model=a.model, reward_funcs=even_token_reward, args=args, train_dataset=ds, weight_transfer=wt)
    trainer.add_callback(Steps())  # after TRL's own: a step's end is after its sync
    trainer.train()
    times["train_end"] = time.time()
    n_params, nbytes = _save_final(trainer, a.model, out, rank)
    report = {"rank": rank, "world": world, "shadow": a.shadow, "steps": a.steps, "syncs": syncs, **times,
              "log_history": trainer.state.log_history, "http_calls": list(wt.http_calls), "version": wt.version,
              "params": n_params, "param_bytes": nbytes, "pid": os.getpid(), "cpus": sorted(os.sched_getaffinity(0))}
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1, default=str))
    if world > 1:
        torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
