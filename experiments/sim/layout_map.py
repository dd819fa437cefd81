"""The sensitivity map: Kimi-K2's floor (and, where run at full size, the predicted update
time) against the MoE mesh width (training) and the inference layout (instances x GPUs per
instance; TP+EP vs data-parallel attention + EP), on the headline's hardware.

``weight-transfer simulate --map`` writes ``results/sim_kimi_map.csv``;
``python -m weight_transfer.analysis.simulation`` draws ``results/sim_kimi_map.png``.

Why extrapolated: a full-size Kimi-K2 cell (2.4 million ParamMeta, ~46k tasks) takes ~2-3
minutes and ~2 GB on this project's shared 2-core VM, and the map has 30 cells. Each cell
therefore runs the *real planner and cost model* on Kimi-K2 truncated to ``L1`` and ``L2``
decoder layers (the dense first layer plus ``L - 1`` MoE layers, every other dimension
unchanged: embeddings, lm_head, 384 experts, the full clusters), and extrapolates linearly in
the number of MoE layers to the full 61: ``T(61) = T(L2) + (61 - L2) * (T(L2) - T(L1)) /
(L2 - L1)`` (MoE layers are identical, so every per-layer cost is the same; what does not
grow with depth -- embeddings, lm_head, the barrier, pipeline fill -- is in the intercept).
Floors are extrapolated the same way, and are exact: every link's bytes are linear in the
number of MoE layers (checked: the extrapolated floor of the 8 x DPA+EP16, width-2 cell equals
the full-size run's, 1.553 s). The extrapolated *seconds* are not: the truncated models are
not in steady state (the non-expert group and the pipeline fill weigh more), and on that
checked cell the extrapolation gave 6.5 s against 3.3 s at full size. They are kept in the CSV
as ``seconds_extrapolated`` for inspection only; the heatmap shows the floors and prints the
full-size predictions of ``results/simulated.csv`` where they exist.

Memory: a layout "fits" when one inference GPU's weights (the largest registered region of
the full-size model, from the stand-in engine's tensors) are below the GPU's HBM capacity
(``HBM_CAPACITY``, datasheets); KV cache headroom is not counted, so "fits" is generous.
"""
from __future__ import annotations

import time
from dataclasses import replace

from weight_transfer.testing.catalog import load_config
from weight_transfer.types import InferenceLayout

from .configs import SimConfig, get_config

WIDTHS = (1, 2, 4, 8, 32)
"""MoE mesh widths (nodes per expert sub-mesh) of the 32-node training cluster."""
LAYOUTS: tuple[tuple[str, InferenceLayout], ...] = (
    ("8 x TP16+EP", InferenceLayout(tp=16, dp=8, ep=True, quant="fp8")),
    ("16 x TP8+EP", InferenceLayout(tp=8, dp=16, ep=True, quant="fp8")),
    ("16 x DPA+EP8", InferenceLayout(tp=8, dp=16, ep=True, quant="fp8", dp_attention=True)),
    ("8 x DPA+EP16", InferenceLayout(tp=16, dp=8, ep=True, quant="fp8", dp_attention=True)),
    ("4 x DPA+EP32", InferenceLayout(tp=32, dp=4, ep=True, quant="fp8", dp_attention=True)),
    ("2 x DPA+EP64", InferenceLayout(tp=64, dp=2, ep=True, quant="fp8", dp_attention=True)),
    ("1 x DPA+EP128", InferenceLayout(tp=128, dp=1, ep=True, quant="fp8", dp_attention=True)),
)
"""(label, layout) of the 128 inference GPUs."""
HBM_CAPACITY = {"H100": 80e9, "H200": 141e9, "H20": 96e9}
"""GPU memory, bytes (datasheets: H100 SXM 80 GB, H200 141 GB, H20 96 GB)."""


def region_max_bytes(model: str, layout: InferenceLayout) -> int:
    """Largest registered region (one GPU's weights) of the full-size model under ``layout``."""
    from weight_transfer.engines.engine import engine_tensor_metas

    from .metadata import region_bytes

    cfg = load_config(model)
    return max(region_bytes(engine_tensor_metas(cfg, layout, t)) for t in range(layout.tp))


def _cell(base: SimConfig, width: int, layout: InferenceLayout, layers: int) -> tuple[float, float, dict]:
    from . import run as R

    cfg = replace(base, name=f"map_w{width}_{layout.describe()}_L{layers}", moe_width=width, layout=layout,
                  overrides={**base.overrides, "num_hidden_layers": layers}, methods=("reference",))
    sr = R.run(cfg, log=lambda m: None)
    r = sr.results[0]
    return r.seconds, r.floor_seconds, r.rank_bytes


def layout_map(base_name: str = "kimi_k2_256xh200efa_to_128_dpa_ep32", *, widths=WIDTHS, layouts=LAYOUTS,
               l1: int = 2, l2: int = 4, log=print) -> list[dict]:
    """One row per (width, layout): extrapolated seconds and floor (see module docstring)."""
    from . import model

    base = get_config(base_name)
    full_layers = load_config(base.model).num_layers
    gpu = next((k for k in HBM_CAPACITY if base.hardware.name.startswith(k)), None)
    rows = []
    for label, lay in layouts:
        need = region_max_bytes(base.model, lay)
        for w in widths:
            t0 = time.perf_counter()
            s1, f1, _ = _cell(base, w, lay, l1)
            s2, f2, rb = _cell(base, w, lay, l2)
            k = (full_layers - l2) / (l2 - l1)
            sec, flo = s2 + k * (s2 - s1), f2 + k * (f2 - f1)
            rows.append({"model": base.model, "hardware": base.hardware.name, "moe_width": w, "layout_label": label,
                         "layout": lay.describe(), "seconds_extrapolated": sec, "floor_seconds": flo, "l1": l1, "l2": l2,
                         "seconds_l1": s1, "seconds_l2": s2, "weights_per_gpu_bytes": need,
                         "fits_memory": gpu is None or need <= HBM_CAPACITY[gpu],
                         "recv_max_bytes_l2": model.spread(rb["infer_recv"].values())[2],
                         "fabric_max_bytes_l2": model.spread(rb["train_fabric"].values())[2]})
            log(f"# map: MoE width {w:>2}, {label:<14}: floor {flo:.3f} s (extrapolated {sec:.3f} s, not trusted; L{l1} {s1:.3f} s, L{l2} {s2:.3f} s; "
                f"{need / 1e9:.0f} GB weights per GPU; {time.perf_counter() - t0:.0f} s)")
    return rows


def main(args) -> int:
    """``weight-transfer simulate --map [CONFIG]``: the map over MoE widths and layouts, written to
    ``sim_kimi_map.csv`` beside ``--csv``. Returns 0."""
    from pathlib import Path

    import pandas as pd

    rows_ = layout_map(args.config or "kimi_k2_256xh200efa_to_128_dpa_ep32", log=lambda m: print(m, flush=True))
    p = Path(args.csv).resolve().parent / "sim_kimi_map.csv"
    pd.DataFrame(rows_).to_csv(p, index=False)
    print(f"# map written to {p} (SIMULATED; draw with python -m weight_transfer.analysis.simulation)")
    return 0
