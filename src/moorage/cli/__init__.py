"""The ``moorage`` command line."""
