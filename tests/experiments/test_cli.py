"""The typed seam and the one CLI: config dataclasses -> argparse options, the baselines'
options settable from the command line and reaching the methods, one stats protocol, and the
import graph of experiments/ (no cycle between named configs and the sweep launcher; the
simulation does not import the trial runner)."""
from __future__ import annotations

import argparse
import ast
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import ROOT
from weight_transfer.baselines.common import BaselineStats, bucket_bytes, rpc_timeout
from weight_transfer.baselines.options import DEFAULT_BUCKET_BYTES, BaselineOptions
from weight_transfer.experiments.cli import add_dataclass_options, dataclass_from_args, field_docs
from weight_transfer.experiments.config import RunOptions, TrialConfig, trial_key
from weight_transfer.method import UpdateStats
from weight_transfer.options import ControlOptions, ExecutorOptions, PlanOptions, TransferOptions, TransportOptions
from weight_transfer.pipeline.executor import StepStats


@dataclass(kw_only=True, slots=True)
class _Opts:
    """A config dataclass of every supported field type."""

    size: int = 4
    """Bytes per thing."""
    rate: float | None = None
    """Things per second; None: as fast as possible."""
    name: str = "x"
    """What it is called (100% documented)."""
    fast: bool = False
    """Go fast."""
    sizes: tuple[int, ...] = (1, 2)
    """Several sizes, comma-separated."""
    undocumented: int = 0

    def __post_init__(self):
        if self.size < 0:
            raise ValueError(f"size={self.size}: >= 0")


def _parse(cls, argv, **kw):
    ap = argparse.ArgumentParser()
    add_dataclass_options(ap, cls, **kw)
    return ap, ap.parse_args(argv)


def test_field_docs_reads_each_fields_docstring_including_inherited_ones():
    docs = field_docs(_Opts)
    assert docs["size"] == "Bytes per thing."
    assert docs["rate"] == "Things per second; None: as fast as possible."
    assert "undocumented" not in docs
    # a composed config's parts document their own fields
    from weight_transfer.options import ExecutorOptions

    assert field_docs(ExecutorOptions)["watermark"].startswith("Temporaries (gathered sources")
    assert field_docs(TrialConfig)["transfer"].startswith("The reference method's options")


def test_dataclass_options_parse_every_type_and_keep_defaults_when_not_given():
    ap, ns = _parse(_Opts, [])
    assert dataclass_from_args(_Opts, ns) == _Opts()
    _, ns = _parse(_Opts, ["--size", "7", "--rate", "2.5", "--name", "y", "--fast", "--sizes", "3,4,5"])
    assert dataclass_from_args(_Opts, ns) == _Opts(size=7, rate=2.5, name="y", fast=True, sizes=(3, 4, 5))
    _, ns = _parse(_Opts, ["--no-fast"])
    assert dataclass_from_args(_Opts, ns).fast is False
    help_ = ap.format_help()
    assert "--size SIZE" in help_ and "Bytes per thing. (default: 4)" in help_
    assert "(100% documented)" in help_ and "(default: 1,2)" in help_


def test_a_field_named_no_x_is_set_by_its_flag():
    """``no_csv: bool`` -> ``--no-csv`` sets it True (argparse's BooleanOptionalAction would read
    the ``--no-`` prefix as False: ``simulate --no-csv`` appended rows)."""
    @dataclass(kw_only=True, slots=True)
    class _NoX:
        no_csv: bool = False
        """Do not write."""

    assert dataclass_from_args(_NoX, _parse(_NoX, ["--no-csv"])[1]).no_csv is True
    assert dataclass_from_args(_NoX, _parse(_NoX, [])[1]).no_csv is False
    from weight_transfer.experiments.command import build_parser

    argv = ["simulate", "tiny_qwen3_moe_2x2", "--no-csv"]
    assert build_parser(argv).parse_args(argv).no_csv is True


def test_dataclass_options_refuse_bad_values_with_argparse_or_post_init():
    ap = argparse.ArgumentParser()
    add_dataclass_options(ap, _Opts, exclude=("name",))
    with pytest.raises(SystemExit):
        ap.parse_args(["--size", "abc"])
    with pytest.raises(SystemExit):
        ap.parse_args(["--sizes", "1,x"])
    with pytest.raises(SystemExit):
        ap.parse_args(["--name", "z"])  # excluded
    with pytest.raises(ValueError, match="size=-1"):
        dataclass_from_args(_Opts, ap.parse_args(["--size", "-1"]))


