"""The pieces of ``examples/rl_loop.py`` (an RL loop on an unmodified vLLM, updated one-sidedly
after every step) and the ``weight-transfer rl`` subcommand that runs it.

    weight-transfer rl                                  # 30 steps at lr 5e-4: the reward rises
    weight-transfer rl --lr 1e-5 --steps 20 --changes   # what one step changes (docs/DELTA.md)
    python examples/rl_loop.py --steps 3                # the same program, read top to bottom

The task (:class:`ParityTask`): a prompt is two tokens ``a, b`` drawn from ``values`` token
ids; the reward is 1 when the first generated token's parity equals the parity of ``a + b``
(a random policy earns 0.5, and the answer depends on both prompt tokens). Every step samples
``group`` answers per prompt of all ``values**2`` prompts with vLLM (temperature 1, the sampled
token's logprob from vLLM: ``raw_logprobs`` = the logprobs the rollout policy sampled from),
normalizes rewards within each group (:func:`group_advantages`), and takes one AdamW step on
the PPO-clipped policy gradient with the importance ratio of the trainer's fp32 logprob over
vLLM's bf16 rollout logprob (:func:`clipped_pg_loss`).

Verification (:class:`OracleCheck`): the oracle is a second, plain vLLM in training rank 1's
process, loaded through vLLM's own in-place reload path (``wt_reload_begin`` /
``wt_load_weights`` / ``wt_reload_finish``: ``model.load_weights`` and the same
post-processing as a fresh load) with the same step's gathered bf16 weights; after every push
every addressable runtime tensor of the live engine (the direct targets and packed copies of
its runtime layout) must equal the oracle's byte for byte (digests exchanged over the training
ranks' gloo group), and its staging tensors what ``load_weights`` makes of those weights: every
byte the push wrote. Chosen over a fresh engine per step because it is independent of the
one-sided path (vLLM's own loader and post-processing) and costs one engine start, not one per
step; greedy tokens and logprobs are compared too and recorded (see :class:`OracleCheck`); at
the end a fresh vLLM from the final checkpoint (:func:`final_check`) gets the same comparison.
"""
from __future__ import annotations

import contextlib
import csv
import hashlib
import math
import sys
import time
from pathlib import Path

from .collectives import _CheckMsg, all_gather, broadcast, broadcast_rollout
from .paths import project_dir
from .rl_options import CHANGES_CSV, RESULTS, RLOptions, options_from_argv, transfer_overrides  # noqa: F401  (re-exported)

__all__ = ["RLOptions", "ParityTask", "group_advantages", "clipped_pg_loss", "rollout", "served_weights",
           "OracleCheck", "StepLog", "change_rows", "save_served", "magnitude_rows", "save_changes", "final_check", "broadcast", "broadcast_rollout", "options_from_argv", "main"]


@contextlib.contextmanager
def push_mode(executor, mode: str | None):
    """Around one push of ``--delta``: ``"full"`` sets the executor's delta state aside (the
    plain path: whole outputs, no comparison, the shadow untouched -- it already holds these
    weights when the delta push of the same weights went first, and the next delta compares
    against the last weights it wrote either way), ``"delta"`` / None leave it. A full push that
    fails makes the next delta push full (C26)."""
    if mode != "full" or executor is None or executor.delta is None:
        yield
        return
    saved, executor.delta = executor.delta, None
    try:
        yield
    except BaseException:
        saved.invalidate("a full push of --delta failed")
        raise
    finally:
        executor.delta = saved


DELTA_CSV = "rl_delta.csv"
"""--delta's rows (one per push), in ``out_dir``; rows of other learning rates are kept."""
PHASES = ("delta_compare_s", "delta_fused_s", "delta_pack_s", "delta_wire_s", "delta_apply_s")
"""Per-phase delta seconds of a push row (the slowest rank's; apply: the slowest receiver's)."""
MODE_NAMES = ("full", "scattered", "packed", "unchanged")
DELTA_COLUMNS = ["lr", "step", "mode", "first", "version", "seconds", "write_seconds", "bytes", "full_bytes",
                 "n_writes", "compare_s", "whole_outputs", *PHASES, "commit_s", "delta_patch_s", *(f"n_{m}" for m in MODE_NAMES),
                 *(f"bytes_{m}" for m in MODE_NAMES), *(f"out_bytes_{m}" for m in MODE_NAMES), "delta", "verified",
                 "timestamp"]
