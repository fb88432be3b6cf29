"""A credential value that never shows itself in repr, str, logs or error messages.

Only the provider adapter that puts it on the wire calls ``reveal()``.
"""

from __future__ import annotations


class Secret:
    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def redact(self, text: str) -> str:
        """``text`` with every occurrence of the secret replaced (for upstream error bodies that echo it)."""
        if not self._value:
            return text
        out = text.replace(self._value, "***")
        # Providers often echo a truncated key ("sk-abc...xyz"); hide any long prefix of it too.
        if len(self._value) >= 12:
            out = out.replace(self._value[:8], "***")
        return out

    def __bool__(self) -> bool:
        return bool(self._value)

    def __repr__(self) -> str:
        return "Secret('***')" if self._value else "Secret('')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(("Secret", self._value))

    def __reduce__(self) -> object:
        raise TypeError("a Secret cannot be pickled or copied out of the gateway")
