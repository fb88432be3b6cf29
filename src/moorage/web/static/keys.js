// moorage dashboard: the tenant's API keys on the fleet view, for a key with the admin scope (docs/api.md, keys):
// each key's label, scopes, agent and times (never a secret), making one (its secret shown once) and revoking one
// (every end-user token it issued dies with it). Loaded before app.js, whose helpers (api, el, section, …) these
// functions call when they run.
"use strict";

// The scopes a key may hold: store/model.py's API_KEY_SCOPES (tests/web/test_keys.py compares them).
const KEY_SCOPES = ["admin", "deploy", "invoke", "provision", "read", "secrets"];

// The panel, or null for a key without the admin scope (it may not list keys). `notice`: what the last change here
// did (the panel is drawn again after each).
async function keysPanel(notice = null) {
  const who = await me();
  if (!who || who.agent || !who.scopes.includes("admin")) return null;  // a key limited to an agent lists no keys
  const title = "API keys";
  let listing;
  try {
    listing = await api("/v1/keys?limit=500");
  } catch (e) {
    if (e instanceof Unauthorized) throw e;
    return section(title, "keys", el("p.error", {}, `No keys shown: ${e.message}`));
  }
  let panel = null;
  const redraw = async (node) => {
    const next = await keysPanel(node);
    panel.replaceWith(next);
    panel = next;
  };
  const message = el("p.error", { id: "key-error", role: "alert" });
  const live = listing.data.filter((k) => !k.revoked_at);
  const revoked = listing.data.length - live.length;
  const rows = live.map((k) => el("tr", { dataset: { key: k.id } },
    el("td.mono", {}, k.id, k.id === who.key_id ? el("span.sub", {}, " (this key)") : null),
    el("td", {}, k.label || "—"),
    el("td", {}, k.scopes.join(", ")),
    el("td", {}, k.agent ? agentLink(k.agent) : "every agent"),
    el("td", { title: fmtTime(k.created_at) }, ago(k.created_at)),
    el("td.actions", {}, k.id === who.key_id ? null : actionButton("button.danger.revoke-key", "Revoke",
      `Revoke key ${k.label || k.id}? Whatever uses it stops working, and every end-user token it issued with it.`,
      message, async () => {
        await apiSend("DELETE", `/v1/keys/${enc(k.id)}`);
        await redraw(el("p.notice", { id: "key-notice", role: "status" }, `Revoked key ${k.label || k.id}.`));
      }))));
  panel = section(title, "keys", notice,
    table(["Key", "Label", "Scopes", "Agent", "Made", ""], rows, { id: "keys-table" }),
    revoked ? el("p.hint", {}, `${revoked} revoked key${revoked === 1 ? "" : "s"} not shown.`) : null,
    message, newKeyForm(redraw));
  return panel;
}

// "Make key": a label, its scopes and, optionally, the one agent it may act on. The secret is in the API's answer
// alone: the panel shows it once.
function newKeyForm(redraw) {
  const label = el("input", { type: "text", id: "key-label", placeholder: "label (who uses it)", autocomplete: "off" });
  const agent = el("input", { type: "text", id: "key-agent", placeholder: "every agent", autocomplete: "off" });
  const boxes = KEY_SCOPES.map((s) => el("input", { type: "checkbox", value: s }));
  const message = el("span.error", { id: "key-form-error", role: "alert" });
  const submit = el("button", { type: "submit" }, "Make key");
  const form = el("form.new-key", { id: "new-key" },
    el("label", {}, "Label ", label),
    el("fieldset", {}, el("legend", {}, "Scopes"), boxes.map((b) => el("label", {}, b, " ", b.value))),
    el("label", {}, "Only agent ", agent),
    submit, " ", message);
  return onSubmitChange(form, message, "make it", async () => {
    const scopes = boxes.filter((b) => b.checked).map((b) => b.value);
    if (!scopes.length) { message.textContent = "Tick at least one scope."; return; }
    const key = await apiSend("POST", "/v1/keys", {
      scopes, label: label.value.trim(), ...(agent.value.trim() ? { agent: agent.value.trim() } : {}) });
    await redraw(el("p.notice", { id: "key-notice", role: "status" },
      `Made key ${key.label || key.id} (${key.scopes.join(", ")}${key.agent ? `, agent ${key.agent} only` : ""}). `
      + "Its secret, shown this once: ", el("code.secret", {}, key.secret)));
  });
}
