"""The ``Store``'s verbs of a local tier (``open(local=...)``): drain, pending, locations."""

from __future__ import annotations

from ..arguments import while_open
from ..errors import BadInputError
from . import DrainReport, PendingStep, Tier


class TierVerbs:
    """What a ``Store`` does with its local tier (``tier``, None without one); mixed into
    ``Store``, whose ``wait``, ``steps`` and ``objects`` these use."""

    tier: Tier | None

    @while_open
    def drain(self, timeout: float | None = None) -> DrainReport | None:
        """Upload every step the local tier holds and the store lacks, oldest first, then keep
        only what the ``local_keep`` newest steps need locally; None without a local tier.

        Waits for a background commit in flight first. Durable in the store when it returns.
        ``timeout`` None: one try (each request with the usual retries); seconds: tries again,
        waiting longer each time, until everything is up or the time is over. Raises, naming
        every step not uploaded: StorageError (the store cannot be reached), ConflictError
        (the store has another commit of a step), NotFoundError (an object a step needs is in
        neither tier). Nothing is lost: what is not uploaded stays in the local tier.
        """
        self.wait()
        return self.tier.drain(timeout) if self.tier is not None else None

    @while_open
    def pending(self) -> list[PendingStep]:
        """The steps committed to the local tier that the store does not have yet, oldest
        first, with their bytes, why their last upload failed and whether the peers' tiers
        hold them too (``replicas``); [] without a local tier."""
        return self.tier.pending() if self.tier is not None else []

    @while_open
    def locations(self) -> dict[int, str]:
        """Where each step is: ``"local"`` (only in this node's tier), ``"local+peer"`` (and
        in its peers' tiers, ``replicas``), ``"both"``, or ``"store"`` (only in the store).
        Every step is ``"store"`` without a local tier."""
        here = self.tier.locations() if self.tier is not None else {}
        return {step: here.get(step, "store") for step in self.steps()}

    def _refuse_tier(self, verb: str) -> None:
        if self.tier is not None:
            raise BadInputError(
                f"{verb} works on the store itself ({self.objects.uri}), not through a local tier: "
                "open it without local= (and CKPTSTORE_LOCAL unset), from any machine"
            )
