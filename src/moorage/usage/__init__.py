"""Per-end-user usage and caps: what a user of an agent consumed (awake seconds, tokens, cost) and the limits
on it (``moorage.usage.caps``)."""
