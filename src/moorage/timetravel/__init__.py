"""Time travel for agent instances: checkpoints of the sandbox and the store state together, rollback, fork.

``TimeTravel`` (one per runtime) owns the verbs; the store half lives in ``moorage.store.repos.checkpoints``.
"""

from moorage.timetravel.timeline import CheckpointGone, Policy, TimeTravel, checkpoint_view

__all__ = ["CheckpointGone", "Policy", "TimeTravel", "checkpoint_view"]