def test_baseline_options_are_settable_from_the_cli():
    from weight_transfer.experiments.command import build_parser, config_from_args

    argv = ["run", "--method", "rank0_funnel", "--bucket-bytes", "1048576", "--rpc-timeout", "7.5"]
    cfg = config_from_args(build_parser(argv).parse_args(argv))
    assert cfg.baseline == BaselineOptions(bucket_bytes=1 << 20, rpc_timeout=7.5)
    assert bucket_bytes(cfg.baseline) == 1 << 20 and rpc_timeout(cfg.baseline, cfg.transfer.control.timeout) == 7.5
    argv = ["run", "--method", "rpc"]
    cfg = config_from_args(build_parser(argv).parse_args(argv))
    assert cfg.baseline == BaselineOptions()
    assert bucket_bytes(cfg.baseline) == DEFAULT_BUCKET_BYTES
    assert rpc_timeout(cfg.baseline, 30.0) == 15.0 and rpc_timeout(None, 600.0) == 60.0


def test_baseline_options_change_the_trial_key_only_when_set():
    a = TrialConfig.from_flat(method="rank0_funnel")
    assert trial_key(a) == trial_key(a.replace(baseline=BaselineOptions()))
    assert trial_key(a) != trial_key(a.replace(baseline=BaselineOptions(bucket_bytes=1 << 20)))
    assert trial_key(a) != trial_key(a.replace(bucket_bytes=1 << 20))
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        BaselineOptions(bucket_bytes=0)


def test_the_funnel_reads_its_bucket_size_from_the_method_options(monkeypatch):
    from types import SimpleNamespace

    from weight_transfer.baselines import funnel
    from weight_transfer.baselines.common import ParamEntry

    entries = [ParamEntry(f"p{i}", (1024,), "bfloat16", 0) for i in range(8)]  # 2 KiB each
    monkeypatch.setattr(funnel, "publish_common", lambda ctx: (entries, 16 << 10))  # no store needed
    ctx = SimpleNamespace(method_options=BaselineOptions(bucket_bytes=4096), infer_payloads={0: None})
    assert "in 4 bucket(s)" in funnel.FunnelController().setup(ctx)
    ctx.method_options = BaselineOptions()
    assert "in 1 bucket(s)" in funnel.FunnelController().setup(ctx)


def test_trial_config_composes_its_parts_and_hands_the_methods_the_transfer_options():
    cfg = TrialConfig.from_flat(watermark=1 << 20, pipeline=False, transport="cma", timeout=30.0, max_chunk_bytes=4096)
    t = cfg.transfer
    assert type(t) is TransferOptions
    assert t.executor == ExecutorOptions(pipeline=False, watermark=1 << 20)
    assert (t.transport.name, t.control.timeout, t.plan.max_chunk_bytes) == ("cma", 30.0, 4096)
    # each part checks its own fields, named; the trial checks across parts
    with pytest.raises(ValueError, match="max_chunk_bytes=0"):
        TrialConfig.from_flat(max_chunk_bytes=0)
    with pytest.raises(ValueError, match="watermark=-1"):
        ExecutorOptions(watermark=-1)
    with pytest.raises(ValueError, match="transport='tcp': unknown"):
        TransportOptions(name="tcp")
    with pytest.raises(ValueError, match="timeout=0"):
        ControlOptions(timeout=0)
    with pytest.raises(ValueError, match="cuda_ipc.*needs device='cuda'"):
        cfg.replace(transport="cuda_ipc")
    with pytest.raises(TypeError, match="no option named 'watermark_mb'"):
        cfg.replace(watermark_mb=4)
    # flat names in and out: the CSV columns and trial-key names of the flat config it replaced
    assert cfg.flat()["watermark"] == 1 << 20 and cfg.replace(watermark=None).transfer.executor.watermark is None
    assert TrialConfig.from_flat(**cfg.flat()) == cfg
    for part in ("model", "train", "inference", "transfer", "baseline", "run"):
        assert dataclasses.is_dataclass(getattr(cfg, part)), part


