"""In-process transfer through the real planner, executor, CMA transport and oracle.

One training rank (this process) holds whole source tensors; the inference ranks' engines
live in this process too, and the one-sided writes go through ``process_vm_writev`` to this
process's own pid -- the same syscall, bounds checks and region descriptors as across
processes. Fast enough to run every layout case of shared/CASES.md on its own inputs
(distinct fill values, odd shapes) instead of synthetic weights.
"""
from weight_transfer.engines import Engine, expected_from_checkpoint
from weight_transfer.executor import Executor
from weight_transfer.plan import build_recipes, plan
from weight_transfer.transport import make_transport
from weight_transfer.types import ParamMeta, dtype_name


def source_metas(sources):
    return {0: [ParamMeta(name=n, global_shape=tuple(t.shape), dtype=dtype_name(t.dtype), mesh_ranks=(0,),
                          placements=("Shard(dim=0)",), local_offset=(0,) * t.dim(), local_shape=tuple(t.shape))
                for n, t in sources.items()]}


class Loopback:
    """Engines for every inference rank of ``layout``, registered once; ``transfer(sources)``
    plans (once) and runs one update; ``verify(sources)`` compares every rank's bytes with
    the engine's own load_weights of the same sources."""

    def __init__(self, cfg, layout, *, poison=True, max_chunk_bytes=64 << 20):
        self.cfg, self.layout = cfg, layout
        self.engines = [Engine(cfg, layout, r) for r in range(layout.world_size)]
        if poison:
            for e in self.engines:
                e.arena.fill_(0xA5)
        self.rx = make_transport("cma")
        self.desc = {r: self.rx.register(e.arena).descriptor() for r, e in enumerate(self.engines)}
        self.tx = make_transport("cma")
        self.tx.connect(list(self.desc.values()))
        self.max_chunk_bytes = max_chunk_bytes
        self.schedule = None

    def plan(self, sources):
        return plan(build_recipes(self.cfg, self.layout, source_dtypes={n: dtype_name(t.dtype) for n, t in sources.items()}),
                    source_metas(sources),
                    {r: e.tensor_metas() for r, e in enumerate(self.engines)}, max_chunk_bytes=self.max_chunk_bytes)

    def transfer(self, sources):
        if self.schedule is None:
            self.schedule = self.plan(sources)
        return Executor(self.schedule.rank_plans[0], sources, self.tx, self.desc).run()

    def verify(self, sources):
        """[(rank, tensor name)] that differ from the oracle (empty when bit-exact)."""
        bad = []
        for r, live in enumerate(self.engines):
            exp = expected_from_checkpoint(self.cfg, self.layout, r, sources.__getitem__,
                                           [n for n in sources if not self._ignored(n)])
            ep = exp.named_parameters()
            for name, t in live.named_parameters().items():
                a = t.view(-1).view(__import__("torch").uint8)
                b = ep[name].contiguous().view(-1).view(__import__("torch").uint8)
                if not bool((a == b).all()):
                    bad.append((r, name))
        return bad

    def _ignored(self, name):
        return False
