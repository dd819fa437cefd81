"""The ``VLLMWeightSyncClient`` adapters of the ``one_sided`` backend
(:mod:`weight_transfer.engines.vllm.backend.plugin`) over engines in this process: an offline
``vllm.LLM`` (:class:`LLMClient`) and an ``AsyncLLM`` whose event loop runs in another thread
(:class:`AsyncLLMClient`). vLLM ships HTTP and Ray clients only.
"""
from __future__ import annotations

import asyncio

from weight_transfer.engines.vllm.backend.config import GO_LIVE_UTILITY

__all__ = ["LLMClient", "AsyncLLMClient"]


class LLMClient:
    """A ``VLLMWeightSyncClient`` over an offline ``vllm.LLM`` in this process (vLLM ships HTTP
    and Ray clients only): each call is the ``LLM`` method of the same name.
    ``finish_weight_update`` also resets the prefix cache (``reset_prefix_cache``: cached KV
    blocks were computed with the old weights, C21) unless ``reset_prefix_cache=False`` or no
    weight version is given (a session closed with the weights unchanged)."""

    def __init__(self, llm, *, reset_prefix_cache: bool = True) -> None:
        self.llm, self.reset = llm, reset_prefix_cache

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)
        if weight_version is None:  # a session closed with the weights unchanged (shadow, failed before go-live)
            return
        if self.reset and self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM refused to reset the prefix cache after the update")

    def go_live(self, version: int) -> dict:
        """Shadow targets' go-live: the engine-core utility :data:`GO_LIVE_UTILITY` (the offline
        ``LLM`` generates only between calls, so this is the go-live without a load)."""
        core = self.llm.llm_engine.engine_core
        if hasattr(core, "call_utility"):
            out = core.call_utility(GO_LIVE_UTILITY, int(version), bool(self.reset))
        else:  # in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0)
            out = getattr(core.engine_core, GO_LIVE_UTILITY)(int(version), bool(self.reset))
        if self.reset and not out["reset"]:
            raise RuntimeError("vLLM refused to reset the prefix cache at the go-live")
        return out


class AsyncLLMClient:
    """A ``VLLMWeightSyncClient`` over a ``vllm.v1.engine.async_llm.AsyncLLM`` whose event loop
    runs in another thread (``loop``): each call runs the coroutine of the same name there and
    waits. ``finish_weight_update`` also resets the prefix cache with
    ``reset_running_requests=True`` (requests kept across a ``pause_generation(mode="keep")`` are
    recomputed under the new weights, so no cached block holds old-weight KV: C21, C23) unless
    ``reset_prefix_cache=False`` or no weight version is given (a session closed with the weights
    unchanged). ``timeout``: seconds per call."""

    def __init__(self, engine, loop: asyncio.AbstractEventLoop, *, reset_prefix_cache: bool = True,
                 timeout: float = 300.0) -> None:
        self.engine, self.loop, self.reset, self.timeout = engine, loop, reset_prefix_cache, timeout

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._run(self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)))

    def start_weight_update(self) -> None:
        self._run(self.engine.start_weight_update())

    def update_weights(self, update_info) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._run(self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._run(self.engine.finish_weight_update(weight_version))
        if weight_version is None:  # a session closed with the weights unchanged (shadow, failed before go-live)
            return
        if self.reset and self._run(self.engine.reset_prefix_cache(reset_running_requests=True)) is False:
            raise RuntimeError("vLLM refused to reset the prefix cache after the update")

    def go_live(self, version: int) -> dict:
        """Shadow targets' go-live (C27): one engine-core utility call, :data:`GO_LIVE_UTILITY`
        (the workers' go-live, the session's end, the weight version label and the prefix-cache
        reset, in one window between two engine steps). Returns its ``{"seconds", "reset"}``;
        RuntimeError when vLLM refused the reset; the workers' error otherwise."""
        out = self._run(self.engine.engine_core.call_utility_async(GO_LIVE_UTILITY, int(version), bool(self.reset)))
        if self.reset and not out["reset"]:
            raise RuntimeError("vLLM refused to reset the prefix cache at the go-live")
        return out