def test_auto_transport_resolves_by_who_allocates_the_receiving_memory():
    """``--transport`` defaults to ``auto``: shm into the stand-in engine's arenas (allocated
    through the transport), cma into vLLM's tensors and wherever the reference does not own the
    receivers' memory, cuda_ipc on GPUs; a named transport is kept; the processes and the trial
    key see the resolved name, and ``replace`` re-resolves (``auto`` is what the config holds)."""
    from weight_transfer.experiments.config import main_job_default, trial_key

    cfg = TrialConfig()
    assert cfg.transfer.transport.name == "auto" and cfg.flat()["transport"] == "auto"
    assert (cfg.transport, cfg.resolved_transfer.transport.name) == ("shm", "shm")
    assert main_job_default().transport == "shm" and main_job_default().replace(quant=None).transport == "shm"
    assert cfg.replace(method="all").transport == "shm"
    for flat in ({"method": "rpc"}, {"method": "rank0_funnel"}, {"kill_engine": ((2, 1, "during"),), "dp": 2},
                 {"engine": "vllm", "quant": None, "tp": 1}):
        assert cfg.replace(**flat).transport == "cma", flat
    assert cfg.replace(device="cuda").transport == "cuda_ipc"
    assert cfg.replace(transport="cma").transport == "cma" and cfg.replace(transport="cma").replace(engine="stand-in").transport == "cma"
    assert cfg.replace(engine="vllm", quant=None, tp=1).replace(engine="stand-in").transport == "shm"
    with pytest.raises(ValueError, match="engine=vllm: transport 'shm' not wired"):
        cfg.replace(transport="shm", engine="vllm", quant=None, tp=1)
    # the key is the resolved back end's: auto on the stand-in keys as shm, on vLLM as cma (old rows match)
    assert trial_key(cfg) == trial_key(cfg.replace(transport="shm")) != trial_key(cfg.replace(transport="cma"))
    vl = cfg.replace(engine="vllm", quant=None, tp=1)
    assert trial_key(vl) == trial_key(vl.replace(transport="cma"))
    # the library: resolve() replaces only auto; preflight refuses an unresolved auto
    t = TransferOptions(transport=TransportOptions(name="auto"))
    assert t.resolve(receiver_allocates=True).transport.name == "shm" and t.resolve().transport.name == "cma"
    assert TransferOptions().resolve(receiver_allocates=True) == TransferOptions()  # cma stays cma
    with pytest.raises(ValueError, match="'auto' is not resolved"):
        t.preflight()
    with pytest.raises(ValueError, match="device='tpu'"):
        t.resolve(device="tpu")
    for cls in (TrialConfig, TransferOptions, ExecutorOptions, PlanOptions, TransportOptions, ControlOptions):
        assert hasattr(cls, "__slots__") and all(f.kw_only for f in dataclasses.fields(cls)), cls


OLD_KEYS = {
    "ci_cpu_regression": ["55a53ab31278", "99cfae05a76b", "6c801be2762f"],
    "qwen3_cpu_watermark": ["ca44defb8d66", "6312045a5441", "ad31181cf466", "c0d926df2b82"],
    "qwen3_30b_a3b_cpu_layouts": ["6f0078907fc3", "657db805d515", "751bcc33b875", "f0b44e406f14", "273e5ba2b049",
                                  "980814c99a7b", "fa7f73f63b13", "648e5bbd5b4a"],
}
"""Trial keys of named sweeps as the flat TrialConfig (021ba5b, before the composition) made them."""


def test_trial_keys_are_those_of_the_flat_config():
    """The flat names and values of the composed config hash to the keys the flat class made
    (issue 24: sweep CSVs keep their columns and keys, so resumed sweeps and the analysis find
    their rows): the default trial, the main job, and every trial of three named sweeps, over
    cma, the transport they were recorded with. Over ``auto`` these stand-in trials resolve to
    shm (issue 29) and key as shm trials: rows measured over cma are not theirs."""
    from weight_transfer.experiments.config import main_job_default
    from weight_transfer.experiments.configs import get_sweep

    cma = dict(transport="cma")
    assert trial_key(TrialConfig().replace(**cma)) == "99c2ce5942a4"
    assert trial_key(main_job_default().replace(**cma)) == "ec37f64c0aa7"
    for name, keys in OLD_KEYS.items():
        trials = get_sweep(name).trials
        assert [trial_key(t.replace(**cma)) for t in trials] == keys, name
        assert [trial_key(t) for t in trials] == [trial_key(t.replace(transport=t.transport)) for t in trials], name
    assert trial_key(TrialConfig()) != "99c2ce5942a4" and trial_key(main_job_default()) != "ec37f64c0aa7"


def test_reference_and_baseline_stats_share_one_protocol():
    s, b = StepStats(rank=0, bytes_sent=10), BaselineStats(rank=1, bytes_sent=10, wire_bytes=30)
    assert isinstance(s, UpdateStats) and isinstance(b, UpdateStats)
    assert (s.wire_bytes, b.wire_bytes, s.peak_alloc_bytes, b.peak_alloc_bytes) == (10, 30, 0, 0)
    assert not isinstance(object(), UpdateStats)


def _imports(path: Path) -> set[str]:
    """Modules a source file imports (absolute names; relative ones resolved)."""
    parts = path.relative_to(ROOT).with_suffix("").parts[:-1]  # installed names: pyproject's package-dir
    pkg = ".".join([{"reference": "weight_transfer"}.get(parts[0], f"weight_transfer.{parts[0]}"), *parts[1:]])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
            mod = (base + "." + node.module if node.module else base) if node.level else node.module
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}
    return out


