// moorage dashboard: an agent's webhooks and their recent deliveries (docs/api.md, webhooks); with the deploy scope,
// adding a webhook (its secret shown once), deleting one, and "Send again" for a delivery that is not pending.
// Loaded before app.js, whose helpers (api, el, section, …) these functions call when they run.
"use strict";

// The events a webhook may ask for: store/webhooks.py's WEBHOOK_EVENTS (tests/web/test_webhooks.py compares them).
const WEBHOOK_EVENTS = ["execution.succeeded", "execution.failed", "execution.cancelled", "interrupt.waiting", "fact.pending"];

const DELIVERIES_SHOWN = 10;

function until(ts) {
  if (!ts) return "—";
  const s = ts - Date.now() / 1000;
  return s <= 0 ? "due now" : `in ${ago(Date.now() / 1000 - s).replace(" ago", "")}`;
}

// What a delivery's last attempt got back: the receiver's status code, or why nothing came back.
function lastAnswer(d) {
  const log = d.attempt_log || [];
  const last = log[log.length - 1];
  if (!last) return d.attempts ? "—" : "not tried yet";
  const code = last.status_code === null || last.status_code === undefined ? "no answer" : `HTTP ${last.status_code}`;
  return last.error ? `${code}: ${last.error}` : code;
}

// One delivery's row; `replay(d, row)`, where the key may send deliveries again, backs a "Send again" button on
// one that is not pending (a pending one is tried anyway).
function deliveryRow(d, agent, replay = null) {
  const data = (d.payload && d.payload.data) || {};
  let again = null;
  if (replay && d.status !== "pending") {
    again = el("button.replay", { type: "button", title: "POST …/deliveries/{id}/replay: try it again now" }, "Send again");
    again.addEventListener("click", () => { again.disabled = true; replay(d, row); });
  }
  const row = el("tr", { dataset: { delivery: d.id, status: d.status } },
    el("td", {}, d.event),
    el("td", {}, data.user ? userLink(data.agent || agent, data.user) : "—"),
    el("td", {}, badge(d.status)),
    el("td.num", {}, d.attempts),
    el("td.last-answer", {}, d.status === "delivered" ? "" : lastAnswer(d)),
    el("td", { title: fmtTime(d.next_attempt_at) }, d.status === "pending" ? until(d.next_attempt_at) : "—"),
    el("td", { title: fmtTime(d.created_at) }, ago(d.created_at)),
    replay ? el("td.actions", {}, again) : null);
  return row;
}

// How long the page follows a delivery sent again before it leaves the row as it last read it.
const REPLAY_FOLLOW_MS = 15000;