TENSOR_CSV = "rl_delta_tensors.csv"
"""--delta's per-tensor rows (one per write of every delta push): the cost model's mode per tensor."""
TENSOR_COLUMNS = ["lr", "step", "version", "rank", "tensor", "kind", "mode", "out_bytes", "written", "runs"]


def commit_stats(store, version: int, ranks: int = 64) -> list[dict]:
    """The inference ranks' commit reports of ``version`` (``step/{v}/committed/{i}`` stats)."""
    from weight_transfer.control import protocol as control

    out = []
    for i in range(ranks):
        k = f"step/{version}/committed/{i}"
        if not store.check([k]):
            break
        out.append((control.get(store, k) or {}).get("stats") or {})
    return out


def push_row(o: RLOptions, step: int, mode: str, first: bool, u, res: dict, commits: list | None = None) -> dict:
    """One --delta row from rank 0's :class:`weight_transfer.api.UpdateResult` ``u`` and the
    oracle check ``res``: ``seconds`` (go -> commit done), ``write_seconds`` (go -> the last
    training rank's writes done), ``bytes`` written, ``full_bytes`` (a full update's),
    ``compare_s`` (the slowest rank's comparison + runs + shadow seconds), ``whole_outputs``,
    the per-phase seconds (:data:`PHASES`; ``commits``: the workers' commit stats, for apply),
    ``commit_s`` (the slowest worker's re-run of vLLM's post-processing of the staged layers),
    ``delta_patch_s`` (the slowest worker's staging copies in that commit that applied deferred
    format-3 records on the way: the copies the commit makes anyway plus the scatter),
    and per mode the writes, bytes written and output bytes (``n_*``, ``bytes_*``,
    ``out_bytes_*``); ``tensors``: the per-tensor rows (:data:`TENSOR_COLUMNS`)."""
    st = list(u.stats.values())
    modes = {m: [0, 0, 0] for m in MODE_NAMES}
    tensors = []
    for s in st:
        for m, kinds in (getattr(s, "delta_modes", None) or {}).items():
            for v in kinds.values():
                modes.setdefault(m, [0, 0, 0])
                modes[m] = [a + b for a, b in zip(modes[m], v)]
        tensors += [{"lr": o.lr, "step": step, "version": u.version, "rank": s.rank, "tensor": t[0], "kind": t[1],
                     "mode": t[2], "out_bytes": t[3], "written": t[4], "runs": t[5]}
                    for t in (getattr(s, "delta_tensors", None) or [])]
    phases = {p: max((getattr(s, p, 0.0) for s in st), default=0.0) for p in PHASES}
    phases["delta_apply_s"] = max([c.get("delta_apply_s", 0.0) for c in commits or []], default=0.0)
    phases["commit_s"] = max([c.get("seconds", 0.0) for c in commits or []], default=0.0)
    phases["delta_patch_s"] = max([c.get("delta_patch_s", 0.0) for c in commits or []], default=0.0)
    return {**phases, **{f"n_{m}": v[0] for m, v in modes.items()}, **{f"bytes_{m}": v[1] for m, v in modes.items()},
            **{f"out_bytes_{m}": v[2] for m, v in modes.items()}, "tensors": tensors if mode == "delta" else [],
            "lr": o.lr, "step": step, "mode": mode, "first": first, "version": u.version, "seconds": u.seconds,
            "write_seconds": u.write_seconds, "bytes": u.bytes,
            "full_bytes": sum(getattr(s, "full_bytes", 0) for s in st), "n_writes": u.n_writes,
            "compare_s": max((getattr(s, "delta_compare_s", 0.0) for s in st), default=0.0),
            "whole_outputs": sum(getattr(s, "delta_whole", 0) for s in st),
            "delta": ";".join(sorted({getattr(s, "delta", "") for s in st})) if mode == "delta" else "",
            "verified": res.get("ok"), "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S")}


