"""Fault-injecting methods for end-to-end tests (``TrialConfig(method="faults:")``).

``NoopTrainer`` runs the reference's setup (metadata, plan, connections) but moves nothing and
reports success: the failure kind "update returns OK with no data moved" (C11). The harness
must catch it by verification, not by trusting the method.
"""
from weight_transfer.method import ReferenceController, ReferenceInference, ReferenceTrainer
from weight_transfer.pipeline.executor import StepStats


class NoopTrainer(ReferenceTrainer):
    def transfer(self, step):
        return StepStats(rank=self.executor.plan.rank)


CONTROLLER, TRAINER, INFERENCE = ReferenceController, NoopTrainer, ReferenceInference
