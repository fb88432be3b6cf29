"""Entry point: ``python3 -m guest --listen /run/moorage/chan.sock`` (or ``--virtio moorage.0`` / ``--fd N``).

Kept tiny so the package also runs as ``python3 path/to/guest``.
"""

import os
import sys

if __package__ in (None, ""):
    # Run as a directory path: make the package importable under its directory name.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = os.path.basename(os.path.dirname(os.path.abspath(__file__)))

import importlib

importlib.import_module(__package__ + ".supervisor").main()