def save_served(o: RLOptions, step: int, served: dict) -> str | None:
    """``--save-steps``: write ``served`` (name -> bf16 tensor, :func:`served_weights`) as saved
    step ``step`` (0: the initial weights) into ``o.save_steps`` with the run's options in its
    manifest; rank 0 calls it. Returns the file's path, None without ``--save-steps``."""
    if not o.save_steps:
        return None
    from weight_transfer.testing.replay import save_step

    return save_step(o.save_steps, step, served, info={
        "model": o.model, "layers": o.layers, "vocab": o.vocab, "lr": o.lr, "seed": o.seed,
        "weight_decay": o.weight_decay, "group": o.group, "values": o.values, "run": o.name,
        "overrides": f"num_hidden_layers={o.layers},vocab_size={o.vocab}"})


def save_pushes(o: RLOptions, rows: list[dict]) -> Path:
    """Write ``rows`` into out_dir/rl_delta.csv (replacing that lr's earlier rows) and print the
    full-vs-delta table of every lr in the file."""
    path = Path(o.out_dir) / DELTA_CSV
    keep = []
    if path.exists():
        with open(path, newline="") as f:
            keep = [r for r in csv.DictReader(f) if float(r["lr"]) != o.lr]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, DELTA_COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(keep + rows)
    tpath, tkeep = Path(o.out_dir) / TENSOR_CSV, []
    if tpath.exists():
        with open(tpath, newline="") as f:
            tkeep = [r for r in csv.DictReader(f) if float(r["lr"]) != o.lr]
    with open(tpath, "w", newline="") as f:
        w = csv.DictWriter(f, TENSOR_COLUMNS)
        w.writeheader()
        w.writerows(tkeep + [t for r in rows for t in r.get("tensors", [])])
    print(delta_table(path))
    return path


def delta_table(path: str | Path) -> str:
    """The full-vs-delta table of an rl_delta.csv: per lr and mode, pushes, p50 seconds (push and
    write phase), p50 compare seconds, p50 bytes and their share of full, p50 writes, every push
    verified; and the delta/full ratio of the p50s."""
    from statistics import median

    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    lines = [f"{'lr':>7} {'mode':>6} {'pushes':>6} {'p50 s':>8} {'write s':>8} {'compare s':>9} {'bytes':>11} "
             f"{'of full':>8} {'writes':>8} {'verified':>8}"]
    for lr in sorted({float(r["lr"]) for r in rows}):
        p50 = {}
        for mode in ("full", "delta"):
            rs = [r for r in rows if float(r["lr"]) == lr and r["mode"] == mode]
            if not rs:
                continue
            m = {k: median(float(r[k]) for r in rs) for k in ("seconds", "write_seconds", "compare_s", "bytes",
                                                               "full_bytes", "n_writes")}
            p50[mode] = m
            ok = all(r["verified"] == "True" for r in rs)
            lines.append(f"{lr:7.0e} {mode:>6} {len(rs):6d} {m['seconds']:8.4f} {m['write_seconds']:8.4f} "
                         f"{m['compare_s']:9.4f} {m['bytes']:11.0f} {100 * m['bytes'] / m['full_bytes']:7.2f}% "
                         f"{m['n_writes']:8.0f} {'all' if ok else 'NOT ALL':>8}")
        if len(p50) == 2:
            lines.append(f"{'':7} delta/full p50: {p50['delta']['seconds'] / p50['full']['seconds']:.3f}x seconds, "
                         f"{p50['delta']['write_seconds'] / p50['full']['write_seconds']:.3f}x write phase, "
                         f"{p50['delta']['bytes'] / p50['full']['bytes']:.4f}x bytes")
            by = {(r["step"], r["mode"]): float(r["seconds"]) for r in rows if float(r["lr"]) == lr}
            pairs = [by[(s, "delta")] / by[(s, "full")] for s, m in by if m == "delta" and (s, "full") in by]
            com = {m: [float(r["commit_s"]) for r in rows if float(r["lr"]) == lr and r["mode"] == m
                       and r.get("commit_s") not in (None, "")] for m in ("full", "delta")}
            if pairs:
                lines.append(f"{'':7} per step (same weights, both pushes): delta faster in "
                             f"{sum(p < 1 for p in pairs)}/{len(pairs)}, median pair {median(pairs):.3f}x"
                             + (f"; commit p50 (vLLM post-processing) full {median(com['full']):.4f} s, delta "
                                f"{median(com['delta']):.4f} s" if com["full"] and com["delta"] else ""))
        rs = [r for r in rows if float(r["lr"]) == lr and r["mode"] == "delta" and r.get("delta") == "delta"]
        if rs and rs[0].get("delta_wire_s") not in (None, ""):
            ph = {k: median(float(r[k] or 0) for r in rs) for k in PHASES}
            out = {m: sum(float(r.get(f"out_bytes_{m}") or 0) for r in rs) for m in MODE_NAMES}
            tot = sum(out.values()) or 1.0
            lines.append(f"{'':7} delta phases p50 (s): compare {ph['delta_compare_s']:.4f} (fused in prepare "
                         f"{ph['delta_fused_s']:.4f}), pack {ph['delta_pack_s']:.4f}, wire {ph['delta_wire_s']:.4f}, "
                         f"apply {ph['delta_apply_s']:.4f}" + (
                             f" (+ the commit's staging copies applying deferred records {patch:.4f})"
                             if (patch := median(float(r.get("delta_patch_s") or 0) for r in rs)) else ""))
            lines.append(f"{'':7} output bytes by mode over {len(rs)} delta pushes: "
                         + ", ".join(f"{m} {100 * out[m] / tot:.1f}%" for m in MODE_NAMES))
    return "\n".join(lines)