def test_import_graph_has_no_cycle_between_configs_and_sweep_nor_sim_to_trial():
    exp = ROOT / "experiments"
    configs, sweep = _imports(exp / "configs.py"), _imports(exp / "sweep.py")
    assert not any(m.startswith("weight_transfer.experiments.sweep") for m in configs)
    assert not any(m.startswith("weight_transfer.experiments.configs") for m in sweep)
    for f in (exp / "sim").glob("*.py"):
        assert not any(m.startswith("weight_transfer.experiments.trial") for m in _imports(f)), f
    for f in (ROOT / "reference").rglob("*.py"):
        bad = [m for m in _imports(f) if m.startswith(("weight_transfer.engines", "weight_transfer.baselines",
                                                        "weight_transfer.experiments", "weight_transfer.analysis"))]
        assert not bad, (f, bad)


def test_reference_methods_read_no_trial_config():
    src = (ROOT / "reference" / "method.py").read_text()
    assert "ctx.cfg" not in src and "cfg: Any" not in src


# --------------------------------------------------------------------------------------------
# C18: bad command-line input is refused before any process starts: one `error:` line, exit 2


@pytest.fixture
def refused(monkeypatch, capsys):
    """Run ``weight-transfer`` in this process with process start forbidden; return the
    one stderr line after checking exit status 2, a single ``error:`` line and no process."""
    import multiprocessing.process

    from weight_transfer.experiments.command import main

    started = []

    def no_start(self):
        started.append(self.name)
        raise AssertionError(f"process {self.name} started")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", no_start)

    def run(*argv: str) -> str:
        try:
            rc = main(list(argv))
        except SystemExit as e:
            rc = e.code
        lines = capsys.readouterr().err.strip().splitlines()
        assert not started, started
        assert rc == 2, (rc, lines)
        assert len(lines) == 1 and lines[0].startswith("error:"), lines
        return lines[0]

    return run


def test_c18_non_integer_override_for_an_integer_key(refused):
    msg = refused("run", "--override", "num_hidden_layers=abc")
    assert "num_hidden_layers='abc' wants an integer" in msg


def test_c18_override_without_equals(refused):
    msg = refused("run", "--override", "num_hidden_layers")
    assert "KEY=VALUE" in msg and "'num_hidden_layers'" in msg


def test_c18_unknown_transport(refused):
    msg = refused("run", "--transport", "bogus")
    assert "'bogus'" in msg and "cma" in msg


def test_c18_transport_not_installed(refused):
    from weight_transfer.transport.nixl import load_nixl

    try:
        load_nixl()
        pytest.skip("NIXL is installed here")
    except ImportError:
        pass
    msg = refused("run", "--transport", "nixl")
    assert "transport 'nixl' is not available here" in msg and "pip install" in msg


