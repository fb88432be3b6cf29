"""A note-keeping agent: every message is appended to notes.txt on the user's own sandbox disk, and the reply
(streamed word by word) says how many notes the user has. No model is needed."""


async def on_message(ctx, message):
    try:
        notes = ctx.files.read("notes.txt")
    except Exception:
        notes = ""
    notes += message.replace("\n", " ") + "\n"
    ctx.files.write("notes.txt", notes)
    count = notes.count("\n")
    reply = f"noted ({count} so far): {message}"
    for word in reply.split(" "):
        await ctx.emit("token", word + " ")
    return reply
