"""A method whose draft goes stale (C33; ``TrialConfig(method="tests.helpers.stale_draft:")``):
the reference, except that from its second update on every write into the draft model's tensors
(``draft.*``) is dropped from this rank's plan. The target lands, the draft keeps the first
version's bytes and the update reports success: the harness must name the draft's tensors by
verification (miles#1926: a stale draft collapses speculative acceptance silently)."""
from dataclasses import replace

from weight_transfer.method import ReferenceController, ReferenceInference, ReferenceTrainer


def without_draft_writes(plan):
    """``plan`` (a :class:`~weight_transfer.types.RankPlan`) with no write into a ``draft.*`` tensor
    (the tasks, their gathers and barriers kept: the collectives stay matched across ranks)."""
    def keep(a):
        return replace(a, writes=tuple(w for w in a.writes if not a.recipe.outputs[w.output].tensor.startswith("draft.")))
    return replace(plan, tasks=tuple(replace(t, assignments=tuple(keep(a) for a in t.assignments)) for t in plan.tasks))


class StaleDraftTrainer(ReferenceTrainer):
    updates = 0

    def transfer(self, step):
        if self.updates == 1:
            self.executor.plan = without_draft_writes(self.executor.plan)
        self.updates += 1
        return super().transfer(step)


CONTROLLER, TRAINER, INFERENCE = ReferenceController, StaleDraftTrainer, ReferenceInference
