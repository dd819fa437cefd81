"""The push protocol of the public API (:mod:`weight_transfer.api`): its store keys, the
documented error types handed between ranks, the outcome every rank reads, and
:class:`UpdateResult`. Shared by :mod:`weight_transfer.api.coordinator` and
:mod:`weight_transfer.api.sender`.

One push (``Sender.push(v)`` on every training rank, a collective call) goes: every rank
publishes ``push/{n}/ready/{r}``; the coordinator takes one decision for all of them
(``push/{n}/decision``: go, or a refusal each rank raises as the same type); after go, the
controller's keys of version ``v`` (``step/{v}/go``, ``step/{v}/done/{r}``, ...:
:mod:`weight_transfer.control.protocol`); then ``push/{n}/outcome``, set once with ``compare_set`` by the
coordinator (success only once every write completed) or by a training rank that gave up
waiting (a failure), whichever comes first: every rank returns or raises according to it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PUSH_KEY = "push/{n}/{what}"
"""The keys of the ``n``-th push (from 0; every training rank counts its own pushes, a
collective call), values in the data-only encoding (:mod:`weight_transfer.control.wire`: ``Ready``,
``Decision``, ``Outcome``): ``ready/{r}`` (training rank ``r``: ``{"version", "refuse"}``,
``refuse`` a refusal of its own as ``(type name, message)``), ``decision`` (the coordinator:
``{"go", "version", "error"}``, one decision for every rank), ``outcome`` (``{"ok", "error"}``,
set once with ``compare_set``: by the coordinator, or by a training rank that gave up waiting --
whichever comes first holds, so every rank returns or raises alike)."""
COORDINATOR_KEY = "meta/coordinator"
"""``{"host", "pid"}`` of the coordinator's process (published when it plans)."""
TRAIN_PROC_KEY = "meta/train_proc/{rank}"
"""``{"host", "pid"}`` of a training rank's process (published at its first push)."""
PLAN_ERROR_KEY = "plan/error"
"""``(type name, message)`` of a refused plan: every training rank raises it alike."""
WHERE_KEY = "step/{version}/where/{rank}"
"""``{"prepare": (task, seconds) | None, "collective": (task, seconds) | None, "time": wall
seconds}``: what training rank ``rank``'s update to ``version`` was doing, republished
every 0.25 s while it runs (:meth:`weight_transfer.pipeline.executor.Executor.activity`); the coordinator
names a rank that holds the others up from it when the update times out."""
REFUSALS = ("ValueError", "TypeError", "PlanError", "VersionError", "ControlError")
"""The documented error types, handed between ranks as themselves (anything else arrives as ControlError)."""


def _first_line(s: str) -> str:
    return s.splitlines()[0] if s else ""


def _shared(e: BaseException) -> BaseException:
    """Mark ``e`` as an error every training rank raises alike (a refusal or a failed update)."""
    e._wt_shared = True  # type: ignore[attr-defined]
    return e


def _claim_outcome(store, n: int, outcome: dict) -> dict:
    """Set push ``n``'s outcome to ``outcome`` unless one is set; return the one that holds."""
    from ..control import wire

    key = PUSH_KEY.format(n=n, what="outcome")
    return wire.decode(store.compare_set(key, "", wire.encode(outcome)), key)
WORLD_KEY = "meta/world"
"""The coordinator publishes ``{"n_train", "n_infer"}`` here when it starts: how many
training ranks report each update (an engine that commits checks every one of them itself)."""
ENGINE_KEY = "meta/engine"
"""An inference side that knows the model may publish ``{"hf_config": dict, "layout":
InferenceLayout, "name": str}`` here (the vLLM backend does); a :class:`Coordinator` built
without ``model_config`` / ``layout`` reads them from it."""


@dataclass(kw_only=True)
class UpdateResult:
    """One completed update, as the coordinator saw it. Bytes are bytes, seconds wall seconds."""

    version: int
    """The version now published complete."""
    seconds: float
    """From "go" to the last write completion or engine commit (the update's transfer time)."""
    write_seconds: float
    """From "go" to the last training rank's completion."""
    bytes: int
    """Bytes that landed in inference memory (sum over training ranks)."""
    n_writes: int
    """One-sided writes posted (sum over training ranks)."""
    stats: dict[int, Any] = field(default_factory=dict)
    """Training rank -> its :class:`weight_transfer.method.UpdateStats`."""
    commits: dict = field(default_factory=dict)
    """Engine commits: ``("commit", i)`` -> inference rank ``i``'s report, ``("commit", "call")``
    -> what a commit callable returned."""
    verify: str = "off"
    """The end-to-end fingerprint check this update ran (:mod:`weight_transfer.control.fingerprint`):
    ``"off"``, ``"sample"`` or ``"full"``."""
    verified_bytes: int = 0
    """Bytes of inference memory whose fingerprint matched the training side's (0 with
    ``verify="off"``; with ``"sample"`` the part of :attr:`bytes`'s targets checked this update)."""
    verify_seconds: float = 0.0
    """Wall seconds from the request for the receivers' fingerprints to the comparison's end
    (included in :attr:`seconds`)."""

    @property
    def gbps(self) -> float:
        """Algorithm bandwidth of the update: ``bytes / seconds / 1e9`` (GB/s)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("nan")
