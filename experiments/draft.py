"""The harness's speculative-decoding draft (``--draft mtp``, ``--draft-frozen``): what a trial
with a draft checks before it starts, and which training tensors a frozen draft keeps."""
from __future__ import annotations


def check_draft(cfg, mcfg) -> None:
    """ValueError (one line) unless ``cfg`` (a :class:`~weight_transfer.experiments.config.TrialConfig`
    of model ``mcfg``) can serve its draft: ``--draft mtp`` needs a model with MTP layers
    (``num_nextn_predict_layers >= 1``: DeepSeek-V3's hand-written, or a traced one's such as
    GLM-4.5's), the stand-in engine and synthetic steps (not
    ``--replay``); ``--draft-frozen`` needs ``--draft``."""
    draft = cfg.inference.draft
    if cfg.run.draft_frozen and not draft:
        raise ValueError("--draft-frozen without --draft: a frozen draft is one the engine serves; add --draft mtp")
    if not draft:
        return
    n = mcfg.get("num_nextn_predict_layers")
    if (mcfg.hand_written and not mcfg.is_mla) or not n:
        raise ValueError(f"--draft {draft}: model {mcfg.label} has no MTP layers (num_nextn_predict_layers={n!r}); "
                         "the draft is the model's multi-token prediction (DeepSeek-V3, GLM-4.5)")
    if cfg.run.engine != "stand-in":
        raise ValueError(f"--draft {draft} with engine={cfg.run.engine!r}: not wired for vLLM engines; use the stand-in")
    if cfg.run.replay:
        raise ValueError(f"--draft {draft} with --replay: the saved RL steps are the RL loop's model, which has no MTP "
                         "layer; use synthetic steps")


def frozen_sources(cfg) -> tuple[str, ...]:
    """Name prefixes of the training tensors held but not trained: the MTP layers
    (``model.layers.{L}.``, ``L >= num_hidden_layers``) under ``--draft-frozen``, else ``()``."""
    if not cfg.run.draft_frozen:
        return ()
    m = cfg.model_config()
    return tuple(f"model.layers.{L}." for L in range(m.num_layers, m.num_layers + m["num_nextn_predict_layers"]))
