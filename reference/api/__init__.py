"""The public API: the reference inside your own trainer and your own inference engine.

Three objects, one per role; each talks to the others only through the job's control-plane
store (:mod:`weight_transfer.control.protocol`; a ``torch.distributed.Store`` only members holding the
job secret can reach, every value sealed and typed: :mod:`weight_transfer.security.secret`,
docs/SECURITY.md) and one-sided writes (the data plane, :mod:`weight_transfer.transport`)::

    # the store: one server, where every process can reach it (here: the launching process,
    # loopback; "0.0.0.0" for other hosts). It makes the job secret and exports it to the
    # processes started from here on; others get WEIGHT_TRANSFER_SECRET(_FILE) in their environment
    store = weight_transfer.serve_store("127.0.0.1", 0)        # store.port: the port picked

    # every inference rank: register its tensors once; nothing runs here per update
    rx = weight_transfer.Receiver(engine_tensors, rank=i, store=(host, port))
    state, weights = rx.read_consistent(lambda: copy_or_forward())   # never a mixed version

    # every training rank, after its FSDP2 module exists
    coord = weight_transfer.Coordinator((host, port), n_train=2, n_infer=2, model_config=cfg,
                                        layout=InferenceLayout(tp=2)) if rank == 0 else None
    tx = weight_transfer.Sender(model, rank=rank, world_size=2, store=(host, port), coordinator=coord)
    for step in ...:
        loss.backward(); optimizer.step()
        stats = tx.push(version=step)         # every rank; returns when version ``step`` is published

- :class:`Sender`: one per training rank, built once from an FSDP2 module or a
  ``{checkpoint name: DTensor}`` mapping (plain tensors with ``world_size == 1``). It publishes
  its parameters' metadata (global shape, dtype, DeviceMesh, placements, its shard's box: no
  byte moves), receives its part of the static schedule once, and on every :meth:`Sender.push`
  replays it through the pipelined executor (``full_tensor()`` only where a recipe needs rows
  of other ranks, fusion, cast -- an fp32 master with bf16 served weights is a planned cast --
  and FP8 block quantization, one-sided writes).
- :class:`Coordinator`: plans once against the receivers' registered layouts (and a live
  engine's runtime layout, when one was published), then per update publishes ``writing v``,
  says "go", waits until every write of every rank completed (and every engine commit), and
  only then publishes ``complete v``; any failure publishes ``incomplete v`` and names role,
  rank and cause. It lives in training rank 0 (pass it to that rank's :class:`Sender`) or in a
  process of its own (:meth:`Coordinator.serve`).
- :class:`Receiver`: one per inference rank, for any engine's named tensors: registers their
  memory once (one region spanning them), publishes the region descriptor and the tensors'
  metadata (inference-side names), and offers the version state and seqlock reads
  (:meth:`Receiver.read_consistent`).

The harness (``weight_transfer.experiments``) is one user of these objects, the vLLM
weight-transfer backend (``weight_transfer.engines.vllm.backend.plugin``) another, and
``examples/train_and_push.py`` a third.

Errors: bad arguments raise ``ValueError``/``TypeError`` naming the argument before any byte
moves; a plan the receivers cannot take raises :class:`weight_transfer.plan.PlanError` naming the
tensor; a failed, dead or stalled rank raises :class:`weight_transfer.errors.ControlError`
naming role, rank and cause, within the control timeout; a version that does not increase
raises :class:`weight_transfer.errors.VersionError`; a process without the job secret, or a
store value no member sealed, raises :class:`weight_transfer.security.secret.AuthenticationError` (a
ControlError) naming how to pass the secret or the key refused; a value its key's schema does
not allow raises :class:`weight_transfer.control.wire.WireError` (a ControlError) naming the key and field.

The room behind these names: :mod:`.sender`, :mod:`.coordinator` and :mod:`.receiver` (the
three roles), :mod:`.update` (the push protocol: its keys, errors and outcome, shared by the
sender and the coordinator) and :mod:`.shadow` (shadow targets on the inference side).
docs/HOW_IT_WORKS.md follows one push through every room.

Imports: ``types``, ``args``, ``options``, ``model_config``, ``metrics``, ``security``, ``transport``, ``plan``, ``delta``, ``pipeline``, ``control``.
"""
from __future__ import annotations

from ..control.store import connect_store, serve_store
from .coordinator import Coordinator, only_ranks, plan_against
from .receiver import Receiver
from .sender import Sender
from .update import (
    COORDINATOR_KEY,
    ENGINE_KEY,
    PLAN_ERROR_KEY,
    PUSH_KEY,
    TRAIN_PROC_KEY,
    WHERE_KEY,
    WORLD_KEY,
    UpdateResult,
)

__all__ = ["Sender", "Receiver", "Coordinator", "UpdateResult", "serve_store", "connect_store", "plan_against",
           "only_ranks", "PUSH_KEY", "WORLD_KEY", "ENGINE_KEY", "COORDINATOR_KEY", "TRAIN_PROC_KEY", "PLAN_ERROR_KEY",
           "WHERE_KEY"]
