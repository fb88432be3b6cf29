"""Webhooks: Standard Webhooks signing, and the delivery loop that drains each tenant's durable outbox.

Deliveries are rows in the tenant's store (``TenantStore.deliveries``); any host may send them, none loses one.
"""

from moorage.webhooks.delivery import Dispatcher, RetrySchedule
from moorage.webhooks.signing import sign, verify

__all__ = ["Dispatcher", "RetrySchedule", "sign", "verify"]