def log(rank: int, msg: str) -> None:
    print(f"[rank {rank}] {msg}", flush=True)


# ------------------------------------------------------------------------------------ the task


class ParityTask:
    """Prompts ``[a, b]`` (every pair of ``values`` token ids); reward 1 when the first answer
    token's parity equals ``(a + b) % 2``. A random policy earns 0.5."""

    def __init__(self, o: RLOptions):
        import torch

        v = torch.arange(o.first_token, o.first_token + o.values)
        self.prompts = torch.cartesian_prod(v, v)  # [values**2, 2]

    def reward(self, prompts, answers):
        """``prompts`` [P, 2], ``answers`` [P, G, T] token ids -> rewards [P, G] (float 0/1)."""
        want = prompts.sum(1) % 2
        return (answers[:, :, 0] % 2 == want[:, None]).float()


def group_advantages(rewards, eps: float = 1e-6):
    """GRPO's group-normalized advantages: ``(r - mean) / (std + eps)`` within each group
    (row of ``rewards`` [P, G]); a group whose rewards are all equal has advantage 0."""
    mean, std = rewards.mean(1, keepdim=True), rewards.std(1, keepdim=True)
    return (rewards - mean) / (std + eps)


def rollout(llm, prompts, *, group: int, max_tokens: int = 1, seed: int = 0) -> dict:
    """``group`` samples per prompt from an offline ``vllm.LLM`` (temperature 1, no top-k/p, so
    vLLM's raw logprobs are the sampling distribution's). Returns ``{"answers": [P, G, T] token
    ids, "logprobs": [P, G, T] float32 (vLLM's), "versions": the set of each sample's weight-version
    spans as vLLM reports them, ``((version, start, end), ...)``, "seconds"}``; each request's seed is ``seed + its index`` (vLLM gives sample ``i``
    of a request ``seed + i``)."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    reqs = [TokensPrompt(prompt_token_ids=[int(x) for x in p]) for p in prompts]
    sps = [SamplingParams(n=group, temperature=1.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True,
                          seed=seed + 1000 * i) for i in range(len(reqs))]
    outs = llm.generate(reqs, sps, use_tqdm=False)
    answers = torch.zeros(len(reqs), group, max_tokens, dtype=torch.long)
    logprobs = torch.zeros(len(reqs), group, max_tokens)
    versions = set()
    for i, o in enumerate(outs):
        assert len(o.outputs) == group, (i, len(o.outputs))
        for j, c in enumerate(o.outputs):
            answers[i, j] = torch.tensor(c.token_ids)
            logprobs[i, j] = torch.tensor([d[t].logprob for t, d in zip(c.token_ids, c.logprobs)])
            versions.add(tuple((w.version, w.start, w.end) for w in (c.weight_versions or [])))
    return {"answers": answers, "logprobs": logprobs, "versions": versions, "seconds": time.perf_counter() - t0}


def clipped_pg_loss(model, prompts, answers, old_logprobs, adv, clip: float):
    """PPO/GRPO clipped policy-gradient loss (token mean) of ``model`` on its share: ``prompts``
    [N, Lp], ``answers`` / ``old_logprobs`` (vLLM's) [N, T], ``adv`` [N]. The ratio is
    ``exp(logp_train - logp_vllm)``. Returns ``(loss, stats)`` with ``stats``: the largest
    ``|log ratio|`` (bf16 serving vs the fp32 master: small when vLLM computes with the pushed
    weights) and the fraction of tokens clipped."""
    import torch

    lp_len, t = prompts.shape[1], answers.shape[1]
    logits = model(input_ids=torch.cat([prompts, answers], 1)).logits[:, lp_len - 1: lp_len - 1 + t]
    logp = logits.float().log_softmax(-1).gather(-1, answers[..., None])[..., 0]
    log_ratio = logp - old_logprobs
    ratio = log_ratio.exp()
    a = adv[:, None]
    loss = -torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a).mean()
    clipped = ((ratio - 1).abs() > clip).float().mean()
    return loss, {"logratio_max": float(log_ratio.detach().abs().max()), "clip_frac": float(clipped)}


# --------------------------------------------------------------------------- weights and checks


def served_weights(model) -> dict:
    """``{Hugging Face name: bf16 tensor}``: every parameter gathered (``full_tensor()``, a
    collective: every training rank calls it) and cast as the engine serves it."""
    import torch

    out = {}
    for n, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[n] = full.detach().to(torch.bfloat16)
    return out


def _digest(t) -> str:
    import torch

    b = t.detach().contiguous().view(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(b, digest_size=16).hexdigest() + f":{t.dtype}:{tuple(t.shape)}"


def engine_kwargs() -> dict:
    """The vLLM settings of the live engine and the oracle beyond :class:`weight_transfer.engines.vllm.VllmEngine`'s
    defaults: every sample of a step in one batch (16 prompts x 8)."""
    return {"max_num_seqs": 128}


class OracleCheck:
    """After every push: the live engine (rank 0) against the oracle (rank 1), see the module
    docstring. Every training rank builds one and calls it with the step's
    :func:`served_weights` (a collective over the default process group). Checked:

    - ``bytes``: every addressable runtime tensor of the live engine's runtime layout
      (``RuntimeLayout.check``: direct targets, packed copies) equals the oracle's;
    - ``staging``: the staging tensors of the layers vLLM keeps opaque (on an AMX host the
      linears over 1 MiB: oneDNN handles; the backend writes their checkpoint-layout staging
      tensors and vLLM re-runs its post-processing at commit) equal what the stand-in engine's
      ``load_weights`` makes of the served weights (``verify.staging_oracle``);
    - ``outputs`` (recorded; ``ok`` is the two byte checks): greedy tokens and logprobs for
      ``verify.fixed_prompts`` against the oracle's (``verify.outputs_equal``: tokens identical,
      logprobs within ``verify.LOGPROB_ULPS``), the only check that reaches the opaque oneDNN
      state itself. Both engines drop their prefix cache first and compute the prompts from
      scratch: vLLM's reload path keeps KV blocks computed with the previous version (C21), and
      a cache hit is computed in another batch. Not required: two engines holding the same
      bytes here now and then differ by one bf16 rounding of a logit (2^-6 nats; measured in
      docs/DELTA.md, "Verification"), which can flip a greedy token of a near-uniform model.

    :func:`final_check` runs the same comparison against a fresh vLLM."""

    def __init__(self, rank: int, engine, cfg):
        from weight_transfer.engines.vllm.verify import fixed_prompts
        from weight_transfer.engines.vllm.worker.runtime import runtime_layout

        self.rank, self.engine, self.cfg = rank, engine, cfg
        self.prompts = fixed_prompts(cfg.vocab_size)
        names = None
        if rank == 0:
            self.layout = runtime_layout(engine.reports()[0], 0)
            names = sorted(self.layout.check)
        self.names = broadcast(names)  # the live engine's runtime tensors, as vLLM reports them

    def reload(self, served: dict) -> None:
        """Rank 1's engine loads ``served`` (vLLM's own ``load_weights`` + post-processing);
        then :meth:`__call__` with ``reload=False``. ``--delta`` reloads once per step, before
        both pushes of the step's weights, so that neither push runs behind a reload."""
        if self.rank == 1:
            self.engine.reload(list(served.items()))

    def __call__(self, served: dict, *, reload: bool = True) -> dict:
        """``{"ok", "bytes_ok", "staging_ok", "outputs_ok", "tokens_ok", "bytes" (compared),
        "mismatched": [names], "logprob_ulps", "logprob_maxdiff" (nats; None when the tokens
        differ), "seconds"}`` (the same on every rank). ``reload=False``: rank 1's engine already
        holds ``served`` (:func:`final_check`)."""
        from weight_transfer.engines.vllm.verify import outputs_equal, staging_oracle
        from weight_transfer.engines.vllm.worker.runtime import STAGING_SUFFIX

        t0 = time.perf_counter()
        if reload:
            self.reload(served)
        # both engines compute the prompts from scratch: a prefix-cache hit would reuse KV blocks
        # computed with the previous version (the reload path does not drop them, C21) or, on
        # the live engine, computed in another batch than the oracle's
        self.engine.reset_prefix_cache()
        got = self.engine.read(self.names)[0]
        mine = {n: _digest(t) for n, t in got.items()}
        nbytes = sum(t.numel() * t.element_size() for t in got.values())
        outs = self.engine.generate(self.prompts, max_tokens=6)
        staging_ok, bad_staging = None, []
        if self.rank == 0 and self.layout.staging_names():
            stg = self.engine.read(sorted(self.layout.staging_names()))[0]
            want = staging_oracle(self.cfg, {0: self.layout}, served.__getitem__, list(served), tp=1)[0]
            for n, t in stg.items():
                e = want.get(n.removesuffix(STAGING_SUFFIX))
                if e is None or _digest(t) != _digest(e):
                    bad_staging.append(n)
            staging_ok = not bad_staging
            nbytes += sum(t.numel() * t.element_size() for t in stg.values())
        both = all_gather((mine, outs, staging_ok, bad_staging, nbytes), type_=_CheckMsg)
        (live, live_out, staging_ok, bad_staging, nbytes), (oracle, oracle_out, *_) = both
        bad = sorted(n for n in set(live) | set(oracle) if live.get(n) != oracle.get(n))
        outputs_ok, ulps = outputs_equal(live_out, oracle_out)
        tokens_ok = ulps != float("inf")
        bytes_ok = not bad and len(live) == len(self.names)
        return {"ok": bytes_ok and staging_ok is not False, "bytes_ok": bytes_ok,
                "staging_ok": staging_ok, "outputs_ok": outputs_ok, "tokens_ok": tokens_ok, "logprob_maxdiff": logprob_maxdiff(live_out, oracle_out), "bytes": nbytes, "mismatched": bad + bad_staging,
                "logprob_ulps": ulps, "seconds": time.perf_counter() - t0}


