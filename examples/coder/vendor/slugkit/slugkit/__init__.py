"""Turn text into URL slugs (a tiny package the coder example installs offline)."""

import re


def slugify(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
