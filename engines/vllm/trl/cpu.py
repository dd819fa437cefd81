"""Opt-in pieces for running TRL 1.16's async GRPO on a CPU-only host with the project's tiny,
tokenizer-less checkpoints (the tests and ``examples/trl_grpo.py``). **Nothing here is applied
on import**: :func:`cpu_shims` patches TRL only inside its ``with`` block (or from
:func:`apply_cpu_shims` until the returned undo is called), in the process that calls it.

- :func:`cpu_shims`: TRL's two GPU-only pieces that an ``AsyncGRPOTrainer`` reaches on a CPU
  (TRL 1.16.0):

  1. its packed "tree" attention (``trl.experimental.async_grpo.packing.tree_attention``, the
     attention implementation TRL registers and loads every model with) calls
     ``flash_attn_varlen_func`` of the ``kernels-community/flash-attn3`` hub kernel, which is
     CUDA-only (and downloaded at the first forward). The shim makes ``packing._flash_attn()``
     return :class:`VarlenSDPA`: the same call (packed ``(tokens, heads, dim)`` query/key/value,
     ``cu_seqlens``, causal aligned bottom-right as FlashAttention does when a segment's query is
     the tail of its key path, GQA, sliding window), computed per segment with
     ``torch.nn.functional.scaled_dot_product_attention``. Slow for long rows, exact enough
     for tests (float32).
  2. its MFU helper ``get_peak_flops_per_device`` (called in ``AsyncGRPOTrainer.__init__``)
     calls ``torch.cuda.get_device_name``, which raises on a CPU-only torch. The shim answers
     None for a non-CUDA device (TRL then logs no MFU, as for an unknown GPU).

  And, with ``fsdp2=True``, one of accelerate's (1.16.0): several CPU processes are
  ``DistributedType.MULTI_CPU`` and accelerate turns only GPU-like multi-device types into FSDP,
  so ``AsyncGRPOConfig(use_cpu=True, fsdp="full_shard", fsdp_config={"version": 2})`` silently
  trains with DDP (full replicas, no DTensor). The shim wraps ``Trainer.create_accelerator_and_postprocess``:
  when the arguments ask for FSDP and the state came out ``MULTI_CPU``, the state becomes
  ``FSDP`` with the plugin transformers built from them, so accelerate's own
  ``fsdp2_prepare_model`` shards the model (``fully_shard`` on a CPU mesh over the gloo group),
  as on GPUs. Nothing else of the loop changes.

- :func:`write_tokenizer`: a byte-level tokenizer with TRL's copy of the Qwen3 chat template
  (``trl.chat_template_utils.qwen3_chat_template``, so TRL's response parser recognizes it) and
  the vocabulary padded to the model's with ``<extra_i>`` tokens (every id a model may sample
  decodes), written into a checkpoint directory for the trainer, its rollout worker and the
  vLLM server to load (the project's test checkpoints have none, and this host has no hub).
- :func:`even_token_reward`: a toy reward (the fraction of a completion's token ids that are
  even), module-level so that TRL's spawned rollout worker can unpickle it.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

__all__ = ["VarlenSDPA", "cpu_shims", "apply_cpu_shims", "write_tokenizer", "even_token_reward"]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>",
                  "</tool_call>", "<tool_response>", "</tool_response>")
"""Qwen3's chat-template tokens (``<|endoftext|>`` pads, ``<|im_end|>`` ends a turn: the EOS)."""


class VarlenSDPA:
    """``flash_attn_varlen_func`` (FlashAttention's packed-sequence call, the subset TRL's tree
    attention uses) in plain torch, for CPUs (see the module docstring)."""

    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, **kwargs):
        """``q``: ``(total_q, heads, dim)``; ``k``, ``v``: ``(total_k, kv_heads, dim)``;
        segment ``s`` is ``q[cu_q[s]:cu_q[s+1]]`` against ``k[cu_k[s]:cu_k[s+1]]``. Causal: query
        ``i`` of a segment sees key ``j`` when ``j <= i + (len_k - len_q)``; ``window_size =
        (left, right)`` (-1: unbounded) limits it further. NotImplementedError for ``softcap`` or
        other options (dropout, ALiBi)."""
        if softcap:
            raise NotImplementedError("VarlenSDPA: softcap")
        extra = {k_: v_ for k_, v_ in kwargs.items() if v_ not in (None, 0, 0.0, False)}
        if extra:
            raise NotImplementedError(f"VarlenSDPA: {sorted(extra)}")
        left, right = window_size
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        outs = []
        for s in range(len(cq) - 1):
            qs = q[cq[s]:cq[s + 1]].transpose(0, 1)
            ks, vs = (x[ck[s]:ck[s + 1]].transpose(0, 1) for x in (k, v))
            lq, lk = qs.shape[1], ks.shape[1]
            i = torch.arange(lq).unsqueeze(1) + (lk - lq)  # the query's position among the keys
            j = torch.arange(lk).unsqueeze(0)
            allow = torch.ones(lq, lk, dtype=torch.bool)
            if causal:
                allow &= j <= i
            if left >= 0:
                allow &= j >= i - left
            if right >= 0 and not causal:
                allow &= j <= i + right
            o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=allow, scale=softmax_scale,
                                                                 enable_gqa=ks.shape[0] != qs.shape[0])
            outs.append(o.transpose(0, 1))
        return torch.cat(outs, 0) if outs else q.new_empty(q.shape)


