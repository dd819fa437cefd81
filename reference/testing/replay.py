"""Replayed training steps: the weights an RL run saved after every optimizer step, served to a
trial exactly as :mod:`weight_transfer.testing.weights` serves synthetic steps -- any process,
any slice (a shard's box), any step, with no history -- so the training ranks and the oracle read
the same bytes.

On disk (``weight-transfer rl --save-steps DIR``; :func:`save_step` writes it)::

    DIR/manifest.json          {"format": "wt-replay-1", "model": ..., "layers": ..., "vocab": ...,
                                "lr": ..., "seed": ..., "dtype": "bfloat16", "steps": [0, 1, ...]}
    DIR/step_00000.safetensors the weights before the first optimizer step (the initial model)
    DIR/step_00001.safetensors the weights after step 1, ...

Each step file is a plain safetensors file (8-byte little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets"}}``, the raw bytes): the full model in checkpoint
(Hugging Face) names, bf16 as the engine serves it (the RL loop's fp32 master cast once, exactly
what its push sends), loadable by ``safetensors.torch.load_file``. This module reads and writes
the format itself (numpy memory maps, no ``safetensors`` import), so a replay needs nothing
beyond torch and numpy, and a slice costs one copy of its bytes.

Reads are bit-exact: the saved dtype is returned as saved, or cast with ``Tensor.to`` when the
caller asks for another float dtype (bf16 -> fp32 is exact, and the transfer's fp32 -> bf16 cast
gives the saved bf16 back).
"""
from __future__ import annotations

import json
import os
import struct
from functools import lru_cache

import numpy as np
import torch

from ..types import Box, box_shape, box_to_slices, torch_dtype

__all__ = ["FORMAT", "ReplaySteps", "save_step", "write_safetensors", "read_header", "step_path"]

FORMAT = "wt-replay-1"
MANIFEST = "manifest.json"
_ST_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.uint8: "U8",
             torch.int8: "I8", torch.int32: "I32", torch.int64: "I64"}
_TORCH_DTYPE = {v: k for k, v in _ST_DTYPE.items()}
_NP_VIEW = {"BF16": np.int16, "F16": np.int16, "F32": np.int32, "U8": np.uint8, "I8": np.int8,
            "I32": np.int32, "I64": np.int64}
"""Numpy dtypes the raw bytes are mapped as (bit patterns; viewed back as the torch dtype)."""


def step_path(directory: str, step: int) -> str:
    """``DIR/step_{step:05d}.safetensors``."""
    return os.path.join(directory, f"step_{step:05d}.safetensors")


