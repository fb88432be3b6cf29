// moorage dashboard: forgetting a user (their page) and deleting an agent (its page), each after the operator types
// the name back. Loaded before app.js, whose helpers (api, el, …) these functions call when they run.
"use strict";

// What a forget or a delete did, shown once by the view the page moves to afterwards (the page it was on is gone).
let deletedNotice = null;

function takeDeletedNotice(name) {
  if (!deletedNotice || deletedNotice.view !== name) return null;
  const node = el("p.notice", { id: "deleted-notice", role: "status" }, deletedNotice.text);
  deletedNotice = null;
  return node;
}

// A DELETE answered as server-sent events (`?stream=true`, docs/api.md): each `progress` message to onProgress;
// returns the data of the `answer` event, raises a refusal (before or during the stream) with the API's words.
async function apiStream(path, answer, onProgress) {
  const res = await fetch(path, { method: "DELETE", headers: { Authorization: "Bearer " + apiKey(), Accept: "text/event-stream" } });
  if (res.status === 401) throw new Unauthorized("the key was refused");
  if (!res.ok) {
    const body = await res.json().catch(() => null);
    throw new Error(`${res.status} ${body && body.detail ? body.detail : res.statusText}`);
  }
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffered = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffered += value;
    let end;
    while ((end = buffered.indexOf("\n\n")) >= 0) {
      const lines = buffered.slice(0, end).split("\n");
      buffered = buffered.slice(end + 2);
      const event = (lines.find((l) => l.startsWith("event:")) || "event: message").slice(6).trim();
      const data = lines.filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (!data) continue;  // a keep-alive comment
      const payload = JSON.parse(data);
      if (event === "progress") onProgress(payload.message);
      else if (event === "error") throw new Error(`${payload.status} ${payload.detail}`);
      else if (event === answer) return payload;
    }
  }
  throw new Error("the server ended the answer before it said how it went: reload to see where it got");
}

// A button that asks for `name` to be typed back before it runs `run(say)`; `say` shows how far it got beside it.
function dangerButton(label, id, question, name, run) {
  const button = el("button.danger", { type: "button", id }, label);
  const progress = el("span.sub.progress", { id: `${id}-progress`, role: "status" });
  const message = el("span.error", { id: `${id}-error`, role: "alert" });
  button.addEventListener("click", async () => {
    const typed = prompt(`${question}\n\nType ${name} to confirm:`);
    if (typed === null) return;
    message.textContent = "";
    if (typed.trim() !== name) { message.textContent = `Nothing done: “${typed}” is not ${name}.`; return; }
    button.disabled = true;
    try {
      await run((text) => { progress.textContent = text; });
    } catch (e) {
      if (e instanceof Unauthorized) { route(); return; }
      progress.textContent = "";
      message.textContent = `Could not do that: ${e.message}`;
      button.disabled = false;
    }
  });
  return el("span.danger-zone", {}, button, " ", progress, message);
}

// "Forget user…" (provision scope): DELETE /v1/agents/{agent}/users/{user}, then the agent's page says it.
function forgetUserButton(agent, user) {
  return dangerButton("Forget user…", "forget-user",
    `Forget ${user} of agent ${agent}? Their memory, sessions, checkpoints, instance and files are deleted for good.`,
    user, async (say) => {
      say("forgetting…");
      await apiSend("DELETE", `/v1/agents/${enc(agent)}/users/${enc(user)}`);
      deletedNotice = { view: "agent", text: `Forgot ${user}: everything kept about them for ${agent} is deleted.` };
      location.hash = `#/agent/${enc(agent)}`;
    });
}

// "Delete agent…" (deploy scope): DELETE /v1/agents/{agent}?stream=true, its progress shown as it goes, then the
// fleet says it. A key limited to that agent is revoked with it: the page then asks for another key.
function deleteAgentButton(agent, who) {
  return dangerButton("Delete agent…", "delete-agent",
    `Delete agent ${agent}? Every end-user of it is forgotten and its deployments, secrets and webhooks deleted.`,
    agent, async (say) => {
      say("deleting…");
      const done = await apiStream(`/v1/agents/${enc(agent)}?stream=true`, "deleted", (m) => say(`${m}…`));
      const text = `Deleted agent ${agent}: ${done.users} end-user${done.users === 1 ? "" : "s"} forgotten.`;
      if (who && who.agent === agent) {
        sessionStorage.removeItem(KEY_STORAGE);
        showLogin(`${text} This key was limited to it and was revoked with it.`);
        return;
      }
      deletedNotice = { view: "fleet", text };
      location.hash = "#/fleet";
    });
}