def logprob_maxdiff(a, b) -> float | None:
    """Largest ``|logprob|`` difference (nats) of two generations ``[(tokens, logprobs)]`` with
    identical tokens; None when the tokens differ."""
    if len(a) != len(b) or any(list(ta) != list(tb) for (ta, _), (tb, _) in zip(a, b)):
        return None
    return max((abs(x - y) for (_, la), (_, lb) in zip(a, b) for x, y in zip(la, lb)), default=0.0)


def supervise(procs, poll: float = 0.5) -> int:
    """Wait for started ``multiprocessing`` processes ``procs`` (the RL loop's trainers): the
    first that exits non-zero gets the others terminated (a trainer left waiting for a dead
    peer in a collective would otherwise hold the run until its timeout), then all are
    reaped. Returns the largest ``|exitcode|`` (0: all succeeded)."""
    while any(p.is_alive() for p in procs) and not any(p.exitcode for p in procs):
        time.sleep(poll)
    for p in procs:
        if p.is_alive() and any(q.exitcode for q in procs):
            p.terminate()
        p.join()
    return max(abs(p.exitcode or 0) for p in procs)


def final_check(rank: int, check: OracleCheck, cfg, served: dict, workdir: str | Path) -> dict:
    """The live engine against a fresh vLLM started from the final weights' checkpoint, on
    both training ranks (a collective): rank 1 closes the oracle, writes the checkpoint
    (:func:`weight_transfer.engines.vllm.checkpoint.write_checkpoint_tensors`) and starts a
    plain vLLM from it with the live engine's settings (a multi-process engine like the live
    one); then :class:`OracleCheck`'s comparison: every addressable runtime byte, the staging
    bytes against ``load_weights``, greedy tokens and logprobs. Returns its result plus
    ``seconds``."""
    from weight_transfer.engines.vllm import VllmEngine
    from weight_transfer.engines.vllm.checkpoint import write_checkpoint_tensors

    t0 = time.perf_counter()
    fresh = None
    try:
        if rank == 1:
            check.engine.close()
            ckpt = write_checkpoint_tensors(cfg, Path(workdir) / "final", served)
            fresh = check.engine = VllmEngine(ckpt, targets="direct", **engine_kwargs())
        res = check(served, reload=False)
    finally:
        if fresh is not None:
            fresh.close()
    res["seconds"] = time.perf_counter() - t0
    return res


