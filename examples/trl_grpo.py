"""TRL's async GRPO (TRL 1.16.0) training a tiny Qwen3 whose rollouts an unmodified vLLM server
generates, every weight sync written one-sidedly by the ``one_sided`` backend
(weight_transfer.engines.vllm.trl.trainer; docs/VLLM.md, "TRL's async GRPO").

    python examples/trl_grpo.py --init /tmp/tiny-qwen3          # the checkpoint + a tokenizer
    VLLM_SERVER_DEV_MODE=1 WT_VLLM_HIDE_AMX=1 python -m vllm.entrypoints.openai.api_server \\
        --model /tmp/tiny-qwen3 --weight-transfer-config '{"backend": "one_sided"}' --enforce-eager \\
        --dtype bfloat16 --max-model-len 1024 --enable-prefix-caching --no-enable-chunked-prefill --port 8000 &
    python examples/trl_grpo.py --url http://127.0.0.1:8000 --model /tmp/tiny-qwen3 [--steps 15]
    torchrun --nproc-per-node 2 examples/trl_grpo.py --url ... --model ...      # 2 FSDP2 ranks

The reward is a toy: the fraction of even token ids in a completion (a random model earns 0.5).
Prints, per step, the step's mean reward, vLLM's weight version after the step's sync and the
sync's update seconds. On a CPU-only host TRL's GPU-only pieces are shimmed
(weight_transfer.engines.vllm.trl.cpu: applied here, explicitly).
"""
import argparse, os, torch
from transformers import TrainerCallback

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--init", metavar="DIR", help="write the tiny Qwen3 (synthetic step-0 weights) and a tokenizer to DIR, exit")
p.add_argument("--url", default="http://127.0.0.1:8000", help="the vLLM server")
p.add_argument("--model", help="the checkpoint directory the server serves")
p.add_argument("--steps", type=int, default=15)
p.add_argument("--lr", type=float, default=2e-2)
p.add_argument("--out", default="/tmp/trl_grpo", help="TRL's output_dir")


class Report(TrainerCallback):  # rank 0: what each step logged, after its weight sync
    def __init__(self, wt): self.wt, self.push, self.transfer = wt, [], []
    def on_log(self, args, state, control, logs=None, **kw):
        if state.is_world_process_zero and "reward" in (logs or {}):
            self.push.append(self.wt.seconds[-1]); self.transfer.append(self.wt.last_result.seconds)
            print(f"step {state.global_step}: reward {logs['reward']:.3f}, vLLM weight version "
                  f"{self.wt.weight_version()}, update {self.push[-1]:.3f} s (transfer {self.transfer[-1]:.3f} s)",
                  flush=True)


def main():
    a = p.parse_args()
    if a.init:
        from weight_transfer.engines.vllm import write_checkpoint
        from weight_transfer.engines.vllm.trl.cpu import write_tokenizer
        from weight_transfer.testing.catalog import load_config
        from weight_transfer.testing.tiny import TINY_QWEN3
        cfg = load_config(TINY_QWEN3[0], **TINY_QWEN3[1])
        print(write_tokenizer(write_checkpoint(cfg, a.init, step=0, seed=0), cfg.vocab_size)); return
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig
    from weight_transfer.engines.vllm.trl.trainer import OneSidedAsyncGRPOTrainer, OneSidedWeightTransfer
    from weight_transfer.engines.vllm.trl.cpu import apply_cpu_shims, even_token_reward
    cpu, world = not torch.cuda.is_available(), int(os.environ.get("WORLD_SIZE", 1))
    if cpu:
        torch.set_num_threads(1); apply_cpu_shims(fsdp2=True)   # opt-in: TRL's GPU-only pieces on a CPU
    fsdp = {"fsdp": "full_shard", "fsdp_config": {"version": 2}} if world > 1 else {}
    args = AsyncGRPOConfig(output_dir=a.out, vllm_server_base_url=a.url, max_steps=a.steps, learning_rate=a.lr,
                           per_device_train_batch_size=32, num_generations=8, max_completion_length=16, token_budget=0,
                           use_cpu=cpu, bf16=False, gradient_checkpointing=False, report_to="none", save_strategy="no",
                           logging_steps=1, disable_tqdm=True, seed=0, max_staleness=1, **fsdp)
    prompts = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"count to {i}"}] for i in range(16)]})
    wt = OneSidedWeightTransfer(a.url)
    trainer = OneSidedAsyncGRPOTrainer(model=a.model, reward_funcs=even_token_reward, args=args,
                                       train_dataset=prompts, weight_transfer=wt)
    trainer.add_callback(report := Report(wt))
    trainer.train()
    if trainer.accelerator.is_main_process:  # update: the push with vLLM's HTTP calls and the prefix-cache reset;
        push, transfer = sorted(report.push), sorted(report.transfer)  # transfer: "go" to the last write and commit
        print(f"{len(push)} step updates of {wt.last_result.bytes / 1e6:.1f} MB: median {push[len(push) // 2]:.3f} s "
              f"(transfer {transfer[len(push) // 2]:.3f} s)")


if __name__ == "__main__":   # TRL's rollout worker is a spawned process: it re-imports this file
    main()
