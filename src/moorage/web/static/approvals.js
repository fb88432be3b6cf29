// moorage dashboard: turns waiting for a person (ctx.interrupt, docs/durable.md) and answering them.
// Loaded before app.js, whose helpers (api, apiSend, el, section, …) these functions call when they run.
"use strict";

// What an interrupt asks, from its run's waiting step: the payload's `question` when that is text, text as it is,
// anything else as JSON (never "[object Object]" or a string in quotes).
function askedOf(detail) {
  const step = detail.steps.filter((s) => s.status === "waiting").pop();
  const payload = step && step.result ? step.result.payload : null;
  const asked = payload && typeof payload === "object" && "question" in payload ? payload.question : payload;
  return typeof asked === "string" ? asked : JSON.stringify(asked);
}

// What the last answer did, shown once by the view it re-rendered (the same view, not one navigated to meanwhile).
let approvalNotice = null;

// The answer buttons send these values, as `moorage answer RUN yes` would: the agent decides what they mean.
const ANSWERS = [["approve", "Approve", "yes"], ["reject", "Reject", "no"]];

// A list of waiting runs (each read in full: GET /v1/workflows/{id}), what each asks, and — for a key that may
// answer — Approve / Reject / Answer… and Cancel buttons. After one the view is drawn again, so the run leaves the
// list (or comes back with the agent's next question) and the notice says what the turn did.
function approvalsList(details, { canAnswer, showUser, emptyText }) {
  const message = el("p.error", { id: "approvals-error", role: "alert" });
  const mine = approvalNotice && approvalNotice.hash === location.hash && approvalNotice.seq === routeSeq;
  const notice = el("p.notice", { id: "approvals-notice", role: "status" }, mine ? approvalNotice.nodes : []);
  if (mine) approvalNotice = null;

  async function act(run, buttons, what, send) {
    buttons.forEach((b) => { b.disabled = true; });
    message.textContent = "";
    notice.replaceChildren();
    try {
      approvalNotice = { hash: location.hash, nodes: await send(), seq: routeSeq + 1 };
      await route();  // the list, the user's events and timeline moved with the turn
    } catch (e) {
      if (e instanceof Unauthorized) { route(); return; }
      message.textContent = `Could not ${what} run ${run.id.slice(0, 12)}: ${e.message}`;
      buttons.forEach((b) => { b.disabled = false; });
    }
  }

  const answer = (run, value, buttons) => act(run, buttons, "answer", async () =>
    answered(run, value, await apiSend("POST", `/v1/workflows/${enc(run.id)}/answer`, { answer: value })));

  const items = details.map((d) => {
    const s = parseScope(d.run.scope);
    const buttons = [];
    if (canAnswer) {
      for (const [cls, label, value] of ANSWERS) {
        const b = el(`button.${cls}`, { type: "button", title: `Answer the interrupt with "${value}"` }, label);
        b.addEventListener("click", () => answer(d.run, value, buttons));
        buttons.push(b);
      }
      const free = el("button.answer", { type: "button", title: "Answer the interrupt with text of your own" }, "Answer…");
      free.addEventListener("click", () => {
        const text = prompt(`Answer to “${askedOf(d)}”:`);
        if (text !== null && text.trim()) answer(d.run, text.trim(), buttons);
      });
      const cancel = el("button.cancel", { type: "button", title: "Stop the turn without an answer: it is not resumed" }, "Cancel turn");
      cancel.addEventListener("click", () => {
        if (!confirm(`Cancel this turn of ${s.user || s.agent} without answering? It will not be resumed.`)) return;
        act(d.run, buttons, "cancel", async () => {
          const out = await apiSend("POST", `/v1/workflows/${enc(d.run.id)}/cancel`);
          return [`Cancelled run ${d.run.id.slice(0, 12)} of `, s.user ? userLink(s.agent, s.user) : s.agent, ": it is ", badge(out.status), "."];
        });
      });
      buttons.push(free, cancel);
    }
    return el("li", { dataset: { run: d.run.id } },
      el("div.question", {}, askedOf(d)),
      el("div.sub", {}, showUser ? [s.user ? userLink(s.agent, s.user) : s.agent, ` of agent ${s.agent} · `] : null,
        `run ${d.run.id.slice(0, 12)} · ${d.run.current_step || ""} · waiting since ${ago(d.run.updated_at)}`),
      buttons.length ? el("div.actions", {}, buttons) : null);
  });
  return [notice, message, items.length ? el("ul.approvals", {}, items) : empty(emptyText),
    details.length && !canAnswer ? el("p.hint", {}, "This key may not answer (that needs the invoke scope).") : null];
}

