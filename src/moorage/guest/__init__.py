"""The guest supervisor: the first process in every sandbox, serving the host over the channel.

Standard library only (Debian 12 python3) and never imports host modules: this directory is copied or
bind-mounted into the sandbox as-is and run with ``python3 -m guest`` (or ``python3 .../guest``).
"""