def apply_cpu_shims(*, fsdp2: bool = False) -> Callable[[], None]:
    """Patch TRL 1.16's two GPU-only pieces (module docstring) in this process, and with
    ``fsdp2=True`` let accelerate shard with FSDP2 on CPU processes; returns the undo.
    Idempotent while applied (a second call patches nothing more; its undo does nothing)."""
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    if getattr(packing._flash_attn, "_wt_cpu_shim", False):
        return lambda: None
    old_attn, old_peak = packing._flash_attn, async_grpo_trainer.get_peak_flops_per_device
    undo_fsdp = _fsdp2_on_cpu() if fsdp2 else (lambda: None)

    def flash_attn():
        return VarlenSDPA

    def peak_flops(accelerator, dtype):
        return old_peak(accelerator, dtype) if accelerator.device.type == "cuda" else None

    flash_attn._wt_cpu_shim = True
    packing._flash_attn, async_grpo_trainer.get_peak_flops_per_device = flash_attn, peak_flops

    def undo() -> None:
        packing._flash_attn, async_grpo_trainer.get_peak_flops_per_device = old_attn, old_peak
        undo_fsdp()

    return undo


def _fsdp2_on_cpu() -> Callable[[], None]:
    """The accelerate shim of the module docstring; returns its undo."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from transformers import Trainer

    old = Trainer.create_accelerator_and_postprocess

    def create_accelerator_and_postprocess(self) -> None:
        old(self)
        state = self.accelerator.state
        if self.args.fsdp_plugin_args is not None and state.distributed_type == DistributedType.MULTI_CPU:
            state.distributed_type = DistributedType.FSDP
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            self.is_fsdp_enabled = True

    Trainer.create_accelerator_and_postprocess = create_accelerator_and_postprocess

    def undo() -> None:
        Trainer.create_accelerator_and_postprocess = old

    return undo


@contextlib.contextmanager
def cpu_shims(*, fsdp2: bool = False) -> Iterator[None]:
    """``with cpu_shims(): trainer = AsyncGRPOTrainer(...); trainer.train()``: the shims of
    :func:`apply_cpu_shims` inside the block, removed after it."""
    undo = apply_cpu_shims(fsdp2=fsdp2)
    try:
        yield
    finally:
        undo()


def write_tokenizer(path: str | Path, vocab_size: int) -> str:
    """Write a byte-level tokenizer (256 byte tokens, :data:`SPECIAL_TOKENS`, ``<extra_i>`` up to
    ``vocab_size`` ids) with TRL's Qwen3 chat template into ``path`` (a checkpoint directory);
    returns ``path``. EOS ``<|im_end|>``, pad ``<|endoftext|>``. ValueError when ``vocab_size``
    is too small for the bytes and the specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import qwen3_chat_template

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(f"write_tokenizer: vocab_size={vocab_size} < {len(alphabet) + len(SPECIAL_TOKENS)} "
                         "(256 bytes and the chat template's special tokens)")
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=[t for t in SPECIAL_TOKENS
                                                              if t not in ("<|im_end|>", "<|endoftext|>")])
    fast.add_tokens([f"<extra_{i}>" for i in range(vocab_size - len(fast))])
    fast.chat_template = qwen3_chat_template
    fast.save_pretrained(str(path))
    return str(path)


def even_token_reward(completion_ids: list[list[int]], **kwargs) -> list[float]:
    """Per completion, the fraction of its token ids that are even (0.0 for an empty one): a
    reward a tiny random model can learn in a few GRPO steps (it only has to shift probability
    mass to half of its vocabulary)."""
    return [sum(1 for t in ids if t % 2 == 0) / len(ids) if ids else 0.0 for ids in completion_ids]
