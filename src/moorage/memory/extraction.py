"""Fact extraction from text: the ``FactExtractor`` protocol and a deterministic pattern extractor.

An LLM-backed extractor (through the gateway) implements the same protocol; the pattern one is the offline default.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

#: Attributes that hold several values at once: a new value is added, it does not supersede the others.
MULTI_VALUED = frozenset({"likes", "allergy", "standing_instruction", "speaks"})


@dataclass(frozen=True)
class FactCandidate:
    """A fact proposed by an extractor, before the write policy decides what becomes of it."""

    subject: str
    attribute: str
    value: str
    text: str
    #: The text said it corrects something ("actually, ...", "correction: ...").
    correction: bool = False
    #: ``True`` when the value was inferred rather than stated verbatim (LLM extractors).
    inferred: bool = False


@runtime_checkable
class FactExtractor(Protocol):
    def extract(self, text: str, *, speaker: str | None = None) -> list[FactCandidate]: ...


_SENT_SPLIT = re.compile(r"(?<=[.!?])\s+|\n+")
_CORRECTION = re.compile(r"^\s*(?:actually|correction|sorry|oops|wait|no|update)\b[\s,:;—-]*(?:i\s+meant\s*,?\s*)?", re.I)
_VALUE_END = re.compile(
    r"\s*(?:,|;|\bbut\b|\bbecause\b|\bsince\b|\bso\b|\band\s+i\b|\band\s+my\b|\bthough\b|\bnow\b$"
    r"|\b(?:last|this|next)\s+(?:week|month|year|summer|winter|spring|autumn|fall|weekend)\b"
    r"|\b(?:yesterday|today|recently|lately|a while ago|for now)\b|\b\w+\s+(?:days|weeks|months|years)\s+ago\b"
    r"|\bin\s+(?:19|20)\d\d\b).*$",
    re.I,
)
_NOT_ATTRIBUTE = frozenset(
    "question point guess concern problem idea bad pleasure fault turn answer plan goal issue worry mistake "
    "hope feeling opinion understanding impression suggestion request".split()
)
_QUESTION_START = re.compile(
    r"^\s*(?:what|which|who|whom|whose|where|when|why|how|do|does|did|am|is|are|was|were|can|could|would|will|"
    r"should|shall|have|has|may|might)\b",
    re.I,
)


def _is_question(sentence: str) -> bool:
    return sentence.rstrip().endswith("?") or bool(_QUESTION_START.match(sentence))


_NOT_VALUE_START = re.compile(r"^(?:that|whether|what|how|why|if|not|gone|a bit|kind of|sort of)\b", re.I)

_ATTR = r"(?P<attr>[a-z][a-z'’ -]{0,40}?)"
_VAL = r"(?P<value>[^,;]{1,80})"
_NAMED = r"(?:(?:called|named)\s+)?"
_PATTERNS: list[tuple[re.Pattern[str], str | None]] = [
    (re.compile(r"\bcall me\s+(?P<value>[A-Za-z][\w'-]{0,40})", re.I), "preferred_name"),
    (re.compile(r"\bmy name is\s+" + _VAL, re.I), "name"),
    # "my cat is called Miso": the name is the value, not "called Miso".
    (re.compile(r"\bmy " + _ATTR + r"\s+(?:is now|is|are now|are|has changed to|changed to)\s+" + _NAMED + _VAL, re.I), None),
    (re.compile(r"\bthe user'?s " + _ATTR + r"\s+(?:is|are)\s+" + _NAMED + _VAL, re.I), None),
    (re.compile(r"\bi(?:'ve| have)? (?:just )?moved to\s+" + _VAL, re.I), "lives_in"),
    (re.compile(r"\bi(?:'m| am)? (?:now |currently )?(?:live|living) in\s+" + _VAL, re.I), "lives_in"),
    (re.compile(r"\bi (?:now )?work (?:at|for)\s+" + _VAL, re.I), "employer"),
    (re.compile(r"\bi (?:now )?work as an?\s+" + _VAL, re.I), "occupation"),
    (re.compile(r"\bi(?: really| much| now)? prefer\s+" + _VAL, re.I), "prefers"),
    (re.compile(r"\bi(?: really)? (?:like|love|enjoy)\s+" + _VAL, re.I), "likes"),
    (re.compile(r"\bi(?:'m| am) allergic to\s+" + _VAL, re.I), "allergy"),
    (re.compile(r"\bi speak\s+" + _VAL, re.I), "speaks"),
    (re.compile(r"^\s*(?:please\s+)?(?:from now on|always|never)\b[\s,]*" + r"(?P<value>.{3,160})", re.I), "standing_instruction"),
]


def normalize_attribute(raw: str) -> str:
    a = raw.lower().replace("’", "'").strip()
    a = re.sub(r"'s\b", "", a)
    a = re.sub(r"\b(?:current|new|old|favorite)\b", lambda m: "favourite" if m.group(0) == "favorite" else "", a)
    return re.sub(r"[^a-z0-9]+", "_", a).strip("_")


def normalize_value(raw: str) -> str:
    """Comparable form of a value: case, surrounding punctuation, leading articles and spacing do not count."""
    v = " ".join(raw.casefold().split()).strip(" .!?\"'")
    return re.sub(r"^(?:the|a|an)\s+", "", v)


def _clean_value(raw: str) -> str:
    v = _VALUE_END.sub("", raw.strip())
    return v.strip(" .!?\"'()")


class PatternExtractor:
    """First-person statements ("my X is Y", "I live in Y", "I prefer Y", "call me Y", corrections).

    Deterministic and conservative: it misses paraphrases rather than invent facts. Subject is ``user``.
    """

    def extract(self, text: str, *, speaker: str | None = None) -> list[FactCandidate]:
        out: list[FactCandidate] = []
        seen: set[tuple[str, str]] = set()
        for sentence in (p.strip() for p in _SENT_SPLIT.split(text)):
            if not sentence or _is_question(sentence):
                # "What do I prefer to drink?" asks about a fact; it must never overwrite one.
                continue
            body = sentence
            corr = _CORRECTION.match(body)
            correction = bool(corr and corr.end() > 0)
            if correction and corr:
                body = body[corr.end() :]
            for pattern, fixed in _PATTERNS:
                for hit in pattern.finditer(body):
                    attr = fixed or normalize_attribute(hit.group("attr"))
                    if not attr or attr in _NOT_ATTRIBUTE or len(attr) > 40:
                        continue
                    raw = hit.group("value")
                    value = raw.strip(" .!?") if attr == "standing_instruction" else _clean_value(raw)
                    if not value or _NOT_VALUE_START.match(value):
                        continue
                    key = (attr, normalize_value(value))
                    if key in seen:
                        continue
                    seen.add(key)
                    out.append(FactCandidate("user", attr, value, sentence, correction=correction))
        return _drop_shadowed(out)


def _drop_shadowed(cands: Sequence[FactCandidate]) -> list[FactCandidate]:
    # "my name is Ada" also matches the generic "my X is Y" (attribute "name"): keep one per attribute+value.
    out: list[FactCandidate] = []
    keys: set[tuple[str, str]] = set()
    for c in cands:
        k = (c.attribute, normalize_value(c.value))
        if k not in keys:
            keys.add(k)
            out.append(c)
    return out
