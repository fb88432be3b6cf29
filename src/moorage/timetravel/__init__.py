"""Time travel for agent instances: checkpoints of the sandbox and the store state together, rollback, fork.

``TimeTravel`` (one per runtime, ``timeline.py``) owns the verbs, forks into new users are ``fork.py``, the policy and
retention rules ``retention.py``; the store half lives in ``moorage.store.repos.checkpoints``.
"""

from moorage.timetravel.retention import Policy, checkpoint_view
from moorage.timetravel.timeline import CheckpointGone, TimeTravel

__all__ = ["CheckpointGone", "Policy", "TimeTravel", "checkpoint_view"]
