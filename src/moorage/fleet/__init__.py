"""A fleet of moorage hosts on one PostgreSQL store and one S3-compatible object store.

``hosts``: registration, heartbeats and liveness; ``ship``: sleeping sandboxes to and from the object store.
"""