# ------------------------------------------------------------------------------------ records


COLUMNS = ["run", "lr", "step", "rollout_version", "reward_mean", "loss", "logratio_max", "clip_frac",
           "pushed_version", "push_seconds", "push_call_seconds", "push_bytes", "push_writes", "verified",
           "verified_bytes", "oracle_outputs_equal", "oracle_logprob_ulps", "oracle_logprob_maxdiff", "rollout_s", "train_s", "verify_s", "fingerprints", "fp_bytes", "fp_s", "changes_s",
           "step_s", "final_bytes_ok",
           "final_outputs_ok", "final_logprob_ulps", "final_logprob_maxdiff", "timestamp"]


class StepLog:
    """One CSV row per step (rank 0), written as it happens: ``out_dir/rl_<tag>.csv`` (step 0:
    the push of the initial weights, no rollout)."""

    def __init__(self, o: RLOptions):
        self.path = Path(o.out_dir) / f"rl_{o.name}.csv"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.o, self.rows = o, []
        with open(self.path, "w", newline="") as f:
            csv.writer(f).writerow(COLUMNS)

    def add(self, **row) -> dict:
        row = {"run": self.o.name, "lr": self.o.lr, "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), **row}
        self.rows.append(row)
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, COLUMNS, extrasaction="ignore").writerow(row)
        return row

    def finish(self, **final) -> None:
        """Put the final check's result on the last row (rewrites the file) and draw the plot."""
        self.rows[-1].update(final)
        with open(self.path, "w", newline="") as f:
            w = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
            w.writeheader()
            w.writerows(self.rows)
        try:
            from weight_transfer.analysis.rl import plot_run

            plot_run(self.path, self.path.with_suffix(".png"))
        except Exception as e:  # a plot is not worth failing a verified run for
            print(f"# plot skipped: {type(e).__name__}: {e}", file=sys.stderr)


