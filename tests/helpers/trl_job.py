"""One TRL async GRPO job for tests/engines/vllm/test_trl.py, run as a script on each training
rank (``python trl_job.py ...`` for one rank, ``torchrun --nproc-per-node 2 trl_job.py ...``
for two: accelerate's FSDP2 on the CPU over gloo).

It trains the checkpoint ``--model`` (a tiny Qwen3 with :func:`weight_transfer.engines.vllm.trl_cpu.write_tokenizer`'s
tokenizer) against the vLLM server ``--url`` for ``--steps`` steps, with
:func:`~weight_transfer.engines.vllm.trl_cpu.even_token_reward`, through
:class:`~weight_transfer.engines.vllm.trl.OneSidedWeightTransfer` -- ``--trainer trl``: TRL's own
``AsyncGRPOTrainer`` (one rank), ``--trainer one_sided``: ``OneSidedAsyncGRPOTrainer``. TRL's
GPU-only pieces are shimmed (:func:`~weight_transfer.engines.vllm.trl_cpu.apply_cpu_shims`, in
this process only).

Probes, in this process only: the calls of TRL's ``_streaming_iter`` and the tensors it yielded;
per weight sync the bytes ``DTensor.full_tensor()`` returned while the sync ran, this rank's
update report (``gather_bytes``), and on rank 0 vLLM's weight version after the sync, the plan's
``gather_bytes`` and the update's per-rank report. Writes ``--out/rank{r}.json`` and, on rank 0,
``--out/final/`` (the trainer's weights after the last step, cast to bf16 as vLLM serves them,
with the model's config and tokenizer: a checkpoint for a fresh vLLM).
"""
import argparse
import json
import os
import shutil
import time
from pathlib import Path


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--trainer", choices=("trl", "one_sided"), default="trl")
    a = p.parse_args(argv)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

    import torch
    from datasets import Dataset
    from safetensors.torch import save_file
    from torch.distributed.tensor import DTensor
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params

    from weight_transfer.engines.vllm.trl import OneSidedAsyncGRPOTrainer, OneSidedWeightTransfer
    from weight_transfer.engines.vllm.trl_cpu import apply_cpu_shims, even_token_reward

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
    wt = OneSidedWeightTransfer(a.url, timeout=120)
    syncs = []
    base = OneSidedAsyncGRPOTrainer if a.trainer == "one_sided" else AsyncGRPOTrainer

    class Probed(base):
        def _sync_weight(self):
            b0, c0 = gathered["bytes"], gathered["calls"]
            gathered["in_sync"] = True
            try:
                super()._sync_weight()
            finally:
                gathered["in_sync"] = False
            rec = {"full_tensor_bytes": gathered["bytes"] - b0, "full_tensor_calls": gathered["calls"] - c0,
                   "version": wt.version, "seconds": wt.seconds[-1] if wt.seconds else None,
                   "gather_bytes": getattr(wt.last_stats, "gather_bytes", None),
                   "bytes_sent": getattr(wt.last_stats, "bytes_sent", None)}
            if rank == 0:
                rec["vllm_version"] = wt.weight_version()
                rec["plan_gather_bytes"] = wt.schedule.gather_bytes
                rec["report_gather_bytes"] = {str(r): s.gather_bytes for r, s in wt.last_result.stats.items()}
                rec["update_bytes"], rec["update_seconds"] = wt.last_result.bytes, wt.last_result.seconds
            syncs.append(rec)

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
    trainer.train()
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
              "params": len(served), "param_bytes": param_bytes}
    (out / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    if world > 1:
        torch.distributed.barrier()


if __name__ == "__main__":
    main()