// Each webhook of the agent (GET /v1/agents/{agent}/webhooks: its URL and events; the secret is never shown) with
// its newest deliveries (…/deliveries?limit=10), and "Older deliveries" for the next 10 (its next_cursor). The listing carries no attempt log, so a delivery that has not
// arrived after an attempt is read in full (…/deliveries/{id}) to say what its receiver answered.
// `notice`: what the last change here did (the panel is drawn again after each), shown above the webhooks.
async function webhooksPanel(agent, notice = null) {
  const title = "Webhooks";
  let hooks;
  let canChange;
  try {
    [hooks, canChange] = await Promise.all([api(`/v1/agents/${enc(agent)}/webhooks`), mayUse("deploy")]);
  } catch (e) {
    if (e instanceof Unauthorized) throw e;
    return section(title, "webhooks", el("p.error", {}, `No webhooks shown: ${e.message}`));
  }
  let panel = null;
  const redraw = async (text) => {
    const next = await webhooksPanel(agent, text);
    panel.replaceWith(next);
    panel = next;
  };
  const form = canChange ? addWebhookForm(agent, redraw) : null;
  if (!hooks.data.length) {
    panel = section(title, "webhooks", notice,
      empty(`Agent ${agent} has no webhooks${form ? "" : ` (POST /v1/agents/${agent}/webhooks adds one)`}.`), form);
    return panel;
  }
  const blocks = await Promise.all(hooks.data.map(async (h) => {
    const base = `/v1/agents/${enc(agent)}/webhooks/${enc(h.id)}`;
    const message = el("p.error", { role: "alert" });
    // Send one again: its row follows it (pending, then delivered or failed with the receiver's answer).
    const replay = canChange ? async (d, row) => {
      message.textContent = "";
      let current = row;
      try {
        let now = await apiSend("POST", `${base}/deliveries/${enc(d.id)}/replay`);
        for (const start = Date.now(); ; await new Promise((ok) => setTimeout(ok, 500))) {
          if (now.status !== "pending" || Date.now() - start > REPLAY_FOLLOW_MS) break;
          const next = deliveryRow(now, agent, replay);
          current.replaceWith(next);
          current = next;
          now = await api(`${base}/deliveries/${enc(d.id)}`);
        }
        current.replaceWith(deliveryRow(now, agent, replay));
      } catch (e) {
        if (e instanceof Unauthorized) { route(); return; }
        message.textContent = `Could not send it again: ${e.message}`;
        current.replaceWith(deliveryRow(d, agent, replay));
      }
    } : null;
    // A page of deliveries, newest first, each one tried but not delivered read in full for its attempt log.
    const page = async (cursor) => {
      const listing = await api(`${base}/deliveries?limit=${DELIVERIES_SHOWN}${cursor ? `&cursor=${enc(cursor)}` : ""}`);
      const rows = await Promise.all(listing.data.map((d) => (d.status !== "delivered" && d.attempts > 0
        ? api(`${base}/deliveries/${enc(d.id)}`) : d)));
      return { rows: rows.map((d) => deliveryRow(d, agent, replay)), cursor: listing.next_cursor };
    };
    const first = await page(null);
    let cursor = first.cursor;
    const body = el("tbody", {}, first.rows);
    const older = el("button.older", { type: "button" }, "Older deliveries");
    older.hidden = !cursor;
    older.addEventListener("click", async () => {
      older.disabled = true;
      message.textContent = "";
      try {
        const next = await page(cursor);
        body.append(...next.rows);
        cursor = next.cursor;
        older.hidden = !cursor;
      } catch (e) {
        if (e instanceof Unauthorized) { route(); return; }
        message.textContent = `Could not read older deliveries: ${e.message}`;
      }
      older.disabled = false;
    });
    const headers = ["Event", "User", "Status", "Attempts", "Last answer", "Next attempt", "Created",
      ...(replay ? [""] : [])];
    return el("div.webhook", { dataset: { webhook: h.id } },
      el("h3", {}, el("span.webhook-url", {}, h.url), " ", h.enabled === false ? badge("disabled") : null,
        canChange ? deleteWebhookButton(h, base, message, redraw) : null),
      el("p.sub", {}, `${h.id} · events: ${h.events.join(", ")} · since ${fmtTime(h.created_at)}`),
      first.rows.length
        ? el("table.deliveries", {}, el("thead", {}, el("tr", {}, headers.map((x) => el("th", {}, x)))), body)
        : empty("No deliveries yet."),
      message, first.cursor ? el("p.more", {}, older) : null);
  }));
  panel = section(title, "webhooks", notice, blocks, form);
  return panel;
}

// "Delete" on a webhook (deploy scope; DELETE …/webhooks/{id}): its deliveries go with it, pending ones unsent.
function deleteWebhookButton(h, base, message, redraw) {
  return actionButton("button.danger.delete-webhook", "Delete",
    `Delete the webhook to ${h.url}? Its deliveries go with it; pending ones are not sent.`, message, async () => {
      await apiSend("DELETE", base);
      await redraw(el("p.notice", { id: "webhook-notice", role: "status" }, `Deleted the webhook to ${h.url}.`));
    });
}

// "Add webhook" (deploy scope; POST /v1/agents/{agent}/webhooks): a URL and the events it wants (none ticked: all
// of them). Its signing secret is in the answer alone: the panel shows it once, to be kept by whoever checks
// the signatures.
function addWebhookForm(agent, redraw) {
  const url = el("input", { type: "url", id: "webhook-url", required: "", placeholder: "https://example.com/hooks/moorage" });
  const boxes = WEBHOOK_EVENTS.map((e) => el("input", { type: "checkbox", value: e }));
  const message = el("span.error", { id: "webhook-error", role: "alert" });
  const submit = el("button", { type: "submit" }, "Add webhook");
  const form = el("form.add-webhook", { id: "add-webhook" },
    el("label", {}, "URL ", url),
    el("fieldset", {}, el("legend", {}, "Events (none ticked: every event)"),
      boxes.map((b) => el("label", {}, b, " ", b.value))),
    submit, " ", message);
  return onSubmitChange(form, message, "add it", async () => {
    const events = boxes.filter((b) => b.checked).map((b) => b.value);
    const hook = await apiSend("POST", `/v1/agents/${enc(agent)}/webhooks`,
      { url: url.value.trim(), ...(events.length ? { events } : {}) });
    await redraw(el("p.notice", { id: "webhook-notice", role: "status" },
      `Added the webhook to ${hook.url} (${hook.id}). Its signing secret, shown this once: `,
      el("code.secret", {}, hook.secret)));
  });
}