def change_rows(lr: float, step: int, old: dict, new: dict) -> list[dict]:
    """Item 2's tidy rows: :func:`weight_transfer.delta.changes.changes_by_kind` between two served
    versions, one row per kind x granularity (``scales``: FP8 ``weight_scale_inv`` entries; its
    delta bytes are part of each FP8 granularity's)."""
    from weight_transfer.delta.changes import GRANULARITIES, changes_by_kind

    rows = []
    for kind, c in changes_by_kind(old, new).items():
        for g in (*GRANULARITIES, "scales"):
            full = c.full_bytes["bf16" if g.startswith("bf16") else "fp8"]
            rows.append({"lr": lr, "step": step, "kind": kind, "granularity": g, "changed": c.changed[g],
                         "total": c.total[g], "fraction": c.fraction(g),
                         "delta_bytes": c.delta_bytes.get(g, ""), "full_bytes": full})
    return rows


CHANGE_COLUMNS = ["lr", "step", "kind", "granularity", "changed", "total", "fraction", "delta_bytes", "full_bytes"]


def write_change_rows(path: str | Path, lr: float, rows: list[dict]) -> None:
    """Replace ``lr``'s rows of ``path`` (tidy CSV, :data:`CHANGE_COLUMNS`) by ``rows``."""
    path = Path(path)
    keep = []
    if path.exists():
        with open(path, newline="") as f:
            keep = [r for r in csv.DictReader(f) if not math.isclose(float(r["lr"]), lr)]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, CHANGE_COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(keep + rows)


