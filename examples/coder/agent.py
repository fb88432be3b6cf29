"""A coding agent: installs a package into its own sandbox, writes code that uses it, runs it.

No network is needed: the package ships with the agent (vendor/slugkit) and pip installs it from there.
Everything lands on the sandbox's persistent disk, so the next session finds it still installed.
"""

import os
import sys


async def on_message(ctx, message):
    cmd, _, arg = message.partition(" ")
    if cmd == "install":
        src = os.path.join(ctx.agent.path, "vendor", "slugkit")
        # --user installs into ~/.local on the sandbox's own disk; Debian marks the system Python as
        # externally managed (PEP 668), and a per-user install is exactly what that rule allows for.
        r = await ctx.exec([sys.executable, "-m", "pip", "install", "--user", "--break-system-packages", "--no-index",
                            "--no-build-isolation", "--quiet", "--disable-pip-version-check", src], timeout=300)
        return "installed slugkit" if r["exit_code"] == 0 else "install failed: " + r["stderr"][-400:]
    if cmd == "write":
        ctx.files.write("projects/slug.py", "import sys, slugkit\nprint(slugkit.slugify(' '.join(sys.argv[1:])))\n")
        return "wrote projects/slug.py"
    if cmd == "run":
        r = await ctx.exec([sys.executable, "projects/slug.py", arg])
        return r["stdout"].strip() if r["exit_code"] == 0 else "error: " + r["stderr"].strip()[-300:]
    if cmd == "ls":
        return " ".join(ctx.files.list(arg or "."))
    return "commands: install | write | run TEXT | ls [DIR]"