def test_c18_unwritable_trace_path(refused, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")  # a directory cannot be made under a file, even by root
    msg = refused("run", "--trace", str(blocker / "trace"))
    assert "is not writable" in msg and str(blocker) in msg


def test_c18_absurd_replica_count(refused):
    msg = refused("run", "--dp", "1000")
    assert "2000 inference processes" in msg and "cap of" in msg


def test_c18_negative_timeout(refused):
    assert "timeout=-1.0" in refused("run", "--timeout", "-1")


def test_c18_bad_benchmark_option(refused):
    assert "--repeats" in refused("bench-quant", "--repeats", "x")


def test_c18_sweeps_get_the_same_checks(monkeypatch, tmp_path):
    from weight_transfer.experiments import sweep as S

    with pytest.raises(ValueError, match="transport='bogus'"):
        TrialConfig.from_flat(transport="bogus")
    with pytest.raises(ValueError, match="timeout=-1"):
        TrialConfig.from_flat(timeout=-1)
    with pytest.raises(ValueError, match="wants an integer"):
        TrialConfig.from_flat(overrides={"num_hidden_layers": "abc"})
    monkeypatch.setattr(S, "make_executor", lambda *a: pytest.fail("a job was submitted"))
    sweep = S.Sweep(name="c18", trials=[TrialConfig.from_flat(tp=1, dp=1000)])
    with pytest.raises(ValueError, match="exceed this machine's cap"):
        S.run_sweep(sweep, S.LaunchOptions(cluster="local", folder=tmp_path), results_dir=tmp_path, progress=False)


# ---- --device cuda (docs/GPU.md): everything checkable without a GPU ---------------------------


def test_device_cuda_refused_without_cuda_before_any_process(refused):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    msg = refused("run", "--device", "cuda", "--transport", "cuda_ipc")
    assert "device='cuda' but torch.cuda.is_available() is False" in msg and "docs/GPU.md" in msg


def test_device_cuda_needs_a_transport_into_device_memory(refused):
    msg = refused("run", "--device", "cuda", "--transport", "cma")
    assert "transport='cma'" in msg and "refuses device memory" in msg and "cuda_ipc, nixl, verbs" in msg
    assert "needs device='cuda' (--device cuda)" in refused("run", "--transport", "cuda_ipc")
    assert "invalid choice: 'tpu'" in refused("run", "--device", "tpu")
    assert "only the reference method" in refused("run", "--device", "cuda", "--transport", "cuda_ipc",
                                                  "--method", "rank0_funnel")


def test_shm_transport_on_cuda_is_refused_before_any_process(refused):
    """``--transport shm`` maps host memory the receiver allocated: not for GPU arenas."""
    assert "device='cuda' with transport='shm'" in refused("run", "--device", "cuda", "--transport", "shm")


def test_device_field_checks_and_trial_key():
    with pytest.raises(ValueError, match="device='tpu': cpu or cuda"):
        TrialConfig.from_flat(device="tpu")
    with pytest.raises(ValueError, match="device='cuda' with method='rpc'"):
        TrialConfig.from_flat(device="cuda", transport="nixl", method="rpc")
    # built anywhere (a sweep's config on a login node); the GPU is checked in preflight, where the ranks start
    cfg = TrialConfig.from_flat(device="cuda", transport="cuda_ipc")
    assert cfg.run.device == "cuda" and "device" in field_docs(RunOptions)
    # the default device leaves the keys of rows recorded before the field existed as they were (over cma)
    assert trial_key(TrialConfig().replace(transport="cma")) == "99c2ce5942a4"
    assert trial_key(cfg) != trial_key(cfg.replace(device="cpu", transport="nixl"))


def test_device_option_reaches_the_config():
    from weight_transfer.experiments.command import build_parser, config_from_args

    args = build_parser(["run"]).parse_args(["run", "--device", "cuda", "--transport", "cuda_ipc"])
    cfg = config_from_args(args)
    assert (cfg.run.device, cfg.transfer.transport.name, cfg.model.name) == ("cuda", "cuda_ipc", "qwen3-30b-a3b")
    assert config_from_args(build_parser(["run"]).parse_args(["run"])).run.device == "cpu"


def test_cuda_placement_and_training_backend(monkeypatch):
    """Which GPU each rank process takes and which backend the training world uses: pure
    functions, checked here; the placement itself runs in tests/experiments/test_trial.py's gpu tests."""
    from weight_transfer.experiments.worker import local_cuda_device, local_rank_from_env, training_backend

    cfg = TrialConfig.from_flat(n_train=2, tp=2)
    # one GPU (the H200 check): every process shares device 0
    assert {local_cuda_device(cfg, role, r, n_devices=1) for role in ("train", "infer") for r in range(2)} == {0}
    # one GPU per process: training ranks first, then inference ranks
    assert [local_cuda_device(cfg, "train", r, n_devices=4) for r in range(2)] == [0, 1]
    assert [local_cuda_device(cfg, "infer", i, n_devices=4) for i in range(2)] == [2, 3]
    # a cluster launcher's per-node index wins
    assert local_cuda_device(cfg, "infer", 1, n_devices=8, local_rank=5) == 5
    assert local_cuda_device(cfg, "train", 0, n_devices=2, local_rank=3) == 1
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        local_cuda_device(cfg, "train", 0, n_devices=0)
    assert training_backend("cpu", []) == "gloo"
    assert training_backend("cuda", ["GPU-a", "GPU-a"]) == "gloo"  # NCCL refuses two ranks on one GPU
    assert training_backend("cuda", ["GPU-a", "GPU-b"]) == "cpu:gloo,cuda:nccl"
    for var in ("LOCAL_RANK", "SLURM_LOCALID"):
        monkeypatch.delenv(var, raising=False)
    assert local_rank_from_env() is None
    monkeypatch.setenv("SLURM_LOCALID", "3")
    assert local_rank_from_env() == 3
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert local_rank_from_env() == 1


def test_bench_quant_device_refused_before_running(refused):
    import torch

    assert "device='tpu': cpu or cuda" in refused("bench-quant", "--device", "tpu")
    if not torch.cuda.is_available():
        assert "device='cuda' but torch.cuda.is_available() is False" in refused("bench-quant", "--device", "cuda")