def magnitude_rows(weights: dict, lrs=(1e-6, 1e-5)) -> list[dict]:
    """Per tensor kind: element count, std, median ``|w|``, median bf16 spacing (ulp) at ``|w|``,
    and for each lr the fraction of bf16 elements a step of exactly ``lr`` per element would
    change if the fp32 master sat anywhere within its bf16 cell (``mean(min(1, lr / ulp))``;
    Adam's first step is ``lr * sign(g)``)."""
    import torch

    from weight_transfer.delta.changes import tensor_kind

    by: dict[str, list] = {}
    for n, t in weights.items():
        by.setdefault(tensor_kind(n), []).append(t.detach().float().reshape(-1))
    out = []
    for kind, ts in sorted(by.items()):
        w = torch.cat(ts)
        a = w.abs()
        ulp = torch.where(a > 0, 2.0 ** (torch.floor(torch.log2(a.clamp_min(1e-30))) - 7), torch.tensor(2.0 ** -133))
        row = {"kind": kind, "numel": w.numel(), "std": float(w.std()), "median_abs": float(a.median()),
               "median_ulp": float(ulp.median())}
        for lr in lrs:
            row[f"pred_frac_lr{lr:g}"] = float((lr / ulp).clamp(max=1).mean())
        out.append(row)
    return out


def save_changes(o: RLOptions, rows: list[dict], initial: dict) -> None:
    """Write this lr's :func:`change_rows` into ``out_dir/rl_changes.csv`` (other lrs' rows
    kept) and :func:`magnitude_rows` of the initial weights into ``out_dir/rl_magnitudes.csv``."""
    out = Path(o.out_dir)
    write_change_rows(out / CHANGES_CSV, o.lr, rows)
    mags = magnitude_rows(initial, lrs=(1e-6, 1e-5, 1e-4, 5e-4))
    with open(out / "rl_magnitudes.csv", "w", newline="") as f:
        w = csv.DictWriter(f, list(mags[0]))
        w.writeheader()
        w.writerows(mags)


# -------------------------------------------------------------------------------- subcommand


def load_example():
    """``examples/rl_loop.py`` of the checkout, imported as module ``rl_loop`` (its trainer
    function must be importable by name in the spawned training ranks). FileNotFoundError
    when this install has no checkout around it."""
    ex = project_dir() / "examples"
    if not (ex / "rl_loop.py").is_file():
        raise FileNotFoundError(f"{ex / 'rl_loop.py'}: weight-transfer rl runs the example of a source checkout")
    if str(ex) not in sys.path:
        sys.path.insert(0, str(ex))
    import rl_loop

    return rl_loop


def main(o: RLOptions) -> int:
    """``weight-transfer rl``: run ``examples/rl_loop.py`` with these options."""
    return load_example().run(o)