def write_safetensors(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> int:
    """Write ``tensors`` (CPU, any of bf16/f16/f32/u8/i8/i32/i64) as one safetensors file,
    atomically (``path + ".part"``, then rename). Returns the file's bytes. Raises ValueError for
    an unsupported dtype."""
    header: dict = {"__metadata__": dict(metadata or {})} if metadata else {}
    off = 0
    for name, t in tensors.items():
        if t.dtype not in _ST_DTYPE:
            raise ValueError(f"write_safetensors: {name} has dtype {t.dtype}; supported: {sorted(map(str, _ST_DTYPE))}")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPE[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)  # the format pads the header to 8 bytes
    with open(path + ".part", "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for t in tensors.values():
            f.write(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    os.replace(path + ".part", path)
    return 8 + len(hb) + off


def read_header(path: str) -> tuple[dict, int]:
    """(header without ``__metadata__``, byte offset of the data) of a safetensors file. Raises
    ValueError when the file is not one."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 << 20:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


@lru_cache(maxsize=8)
def _mapped(path: str) -> tuple[dict, np.memmap]:
    header, base = read_header(path)
    return header, np.memmap(path, dtype=np.uint8, mode="r", offset=base)


def save_step(directory: str, step: int, weights: dict[str, torch.Tensor], *, info: dict | None = None) -> str:
    """Save one step's ``weights`` (name -> tensor; the served bf16) as ``DIR/step_{step:05d}``
    and add ``step`` to ``DIR/manifest.json`` (created with ``info``: model, layers, vocab, lr,
    seed, ... on first use). Returns the file's path."""
    os.makedirs(directory, exist_ok=True)
    path = step_path(directory, step)
    write_safetensors(path, weights, {"step": str(step)})
    mpath = os.path.join(directory, MANIFEST)
    man = {"format": FORMAT, "steps": []}
    if os.path.exists(mpath):
        with open(mpath) as f:
            man = json.load(f)
    man.update({k: v for k, v in (info or {}).items() if k not in ("format", "steps")})
    dts = {str(t.dtype).removeprefix("torch.") for t in weights.values()}
    man["dtype"] = dts.pop() if len(dts) == 1 else "mixed"
    man["steps"] = sorted(set(man.get("steps", [])) | {int(step)})
    with open(mpath + ".part", "w") as f:
        json.dump(man, f, indent=1)
    os.replace(mpath + ".part", mpath)
    return path


class ReplaySteps:
    """The steps saved in ``directory`` (module docstring). ``start``: the saved step that trial
    step 1 reads (trial step ``s`` reads saved step ``start + s - 1``; the caller maps paired
    pushes first, :meth:`weight_transfer.experiments.config.RunOptions.source_step`).

    Raises ValueError (naming the directory) when there is no manifest, its format is unknown,
    or a listed step file is missing."""

    def __init__(self, directory: str, start: int = 0):
        self.directory = os.path.abspath(directory)
        mpath = os.path.join(self.directory, MANIFEST)
        if not os.path.isfile(mpath):
            raise ValueError(f"replay {directory}: no {MANIFEST} (save steps with `weight-transfer rl --save-steps DIR`)")
        with open(mpath) as f:
            self.manifest = json.load(f)
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"replay {directory}: format {self.manifest.get('format')!r}, expected {FORMAT!r}")
        self.steps: list[int] = sorted(int(s) for s in self.manifest.get("steps", []))
        missing = [s for s in self.steps if not os.path.isfile(step_path(self.directory, s))]
        if not self.steps or missing:
            raise ValueError(f"replay {directory}: {'no steps saved' if not self.steps else f'missing step files {missing[:3]}'}")
        if start < 0 or start not in self.steps:
            raise ValueError(f"replay {directory}: start step {start} not saved (saved: {self.steps[0]}..{self.steps[-1]})")
        self.start = start

    @property
    def n_trial_steps(self) -> int:
        """Trial steps this replay can serve from ``start`` (consecutive saved steps)."""
        n = 0
        while self.start + n in self.steps:
            n += 1
        return n

    def saved_step(self, step: int) -> int:
        """The saved step trial step ``step`` (>= 1) reads. Raises ValueError past the last."""
        s = self.start + step - 1
        if step < 1 or s not in self.steps:
            raise ValueError(f"replay {self.directory}: trial step {step} wants saved step {s}, "
                             f"saved: {self.steps[0]}..{self.steps[-1]}")
        return s

    def names(self, step: int = 1) -> list[str]:
        """Tensor names of the step file, in file order."""
        return list(_mapped(step_path(self.directory, self.saved_step(step)))[0])

    def shapes(self, step: int = 1) -> dict[str, tuple[int, ...]]:
        """Name -> shape of the step file."""
        h = _mapped(step_path(self.directory, self.saved_step(step)))[0]
        return {n: tuple(e["shape"]) for n, e in h.items()}

    def _tensor(self, name: str, step: int) -> torch.Tensor:
        """The saved tensor ``name`` of trial step ``step``, zero-copy over the memory map (read-only)."""
        header, mm = _mapped(step_path(self.directory, self.saved_step(step)))
        e = header.get(name)
        if e is None:
            raise KeyError(f"replay {self.directory}: step {self.saved_step(step)} has no tensor {name!r}")
        a, b = e["data_offsets"]
        arr = mm[a:b].view(_NP_VIEW[e["dtype"]])
        import warnings

        with warnings.catch_warnings():  # the map is read-only; every caller copies out of it
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(arr)
        return t.view(_TORCH_DTYPE[e["dtype"]]).view(tuple(e["shape"]))

    def param_box(self, name: str, shape: tuple[int, ...], box: Box, *, step: int, dtype: str | torch.dtype,
                  out: torch.Tensor | None = None) -> torch.Tensor:
        """The sub-tensor ``box`` of parameter ``name`` (global ``shape``) at trial step ``step``, as
        ``dtype`` (a copy; into ``out`` when given, contiguous with ``box``'s shape). Raises
        ValueError when the saved shape is not ``shape`` (the trial's model is not the saved run's)."""
        t = self._tensor(name, step)
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"replay {self.directory}: {name} saved with shape {tuple(t.shape)}, the trial's model has "
                             f"{tuple(shape)} (use the RL run's model: --model, --override num_hidden_layers/vocab_size)")
        dt = torch_dtype(dtype) if isinstance(dtype, str) else dtype
        piece = t[box_to_slices(box)]
        if out is None:
            return piece.to(dt, copy=True).contiguous()
        out.view(box_shape(box)).copy_(piece)
        return out

    def full_param(self, name: str, shape: tuple[int, ...], *, step: int, dtype: str | torch.dtype) -> torch.Tensor:
        """The whole parameter ``name`` at trial step ``step`` (a copy)."""
        return self.param_box(name, shape, tuple((0, s) for s in shape), step=step, dtype=dtype)

    def check_specs(self, specs) -> None:
        """Raise ValueError unless the saved names and shapes are exactly ``specs``' (objects with
        ``name`` and ``shape``), naming the first differences."""
        have = self.shapes()
        want = {s.name: tuple(s.shape) for s in specs}
        if have != want:
            miss = sorted(set(want) - set(have))[:3]
            extra = sorted(set(have) - set(want))[:3]
            bad = sorted(n for n in set(want) & set(have) if want[n] != have[n])[:3]
            raise ValueError(f"replay {self.directory}: the saved steps are not this model's (missing {miss}, extra "
                             f"{extra}, other shapes {[(n, have[n], want[n]) for n in bad]}; the RL loop's default is "
                             "--model qwen3-0.6b --override num_hidden_layers=2,vocab_size=8192)")


class ReplayCheckpoint:
    """The full checkpoint of trial step ``step`` of a :class:`ReplaySteps`, tensor by tensor, as
    :class:`weight_transfer.testing.weights.SyntheticCheckpoint` serves a synthetic one (``specs``:
    the model's; ``dtype_override`` replaces BF16, e.g. fp32 masters)."""

    def __init__(self, replay: ReplaySteps, specs, *, step: int, dtype_override: str | None = None):
        self.replay, self.step, self.dtype_override = replay, step, dtype_override
        self.specs = {s.name: s for s in specs}

    def dtype_of(self, name: str) -> str:
        d = self.specs[name].dtype
        return self.dtype_override if (self.dtype_override and d == "bfloat16") else d

    def __getitem__(self, name: str) -> torch.Tensor:
        s = self.specs[name]
        return self.replay.full_param(name, tuple(s.shape), step=self.step, dtype=self.dtype_of(name))

    def __iter__(self):
        for name in self.specs:
            yield name, self[name]

    def names(self) -> list[str]:
        return list(self.specs)


def open_replay(directory: str, start: int = 0) -> ReplaySteps:
    """:class:`ReplaySteps` of ``directory`` (cached per process: the memory maps stay open)."""
    return _open(os.path.abspath(directory), start)


@lru_cache(maxsize=4)
def _open(directory: str, start: int) -> ReplaySteps:
    return ReplaySteps(directory, start)
