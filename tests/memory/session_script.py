"""A deterministic long agent session (user, assistant and tool turns) for working-memory tests.

Sizes follow a typical tool-using assistant: a long system prompt, eight tool schemas, short chat turns, bulky tool output.
"""

from __future__ import annotations

import random
from typing import Any, Iterator

TOPICS = [
    ("trip to Lisbon", "flights, the hotel near Alfama, a day trip to Sintra"),
    ("quarterly budget", "cloud spend, two new hires, the travel line"),
    ("garden project", "raised beds, tomato varieties, a drip irrigation timer"),
    ("thesis draft", "chapter three, the related-work section, citation style"),
    ("apartment move", "the lease on Baker Street, movers on the 14th, internet setup"),
    ("running plan", "a half marathon in October, interval sessions, knee pain"),
]

SYSTEM_PROMPT = (
    "You are Skipper, a persistent personal assistant. You remember what the user told you in earlier "
    "sessions and you use your tools when a question needs fresh data. Be brief, be concrete, and say when "
    "you are unsure. Never invent bookings, prices or dates. When a tool fails, say so and offer the next step. "
) * 6


def tool_schemas() -> list[dict[str, Any]]:
    names = ["search_web", "read_calendar", "create_event", "send_email", "get_weather", "convert_currency", "run_python", "read_file"]
    out = []
    for n in names:
        out.append({
            "type": "function",
            "function": {
                "name": n,
                "description": f"{n.replace('_', ' ')}: use it when the user asks for something that needs it; returns JSON.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "query": {"type": "string", "description": "What to look up or do, in plain words."},
                        "limit": {"type": "integer", "description": "How many results at most.", "minimum": 1, "maximum": 50},
                        "when": {"type": "string", "description": "An ISO-8601 date or date-time, if relevant."},
                    },
                    "required": ["query"],
                },
            },
        })
    return out


def session(turns: int, seed: int = 7) -> Iterator[tuple[str, str]]:
    """Yields ``turns`` (role, content) pairs: user, then assistant, sometimes a tool result in between."""
    rng = random.Random(seed)
    produced = 0
    while produced < turns:
        topic, details = rng.choice(TOPICS)
        n = rng.randint(1, 3)
        user = f"About the {topic}: can you check {details.split(', ')[rng.randrange(3)]}? " + "Also " * 0 + rng.choice(
            ["I need it by Friday.", "My budget is 400 euros.", "Keep it short.", f"Last time you said {rng.randint(2, 90)} was fine."]
        ) * n
        yield "user", user
        produced += 1
        if produced < turns and rng.random() < 0.35:
            rows = "; ".join(f"result {i}: {topic} option {rng.randint(100, 999)} at {rng.randint(10, 500)} EUR" for i in range(rng.randint(4, 12)))
            yield "tool", f'{{"tool":"search_web","results":"{rows}"}}'
            produced += 1
        if produced < turns:
            yield "assistant", f"For the {topic}, here is what I found about {details}. " + rng.choice(
                ["The cheapest option looks fine.", "I would wait a week.", "That fits your plan.", "I booked nothing yet; shall I?"]
            ) * rng.randint(1, 4)
            produced += 1