// The notice after an answer: the turn's outcome, its reply or next question, and a link to its trace.
function answered(run, value, out) {
  const s = parseScope(run.scope);
  const who = s.user ? [userLink(s.agent, s.user), "’s turn"] : [`agent ${s.agent}’s turn`];
  // A key limited to one agent reads its agent's spans of the trace (the API filters them).
  const trace = out.trace_id ? [" (", el("a.trace-link", { href: `#/trace/${enc(out.trace_id)}` }, "trace"), ")"] : [];
  const head = [`Answered “${value}”: `, ...who];
  if (out.status === "waiting") {
    const asked = out.interrupt && typeof out.interrupt === "object" && "question" in out.interrupt
      ? out.interrupt.question : out.interrupt;
    return [...head, " waits again: ", el("span.turn-reply", {}, `“${typeof asked === "string" ? asked : JSON.stringify(asked)}”`), ...trace];
  }
  if (out.status === "done" || out.status === "succeeded") {
    const reply = typeof out.reply === "string" ? out.reply : JSON.stringify(out.reply);
    return [...head, " finished → ", el("span.turn-reply", {}, `“${reply}”`), ...trace];
  }
  return [...head, " ended ", badge(out.status || "unknown"), ...trace];
}

// Every run waiting for a person, the longest-waiting first, 50 a page (`#/approvals/{cursor}` for the next); a
// key limited to one agent lists that agent's (the API takes such a key when the listing names its agent).
async function approvalsView(cursor, who) {
  const agent = who && who.agent;
  const head = el("div.pagehead", {}, el("h1", {}, "Waiting for approval"), agent ? el("span.sub", {}, `agent ${agent}`) : null);
  const [listing, canAnswer] = await Promise.all([
    api(`/v1/workflows?status=waiting&limit=50${agent ? `&agent=${enc(agent)}` : ""}${cursor ? `&cursor=${enc(cursor)}` : ""}`),
    mayUse("invoke"),
  ]);
  const details = await Promise.all(listing.data.map((r) => api(`/v1/workflows/${enc(r.id)}`)));
  const more = listing.next_cursor
    ? el("p.hint", {}, el("a", { href: `#/approvals/${enc(listing.next_cursor)}`, id: "approvals-next" }, "The next 50 waiting →"))
    : null;
  return [head, section(cursor ? "Waiting (a later page)" : "Waiting, the longest first", "approvals",
    approvalsList(details, { canAnswer, showUser: true, emptyText: "Nothing is waiting for an answer." }), more)];
}

// The agent page's panel: its 50 longest-waiting runs, what each asks, and the answer buttons.
async function waitingOfAgent(agent) {
  const [listing, canAnswer] = await Promise.all([
    api(`/v1/workflows?status=waiting&agent=${enc(agent)}&limit=50`),
    mayUse("invoke"),
  ]);
  const details = await Promise.all(listing.data.map((r) => api(`/v1/workflows/${enc(r.id)}`)));
  return section("Waiting for approval", "approvals",
    approvalsList(details, { canAnswer, showUser: true, emptyText: `Nothing of agent ${agent} is waiting.` }),
    listing.next_cursor ? el("p.hint", {}, `The ${details.length} waiting longest are shown; more are waiting.`) : null);
}
