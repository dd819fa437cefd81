"""The model config the planner reads: a Hugging Face ``config.json`` (:class:`ModelConfig`)
and one checkpoint tensor's name, shape and dtype (:class:`ParamSpec`).

The recipes (:mod:`weight_transfer.plan.recipes`) read head counts, head dim, expert counts and
which layers are MoE from it, with the names of the HF config. Build one from your model's
``config.json`` with :meth:`ModelConfig.from_file`; the named configs of this project's tests and
benchmarks are in :mod:`weight_transfer.testing.catalog`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM")
"""``architectures[0]`` values with hand-written recipes (:mod:`weight_transfer.plan.rules`). Any
other architecture is planned from recipes traced from vLLM's own loader
(:mod:`weight_transfer.plan.traced`), published by the inference ranks that have a vLLM."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamSpec:
    """One checkpoint tensor: Hugging Face name, global shape, dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "bfloat16"

    @property
    def nbytes(self) -> int:
        from .types import itemsize, numel

        return numel(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A model's published config (``hf``), its catalog ``name`` and the overrides applied.

    Properties expose the fields the weight layout depends on, with the names of the HF
    config. Raises ValueError when the config names no architecture; an architecture outside
    :data:`ARCHITECTURES` is accepted (:attr:`hand_written` False): its recipes come from vLLM's
    loader, and :func:`weight_transfer.plan.build_recipes` refuses it without them.
    """

    name: str
    hf: dict
    overrides: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.architecture == "<missing>":
            raise ValueError(f"model {self.name!r}: the config names no architecture ('architectures' is "
                             f"'<missing>'); hand-written recipes exist for {', '.join(ARCHITECTURES)}, "
                             "others are traced from vLLM's loader")

    @classmethod
    def from_file(cls, path: str | Path, *, name: str | None = None) -> ModelConfig:
        """Read a Hugging Face ``config.json`` (a file, or a directory holding one); ``name``
        defaults to the directory's name. Raises ValueError for a config without an architecture,
        OSError / json.JSONDecodeError for an unreadable file."""
        p = Path(path)
        p = p / "config.json" if p.is_dir() else p
        return cls(name=name or p.parent.name, hf=json.loads(p.read_text()))

    def __getitem__(self, key):
        return self.hf[key]

    def get(self, key, default=None):
        return self.hf.get(key, default)

    @property
    def architecture(self) -> str:
        archs = self.hf.get("architectures") or ["<missing>"]
        return archs[0]

    @property
    def hand_written(self) -> bool:
        """Whether the architecture has hand-written recipes (:data:`ARCHITECTURES`)."""
        return self.architecture in ARCHITECTURES

    @property
    def source(self) -> str:
        return self.hf.get("_source", "<unknown>")

    @property
    def label(self) -> str:
        """Catalog name plus overrides, e.g. ``qwen3-30b-a3b[num_hidden_layers=2]``."""
        if not self.overrides:
            return self.name
        return self.name + "[" + ",".join(f"{k}={v}" for k, v in self.overrides.items()) + "]"

    # shapes ---------------------------------------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return self.hf["hidden_size"]

    @property
    def num_layers(self) -> int:
        return self.hf["num_hidden_layers"]

    @property
    def vocab_size(self) -> int:
        return self.hf["vocab_size"]

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.hf.get("tie_word_embeddings", False))

    @property
    def num_heads(self) -> int:
        return self.hf["num_attention_heads"]

    @property
    def num_kv_heads(self) -> int:
        return self.hf.get("num_key_value_heads", self.num_heads)

    @property
    def head_dim(self) -> int:
        return self.hf.get("head_dim") or self.hidden_size // self.num_heads

    @property
    def is_mla(self) -> bool:
        return self.architecture == "DeepseekV3ForCausalLM"

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (0 for dense models)."""
        return self.hf.get("num_experts") or self.hf.get("n_routed_experts") or 0

    @property
    def num_shared_experts(self) -> int:
        return self.hf.get("n_shared_experts") or 0

    @property
    def moe_intermediate_size(self) -> int:
        return self.hf.get("moe_intermediate_size", 0)

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder layer ``i`` has routed experts (HF modeling code's rule)."""
        if self.num_experts == 0:
            return False
        if self.architecture == "Qwen3MoeForCausalLM":
            step = self.hf.get("decoder_sparse_step", 1)
            return i not in self.hf.get("mlp_only_layers", []) and (i + 1) % step == 0
        if self.architecture == "DeepseekV3ForCausalLM":
            return i >= self.hf.get("first_k_dense_replace", 0) and i % self.hf.get("moe_layer_freq", 1) == 0
        return False
