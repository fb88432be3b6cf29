"""A personal assistant: answers with the model, and remembers what the user told it.

moorage extracts facts from what the user says ("I prefer tea", "my name is Ada") into semantic memory;
this agent reads them back on every turn, so a new session days later still knows them.
"""

SYSTEM = (
    "You are a concise, friendly personal assistant. Use what you know about the user. "
    "Answer in one or two sentences."
)

PREF_WORDS = ("prefer", "like", "favourite", "favorite", "name", "live", "remember", "know about me")


async def on_message(ctx, message):
    facts = await ctx.memory.facts()
    messages = await ctx.memory.context(message, system=SYSTEM)
    out = await ctx.llm.complete(messages)
    reply = out["text"].strip() or "..."
    # The model is small; what the user told us is stated from memory, not left to the model's recall.
    if facts and any(w in message.lower() for w in PREF_WORDS):
        known = "; ".join(f"{f['attribute'].replace('_', ' ')}: {f['value']}" for f in facts)
        reply += f"\n(What I remember about you: {known})"
    return reply
