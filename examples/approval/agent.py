"""Refund workflow: look up the order, ask a human to approve, then pay out exactly once.

Each step's result is journaled by moorage before it is returned; if the host dies mid-way, the
turn is resumed and finished steps replay from the journal. The payout carries an idempotency key
so the payment service applies it once even if the call itself is retried.

How to run it (with a stand-in payment service on 127.0.0.1, which the operator must admit with
MOORAGE_EGRESS_ALLOW_CIDRS=127.0.0.0/8): README.md.
"""

import json


async def on_message(ctx, message):
    # message: "refund ORDER AMOUNT PAYMENTS_URL"
    _, order, amount, url = message.split()
    quote = await ctx.step("quote", lambda: {"order": order, "amount": float(amount)})
    approval = await ctx.interrupt({"question": f"Refund {quote['amount']:.2f} for order {order}?", "quote": quote})
    if str(approval).lower() not in ("yes", "approve", "approved"):
        return f"refund for order {order} not approved"

    async def pay(idempotency_key):
        r = await ctx.fetch(url, method="POST", json={"order": order, "amount": quote["amount"]},
                            idempotency_key=idempotency_key)
        if r["status"] >= 500:
            raise RuntimeError(f"payment service answered {r['status']}")
        return json.loads(r["body"])

    receipt = await ctx.step("payout", pay)
    return f"refunded {quote['amount']:.2f} for order {order}, receipt {receipt['receipt']}"
