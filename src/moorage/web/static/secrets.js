// moorage dashboard: an agent's secrets (docs/egress.md), for a key with the secrets scope: their names, versions
// and times (a value is never sent back by the API, so never shown), setting one (a new value is a new version)
// and removing one. End-users' own secrets stay with the API and CLI. Loaded before app.js, whose helpers (api, el,
// section, …) these functions call when they run.
"use strict";

// The names the API takes (api/routes/secrets.py NAME).
const SECRET_NAME = "[A-Z_][A-Z0-9_]{0,127}";

// The panel, or null for a key without the scope (it may not even list the names). `notice`: what the last change
// here did (the panel is drawn again after each).
async function secretsPanel(agent, notice = null) {
  if (!(await mayUse("secrets"))) return null;
  const title = "Secrets";
  const base = `/v1/agents/${enc(agent)}/secrets`;
  let listing;
  try {
    listing = await api(base);
  } catch (e) {
    if (e instanceof Unauthorized) throw e;
    return section(title, "secrets", el("p.error", {}, `No secrets shown: ${e.message}`));
  }
  let panel = null;
  const redraw = async (text) => {
    const next = await secretsPanel(agent, el("p.notice", { id: "secret-notice", role: "status" }, text));
    panel.replaceWith(next);
    panel = next;
  };
  const message = el("p.error", { id: "secret-error", role: "alert" });
  const rows = listing.data.map((s) => el("tr", { dataset: { secret: s.name } },
    el("td", {}, el("code", {}, s.name)),
    el("td.num", {}, s.version),
    el("td", { title: fmtTime(s.updated_at) }, ago(s.updated_at)),
    el("td.actions", {}, removeSecretButton(s.name, `${base}/${enc(s.name)}`, message, redraw))));
  panel = section(title, "secrets", notice,
    el("p.sub", {}, "Added by the host to the requests the agent's policy names (ctx.fetch, the gateway); "
      + "values are never shown, here or by the API."),
    rows.length ? table(["Name", "Version", "Set", ""], rows, { id: "secrets-table" })
      : empty(`Agent ${agent} has no secrets.`),
    message, setSecretForm(base, redraw));
  return panel;
}

function removeSecretButton(name, path, message, redraw) {
  return actionButton("button.danger.remove-secret", "Remove",
    `Remove secret ${name}? Requests that need it fail until it is set again.`, message, async () => {
      await apiSend("DELETE", path);
      await redraw(`Removed secret ${name}.`);
    });
}

// "Set secret": a name and a value (a password field, never put back in the page); an existing name gets a new
// version. The field is emptied once the API has the value.
function setSecretForm(base, redraw) {
  const name = el("input", { type: "text", id: "secret-name", required: "", pattern: SECRET_NAME, placeholder: "API_KEY",
    autocomplete: "off", spellcheck: "false", title: "capitals, digits and _, not starting with a digit" });
  const value = el("input", { type: "password", id: "secret-value", required: "", autocomplete: "new-password" });
  const message = el("span.error", { id: "secret-form-error", role: "alert" });
  const submit = el("button", { type: "submit" }, "Set secret");
  const form = el("form.set-secret", { id: "set-secret" },
    el("label", {}, "Name ", name), el("label", {}, "Value ", value), submit, " ", message);
  return onSubmitChange(form, message, "set it", async () => {
    const set = await apiSend("PUT", `${base}/${enc(name.value.trim())}`, { value: value.value });
    value.value = "";
    await redraw(`Set secret ${set.name} (version ${set.version}).`);
  });
}
