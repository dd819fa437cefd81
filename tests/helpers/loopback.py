"""In-process transfer through the real planner, executor, CMA transport and oracle.

One training rank (this process) holds whole source tensors; the inference ranks' engines
live in this process too, and the one-sided writes go through ``process_vm_writev`` to this
process's own pid -- the same syscall, bounds checks and region descriptors as across
processes. Fast enough to run every layout case of shared/CASES.md on its own inputs
(distinct fill values, odd shapes) instead of synthetic weights.

Like a trainer, the loopback keeps one set of source tensors and one executor for its life:
the first ``transfer(sources)`` copies ``sources`` into tensors of its own (same shapes,
strides and dtypes) and builds the executor (which registers their memory once); later
transfers copy the new values in place and run the same executor, so no update registers.
``transport`` names the back end (``cma``; ``shm``: the engines' arenas are allocated through it).
"""
import torch

from weight_transfer.engines import Engine, expected_from_checkpoint
from weight_transfer.pipeline.executor import Executor
from weight_transfer.plan import build_recipes, plan
from weight_transfer.plan.metadata import whole_metas
from weight_transfer.transport import make_transport
from weight_transfer.types import dtype_name


def source_metas(sources):
    return {0: whole_metas(sources, 0)}


class Loopback:
    """Engines for every inference rank of ``layout``, registered once; ``transfer(sources)``
    plans (once) and runs one update; ``verify(sources)`` compares every rank's bytes with
    the engine's own load_weights of the same sources."""

    def __init__(self, cfg, layout, *, poison=True, max_chunk_bytes=64 << 20, transport="cma", options=None,
                 landing: float | None = None, **executor_kw):
        self.cfg, self.layout = cfg, layout
        self.rx = make_transport(transport)
        allocate = self.rx.allocate if self.rx.publishes_allocated_only else None
        self.engines = [Engine(cfg, layout, r, allocate=allocate) for r in range(layout.world_size)]
        if poison:
            for e in self.engines:
                e.arena.fill_(0xA5)
        self.regions = {r: self.rx.register(e.arena) for r, e in enumerate(self.engines)}
        self.desc = {r: reg.descriptor() for r, reg in self.regions.items()}
        self.landings = {}
        """Inference rank -> :class:`weight_transfer.delta.packed.Landing` (``landing``: a
        fraction of each arena registered for packed deltas, committed by :meth:`transfer`)."""
        if landing:
            from weight_transfer.delta.packed import Landing

            self.landings = {r: Landing(Landing.size_for(e.arena.numel(), landing), self.rx)
                             for r, e in enumerate(self.engines)}
        self.tx = make_transport(transport)
        self.tx.connect(list(self.desc.values()) + [x.descriptor for x in self.landings.values()])
        self.commits = {}
        """Inference rank -> the last commit's stats."""
        self.max_chunk_bytes = max_chunk_bytes
        self.options, self.executor_kw = options, executor_kw
        self.schedule = self.executor = self.sources = None

    def plan(self, sources):
        return plan(build_recipes(self.cfg, self.layout, source_dtypes={n: dtype_name(t.dtype) for n, t in sources.items()}),
                    source_metas(sources),
                    {r: e.tensor_metas() for r, e in enumerate(self.engines)}, max_chunk_bytes=self.max_chunk_bytes)

    def setup(self, sources):
        """Plan once and build the executor (it registers its memory now) over tensors of our own
        holding ``sources``; returns the executor."""
        if self.executor is None:
            self.schedule = self.plan(sources)
            self.sources = {n: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).copy_(t) for n, t in sources.items()}
            self.executor = Executor(self.schedule.rank_plans[0], self.sources, self.tx, self.desc, options=self.options,
                                     landing={r: x.descriptor for r, x in self.landings.items()}, **self.executor_kw)
        return self.executor

    def transfer(self, sources):
        """One update carrying ``sources`` (the first one plans and builds the executor)."""
        if self.executor is None:
            self.setup(sources)
        else:
            for n, t in sources.items():
                self.sources[n].copy_(t)  # the trainer updates its shards in place
        st = self.executor.run()
        self.commit(st.step)
        return st

    def commit(self, version):
        """Every engine's commit of ``version``: scatter its packed records (none: nothing)."""
        self.commits = {r: self.engines[r].commit_delta(x, version) for r, x in self.landings.items()}
        return self.commits

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
