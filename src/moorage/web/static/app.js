// moorage dashboard: a hash-routed page over the JSON API. No build step, no dependencies.
// Data is only ever put into the page with textContent (never innerHTML), so nothing stored by an agent or a
// user can run as script here.
"use strict";

const KEY_STORAGE = "moorage.apiKey";
const view = document.getElementById("view");
const statusEl = document.getElementById("status");

// --- the API -------------------------------------------------------------------------------------------------

class Unauthorized extends Error {}

function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE);
}

async function api(path) {
  const res = await fetch(path, { headers: { Authorization: "Bearer " + apiKey(), Accept: "application/json" } });
  if (res.status === 401) throw new Unauthorized("the key was refused");
  const body = await res.json().catch(() => null);
  if (!res.ok) {
    const detail = body && body.detail ? body.detail : res.statusText;
    throw new Error(`${res.status} ${detail}`);
  }
  return body;
}

// A change through the API (roll back, fork): the API checks the key's scopes, the page only asks.
async function apiSend(method, path, body) {
  const res = await fetch(path, {
    method,
    headers: { Authorization: "Bearer " + apiKey(), Accept: "application/json", "Content-Type": "application/json" },
    body: JSON.stringify(body || {}),
  });
  if (res.status === 401) throw new Unauthorized("the key was refused");
  const out = await res.json().catch(() => null);
  if (!res.ok) {
    const detail = out && out.detail ? out.detail : res.statusText;
    throw new Error(`${res.status} ${detail}`);
  }
  return out;
}

const enc = encodeURIComponent;

// A button that makes one change: asks `question` first where there is one (a confirmation), then runs `act()`; a
// refusal is said in `message` and the button can be pressed again. `spec` is el()'s ("button.delete-webhook").
function actionButton(spec, label, question, message, act) {
  const button = el(spec, { type: "button" }, label);
  button.addEventListener("click", async () => {
    if (question && !confirm(question)) return;
    button.disabled = true;
    message.textContent = "";
    try {
      await act();
    } catch (e) {
      if (e instanceof Unauthorized) { route(); return; }
      message.textContent = `Could not do that: ${e.message}`;
      button.disabled = false;
    }
  });
  return button;
}

// A form that makes one change: on submit, `act()` runs with the form's button disabled; a refusal is said in
// `message` ("Could not <what>: …") and the form can be sent again. Returns the form.
function onSubmitChange(form, message, what, act) {
  const submit = form.querySelector("button[type=submit]");
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    message.textContent = "";
    submit.disabled = true;
    try {
      await act();
    } catch (e) {
      if (e instanceof Unauthorized) { route(); return; }
      message.textContent = `Could not ${what}: ${e.message}`;
    }
    submit.disabled = false;
  });
  return form;
}

// Who the key is (GET /v1/whoami), asked once per key: its scopes decide which changes the page offers (the API
// still checks every one), its agent whether the page shows the whole fleet or that one agent. A server that cannot
// say (null) is taken as a key for the whole tenant with every scope, as before.
let whoami = null;
async function me() {
  if (!whoami || whoami.key !== apiKey()) {
    const key = apiKey();
    whoami = { key, me: await api("/v1/whoami").catch((e) => { if (e instanceof Unauthorized) throw e; return null; }) };
  }
  return whoami.me;
}

async function mayUse(scope) {
  const who = await me();
  return !who || who.scopes.includes("admin") || who.scopes.includes(scope);
}

// Every item of a paged listing (path has a query already): its pages, each `next_cursor` followed, up to maxPages.
async function apiAll(path, maxPages = 20) {
  const data = [];
  let cursor = null;
  for (let i = 0; i < maxPages; i++) {
    const page = await api(cursor ? `${path}&cursor=${enc(cursor)}` : path);
    data.push(...page.data);
    cursor = page.next_cursor;
    if (!cursor) break;
  }
  return { data, more: Boolean(cursor) };
}

// --- DOM helpers ---------------------------------------------------------------------------------------------

// el("tag.class", {attr: value}, ...children): strings become text nodes, so data is never parsed as HTML.
function el(spec, attrs, ...children) {
  const [tag, ...classes] = spec.split(".");
  const node = document.createElement(tag);
  if (classes.length) node.className = classes.join(" ");
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null) continue;
    if (k === "style") Object.assign(node.style, v);
    else if (k === "dataset") Object.assign(node.dataset, v);
    else node.setAttribute(k, v);
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function section(title, id, ...body) {
  return el("section.panel", { id }, el("h2", {}, title), ...body);
}

function table(headers, rows, attrs) {
  return el("table", attrs || {},
    el("thead", {}, el("tr", {}, headers.map((h) => el("th", {}, h)))),
    el("tbody", {}, rows));
}

function empty(text) {
  return el("p.empty", {}, text);
}

function fmtTime(ts) {
  if (ts === null || ts === undefined) return "—";
  return new Date(ts * 1000).toISOString().replace("T", " ").replace(/\.\d+Z$/, "Z");
}

function ago(ts) {
  if (!ts) return "—";
  const s = Math.max(0, Date.now() / 1000 - ts);
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${Math.round(s / 3600)} h ago`;
  return `${Math.round(s / 86400)} d ago`;
}

function fmtBytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

function fmtMs(ms) {
  return ms === null || ms === undefined ? "—" : `${Number(ms).toFixed(1)} ms`;
}

function fmtMoney(v, currency) {
  // Small fleets cost fractions of a cent; two significant digits keep the split visible.
  const n = Number(v);
  return `${n === 0 || n >= 0.01 ? n.toFixed(2) : n.toPrecision(2)} ${currency}`;
}

function badge(state) {
  return el("span.badge.state-" + state.replace(/[^a-z_]/g, ""), {}, state);
}

function parseScope(key) {
  // "session:agent/user/s1", "user:agent/user", "workflow:agent/user/ref" (see Scope.key in the store).
  const [kind, rest] = [key.slice(0, key.indexOf(":")), key.slice(key.indexOf(":") + 1)];
  const [agent, user, ref] = rest.split("/");
  return { kind, agent, user: user === "-" ? null : user, ref };
}

function agentLink(agent) {
  return el("a", { href: `#/agent/${enc(agent)}`, class: "agent-link" }, agent);
}

function userLink(agent, user) {
  return el("a", { href: `#/user/${enc(agent)}/${enc(user)}`, class: "user-link" }, user);
}

// --- views ---------------------------------------------------------------------------------------------------

async function fleetView() {
  const [fleet, spans, waiting, keys] = await Promise.all([
    api("/v1/fleet"),
    recentTraces(),
    api("/v1/workflows?status=waiting&limit=50"),
    keysPanel(),  // keys.js: null for a key without the admin scope
  ]);
  const cards = el("div.cards", {},
    card("Awake", fleet.awake, "card-awake"),
    card("Asleep", fleet.asleep, "card-asleep"),
    card("Instances", fleet.total, "card-total"),
    wakeCard(fleet),
  );

  const rows = fleet.instances.map((i) => el("tr", { dataset: { instance: i.id } },
    el("td.mono", { title: i.id }, i.id.slice(0, 12)),
    el("td", {}, agentLink(i.agent_id)),
    // An agent with one instance per session has several rows per user: the session tells them apart.
    el("td", {}, i.user ? userLink(i.agent_id, i.user) : "—", i.session ? el("span.sub.session", {}, ` · session ${i.session}`) : null),
    el("td", {}, badge(i.state)),
    el("td", { title: fmtTime(i.last_active) }, ago(i.last_active)),
    el("td.num", {}, fmtMs(i.last_wake_ms)),
    el("td.num", {}, fmtBytes(i.ram_bytes)),
    el("td.num", {}, fmtBytes(i.disk_bytes)),
  ));
  const instances = section("Instances", "instances",
    rows.length
      ? table(["Instance", "Agent", "User", "State", "Last activity", "Last wake", "RAM", "Disk"], rows, { id: "instances-table" })
      : empty("No instances yet: invoke an agent to start one."),
    fleet.truncated ? el("p.hint", {}, "Showing the most recently active instances only.") : null);

  return [cards, instances, el("div.columns", {}, costPanel(fleet.cost), waitingPanel(waiting)), tracesPanel(spans),
    keys];
}

function card(label, value, cls, sub) {
  return el("div.card." + cls, {}, el("div.card-label", {}, label), el("div.card-value", {}, String(value)),
    sub ? el("div.card-sub", {}, sub) : null);
}

function wakeCard(fleet) {
  return card("Wake p50 / p95", `${fmtMs(fleet.wake_ms.p50)} / ${fmtMs(fleet.wake_ms.p95)}`, "card-wake",
    `${fleet.wake_ms.count} wakes`);
}

// The fleet's cost split (GET /v1/fleet: the tenant's, or one agent's with ?agent=).
function costPanel(cost) {
  const spend = cost.compute + cost.storage;
  const computePct = spend > 0 ? (100 * cost.compute) / spend : 0;
  return section("Cost (last 30 days)", "cost",
    el("div.costbar", { role: "img", "aria-label": `compute ${computePct.toFixed(0)}%, storage ${(100 - computePct).toFixed(0)}%` },
      el("div.costbar-compute", { style: { width: `${computePct}%` } }),
      el("div.costbar-storage", { style: { width: `${100 - computePct}%` } })),
    el("dl.costs", {},
      el("dt.compute", {}, "Compute"), el("dd", { id: "cost-compute" }, fmtMoney(cost.compute, cost.currency)),
      el("dt.storage", {}, "Storage"), el("dd", { id: "cost-storage" }, fmtMoney(cost.storage, cost.currency)),
      el("dt", {}, "Model calls"), el("dd", { id: "cost-model" }, fmtMoney(cost.model, cost.currency))),
    el("p.hint", {}, `Compute and storage are estimated from ${Math.round(cost.awake_s)} awake and `
      + `${Math.round(cost.asleep_s)} asleep instance-seconds at the default cost model; model calls are metered.`));
}

function waitingPanel(listing) {
  const items = listing.data.map((r) => {
    const s = parseScope(r.scope);
    return el("li", {}, el("span.mono", {}, r.id.slice(0, 12)), " ", r.name || "turn", " · ",
      s.user ? userLink(s.agent, s.user) : s.agent, " · waiting since ", ago(r.updated_at));
  });
  return section("Waiting for approval", "waiting", items.length ? el("ul", {}, items) : empty("Nothing is waiting."),
    listing.next_cursor ? el("p.hint", {}, `The ${items.length} waiting longest are shown; more are waiting (each user's page lists theirs).`) : null,
    items.length ? el("p", {}, el("a", { href: "#/approvals", id: "to-approvals" }, "What each asks, and answer them →")) : null);
}

// Recent spans grouped by trace; a trace's row is named after its root span (the request).
function groupTraces(spans) {
  const traces = new Map();
  const seen = new Set();
  for (const s of spans) {
    // Pages are offsets into a list that grows while they are read: a span can come twice.
    if (seen.has(s.span_id)) continue;
    seen.add(s.span_id);
    const t = traces.get(s.trace_id) || { id: s.trace_id, spans: 0, start: Infinity, end: -Infinity, root: null };
    t.spans += 1;
    t.start = Math.min(t.start, s.start_ts);
    t.end = Math.max(t.end, s.end_ts || s.start_ts);
    if (!s.parent_id) t.root = s;
    traces.set(s.trace_id, t);
  }
  return [...traces.values()];
}

// A read that did nothing else (one GET span): the dashboard's own requests are these, and they would fill the list.
const isPlainRead = (t) => t.spans === 1 && t.root !== null && /^(GET|HEAD) /.test(t.root.name);
const TRACES_SHOWN = 15;

// The newest spans (newest first), page after page until the traces shown are there: each view of this page
// records a few reads of its own, which must not push turns and changes out of the list.
async function recentTraces(agent = null) {
  const spans = [];
  let cursor = null;
  for (let i = 0; i < 4; i++) {
    const page = await api(`/v1/traces?limit=500${agent ? `&agent=${enc(agent)}` : ""}${cursor ? `&cursor=${enc(cursor)}` : ""}`);
    spans.push(...page.data);
    cursor = page.next_cursor;
    if (!cursor || groupTraces(spans).filter((t) => !isPlainRead(t)).length > TRACES_SHOWN) break;
  }
  return spans;
}

function tracesPanel(spans) {
  const traces = groupTraces(spans).filter((t) => !isPlainRead(t));
  const rows = traces.sort((a, b) => b.start - a.start).slice(0, TRACES_SHOWN).map((t) => el("tr", {},
    el("td", {}, el("a.trace-link", { href: `#/trace/${enc(t.id)}` }, t.root ? t.root.name : t.id.slice(0, 16))),
    el("td", { title: fmtTime(t.start) }, ago(t.start)),
    el("td.num", {}, fmtMs((t.end - t.start) * 1000)),
    el("td.num", {}, t.spans)));
  return section("Recent traces", "traces",
    rows.length ? table(["Trace", "Started", "Duration", "Spans"], rows, { id: "traces-table" }) : empty("No spans recorded yet."),
    el("p.hint", {}, "Plain reads (a GET and nothing else, such as this page's own requests) are not listed."));
}

// One agent's users and their instances, its wakes and cost, its deployments, webhooks and secrets: the landing
// page of a key limited to that agent (which names it on every listing that spans agents), and where the fleet's
// agent links lead.
async function agentView(agent, who) {
  const agentInfo = api(`/v1/agents/${enc(agent)}`);  // its live deployment: the deployments panel marks it
  const [info, users, fleet, deployments, webhooks, secrets, waiting, spans, canDelete] = await Promise.all([
    agentInfo,
    api(`/v1/agents/${enc(agent)}/users?limit=200`),
    api(`/v1/fleet?agent=${enc(agent)}&limit=1`),  // its counts, wakes and cost (the instances are the users')
    deploymentsPanel(agent, agentInfo),  // deployments.js
    webhooksPanel(agent),  // webhooks.js
    secretsPanel(agent),  // secrets.js: null for a key without the secrets scope
    waitingOfAgent(agent),  // approvals.js
    recentTraces(agent),  // its users' turns and the requests about them (a key limited to it names it)
    mayUse("deploy"),  // deleting the agent needs it
  ]);
  const cards = el("div.cards", {},
    card("Users", users.data.length + (users.next_cursor ? "+" : ""), "card-total"),
    card("Awake", fleet.awake, "card-awake"),
    card("Asleep", fleet.asleep, "card-asleep"),
    wakeCard(fleet));
  const live = (info.live_deployment ? `live deployment ${info.live_deployment.slice(0, 12)}` : "no live deployment")
    + (info.config && info.config.deleting ? " · being deleted (delete it again to finish)" : "");
  const lastActive = (u) => (u.instance ? u.instance.last_active || 0 : 0);
  const rows = [...users.data].sort((a, b) => lastActive(b) - lastActive(a)).map((u) => el("tr", { dataset: { user: u.id } },
    el("td", {}, userLink(agent, u.id)),
    el("td", {}, u.instance ? badge(u.instance.state) : el("span.sub", {}, "no instance of its own")),
    el("td", { title: fmtTime(u.instance && u.instance.last_active) }, ago(u.instance && u.instance.last_active)),
    el("td", { title: fmtTime(u.created_at) }, ago(u.created_at))));
  const usersPanel = section("Users", "users",
    rows.length ? table(["User", "Instance", "Last activity", "Since"], rows, { id: "users-table" })
      : empty(`Agent ${agent} has no users yet: invoke it to make one.`),
    users.next_cursor ? el("p.hint", {}, `The first ${rows.length} users (by id) are shown; there are more.`) : null);
  const limited = who && who.agent === agent
    ? section("What this key sees", "limited", el("p", {}, `This key is limited to agent ${agent}: it sees this `
        + "agent's users, their memory and timeline, its instances' wakes and cost, its traces, its deployments, its "
        + "webhooks and the turns waiting for approval, and nothing of the tenant's other agents."))
    : null;
  return [el("div.pagehead", {}, el("h1", {}, agent), el("span.sub", {}, `agent · ${live}`),
    canDelete ? deleteAgentButton(agent, who) : null), limited, cards, usersPanel,
    waiting, costPanel(fleet.cost), tracesPanel(spans), deployments, webhooks, secrets];
}

async function userView(agent, user, who, session = null) {
  const base = `/v1/agents/${enc(agent)}/users/${enc(user)}`;
  // The user record first: a user that is not there (a typo, or forgotten) is the API's 404, not an empty page
  // that looks like a user with no data.
  const [agentInfo] = await Promise.all([api(`/v1/agents/${enc(agent)}`), api(base)]);
  const [sessions, facts, waiting, checkpoints, canProvision, canAnswer] = await Promise.all([
    api(`/v1/agents/${enc(agent)}/sessions?user=${enc(user)}&limit=100`),  // the most recently active first
    apiAll(`${base}/facts?limit=500`, 4),  // up to 2,000 current facts; the panel says when there are more
    // All of the agent's waiting runs: the API lists the longest-waiting first and has no per-user filter, so
    // one page could hold only other users' runs. (A key limited to the agent may list them: it names it.)
    apiAll(`/v1/workflows?status=waiting&agent=${enc(agent)}&limit=500`),
    // Time travel may not apply (an agent with one instance per session, zero retention) or the key may lack
    // the scope: the rest of the view still renders, the timeline says why it is empty.
    api(`${base}/checkpoints?limit=${TIMELINE_PAGE}`).catch((e) => {
      if (e instanceof Unauthorized) throw e;
      return { error: e.message };
    }),
    // Rolling back, forking and forgetting the user need it: a read-only key gets no buttons that would fail.
    mayUse("provision"),
    mayUse("invoke"),  // answering an approval needs it
  ]);
  // Turns log their messages in the session's scope, so the episodic events are those of the most recently
  // active sessions, merged with the user-wide ones by time (events.js), each log read back from its end.
  if (session && !sessions.next_cursor && !sessions.data.some((s) => s.id === session)) {
    throw new Error(`${user} has no session '${session}' (its sessions are listed on their page)`);
  }
  // A session picked from the table (`#/user/{agent}/{user}/session/{id}`, any of them, however old): its log alone.
  const recentSessions = [...sessions.data].sort((a, b) => b.last_active - a.last_active).slice(0, 5);
  const sessionLog = (id) => `${base}/events?order=newest&session=${enc(id)}`;
  const logs = session ? [sessionLog(session)] : [`${base}/events?order=newest`, ...recentSessions.map((s) => sessionLog(s.id))];
  const n = recentSessions.length;
  const about = session
    ? [`The log of session ${session} alone. `, el("a", { href: `#/user/${enc(agent)}/${enc(user)}`, id: "events-all" },
        "The user's and their recent sessions' events →")]
    : n ? `The user's own log and the logs of their ${n} most recently active session${n === 1 ? "" : "s"}, merged by `
        + "time (pick a session in the table for its log alone)." : "The user's own log (they have no session yet).";
  const [episodic, summary] = await Promise.all([episodicPanel(logs, about), newestSummary(logs)]);
  // An empty timeline: say why when the live deployment turned automatic checkpoints off.
  let autoOff = false;
  if (!checkpoints.error && !checkpoints.data.length && agentInfo.live_deployment) {
    const deployments = await apiAll(`/v1/agents/${enc(agent)}/deployments?limit=500`, 4);
    const live = deployments.data.find((d) => d.id === agentInfo.live_deployment);
    autoOff = Boolean(live && live.manifest && live.manifest.timetravel && live.manifest.timetravel.auto === false);
  }
  const mine = waiting.data.filter((r) => parseScope(r.scope).user === user);
  // The question of an interrupt is in its waiting step's payload, so each waiting run is read in full.
  const details = await Promise.all(mine.map((r) => api(`/v1/workflows/${enc(r.id)}`)));

  const head = el("div.pagehead", {}, el("h1", {}, user), el("span.sub", {}, "user of agent ", agentLink(agent)),
    canProvision ? forgetUserButton(agent, user) : null);

  const sessionRows = sessions.data.map((s) => el("tr", s.id === session ? { class: "picked" } : {},
    el("td", {}, el("a.session-link", { href: `#/user/${enc(agent)}/${enc(user)}/session/${enc(s.id)}` }, s.id)), el("td", { title: fmtTime(s.created_at) }, ago(s.created_at)),
    el("td", { title: fmtTime(s.last_active) }, ago(s.last_active))));
  const sessionsPanel = section("Sessions", "sessions",
    sessionRows.length ? table(["Session", "Started", "Last active"], sessionRows) : empty("No sessions."),
    sessions.next_cursor ? el("p.hint", {}, `The ${sessionRows.length} most recently active sessions are shown; there are more.`) : null);

  // Working memory lives inside the agent's context builder; the API exposes it only when a summary was
  // written to the episodic log, so that is what is shown.
  const working = section("Working memory", "working",
    summary ? el("blockquote.summary", {}, summary.content)
      : empty("No working-memory summary recorded for this user (it is kept inside the agent's context)."));

  const factRows = facts.data.map((f) => el("tr", {},
    el("td", {}, f.subject), el("td", {}, f.attribute), el("td.fact-value", {}, f.value),
    el("td", {}, f.source || "—"), el("td", { title: fmtTime(f.valid_from) }, ago(f.valid_from))));
  const semantic = section("Facts (current)", "facts",
    factRows.length ? table(["Subject", "Attribute", "Value", "Source", "Since"], factRows, { id: "facts-table" }) : empty("No facts."),
    facts.more ? el("p.hint", {}, `The first ${factRows.length} current facts are shown; there are more.`) : null);

  const approvals = section("Waiting for approval", "approvals",
    approvalsList(details, { canAnswer, emptyText: "Nothing is waiting for this user." }));

  return [head, el("div.columns", {}, approvals, working), el("div.columns", {}, semantic, sessionsPanel), episodic,
    checkpointsPanel(agent, user, checkpoints, agentInfo, autoOff, canProvision)];
}

// What the last change from the timeline did (links to new users): shown once, by the view that change re-rendered,
// and only on the timeline of the user it changed — never on another page navigated to meanwhile.
let timelineNotice = null;

// The timeline reads the newest checkpoints a page at a time: "Show older checkpoints" adds the next page.
const TIMELINE_PAGE = 200;

// The user's timeline: checkpoints of their instance grouped by branch (the current one first), what each
// turn did, where the instance is now, and buttons to roll back to one or fork it into new users.
function checkpointsPanel(agent, user, listing, agentInfo, autoOff, canTravel = true) {
  const title = "Timeline (checkpoints)";
  const lifecycle = (agentInfo && agentInfo.config && agentInfo.config.lifecycle) || {};
  if (lifecycle.scope === "session") {
    // Its instances are the sessions' (docs/timetravel.md): no checkpoint is ever taken for the user.
    return section(title, "checkpoints", empty(`Agent ${agent} runs one instance per session; time travel keeps a `
      + "timeline for per-user instances only ([agent] scope = \"user\")."));
  }
  if (listing.error) return section(title, "checkpoints", el("p.error", {}, `No timeline: ${listing.error}`));
  if (!listing.data.length) {
    return section(title, "checkpoints", empty(autoOff
      ? `No checkpoints: agent ${agent} takes none after its turns ([agent.timetravel] auto = false); those asked for `
        + "(API, CLI, ctx.checkpoint) are listed here."
      : "No checkpoints yet: one is taken after every turn."));
  }
  const base = `/v1/agents/${enc(agent)}/users/${enc(user)}/checkpoints`;
  const bySeq = new Map(listing.data.map((c) => [c.id, c.seq]));
  const ref = (id) => (bySeq.has(id) ? `#${bySeq.get(id)}` : (id || "").slice(0, 10));
  const message = el("p.error", { id: "checkpoints-error", role: "alert" });
  const mine = timelineNotice && timelineNotice.agent === agent && timelineNotice.user === user
    && timelineNotice.seq === routeSeq;
  const notice = el("p.notice", { id: "checkpoints-notice", role: "status" }, mine ? timelineNotice.nodes : []);
  if (mine) timelineNotice = null;

  async function act(button, run) {
    button.disabled = true;
    message.textContent = "";
    notice.replaceChildren();  // what the last change did is not what this one does
    try {
      timelineNotice = { agent, user, nodes: await run(), seq: routeSeq + 1 };  // for the route() below only
      await route();  // the whole view again: files, facts and events moved with the instance
    } catch (e) {
      if (e instanceof Unauthorized) { route(); return; }
      message.textContent = `Could not do that: ${e.message}`;
      button.disabled = false;
    }
  }

  function what(c) {
    const s = c.summary || {};
    const t = s.turn;
    const parts = [];
    if (c.kind === "missing") parts.push(el("span.error", {}, `checkpoint failed: ${s.error || "no reason recorded"}`));
    else if (c.restorable === false) parts.push(el("span.error.unrestorable", {}, "its sandbox half is not there: it cannot be restored"));
    if (t) {
      parts.push(el("span.turn-message", {}, `“${t.message ?? ""}”`));
      // A turn waiting for approval (or one that failed) has no reply: its status badge says why, not an empty “”.
      if (t.reply !== undefined && t.reply !== null) parts.push(" → ", el("span.turn-reply", {}, `“${t.reply}”`));
      if (t.status && t.status !== "succeeded") parts.push(" ", badge(t.status));
      if (t.steps && t.steps.length) parts.push(el("span.steps", {}, ` steps: ${t.steps.map((x) => x.name).join(", ")}`));
    }
    if (s.during_turn) parts.push(el("span.sub", {}, `during turn ${s.during_turn.slice(0, 12)}`));
    if (s.rolled_back_to) parts.push(el("span.sub", {}, `left when rolling back to ${ref(s.rolled_back_to)}`));
    if (s.forked_from) {
      parts.push("forked from ", userLink(agent, s.forked_from.user), el("span.sub", {}, ` at ${s.forked_from.checkpoint.slice(0, 10)}`));
    }
    return parts;
  }

  function row(c, branch) {
    const isHead = c.id === listing.head;
    const buttons = [];
    if (canTravel && c.kind !== "missing" && c.restorable !== false) {
      const back = el("button.rollback", { type: "button", title: "Put files, memory, facts and journal back to this point" },
        branch.current ? "Roll back here" : "Restore");
      back.addEventListener("click", () => {
        if (!confirm(`Roll ${user}'s agent back to checkpoint ${ref(c.id)}? What came after stays restorable as an abandoned branch.`)) return;
        act(back, async () => {
          const out = await apiSend("POST", `${base}/${enc(c.id)}/rollback`);
          return [`Rolled back to ${ref(c.id)} in ${fmtMs(out.ms)}.`];
        });
      });
      const fork = el("button.fork", { type: "button", title: "Copy this point into new users of the agent" }, "Fork…");
      fork.addEventListener("click", () => {
        const answer = prompt("Fork into new user id(s), separated by commas:");
        const users = (answer || "").split(",").map((u) => u.trim()).filter(Boolean);
        if (!users.length) return;
        act(fork, async () => {
          const out = await apiSend("POST", `${base}/${enc(c.id)}/fork`, { to_users: users });
          return [`Forked ${ref(c.id)} into `, ...out.forks.flatMap((f, i) => [i ? ", " : "", userLink(agent, f.user)])];
        });
      });
      buttons.push(back, fork);
    }
    return el("li.ck.kind-" + c.kind.replace(/[^a-z-]/g, "") + (isHead ? ".head" : ""),
      { dataset: { checkpoint: c.id, kind: c.kind, head: isHead ? "true" : "false" } },
      el("span.seq.num", {}, `#${c.seq}`),
      el("span.badge.ck-kind", {}, c.kind),
      c.name ? el("span.ck-name", {}, c.name) : null,
      el("span.what", {}, what(c)),
      el("time", { title: fmtTime(c.created_at) }, ago(c.created_at)),
      isHead ? el("span.here", {}, "◀ current") : null,
      el("span.actions", {}, buttons));
  }

  // The current branch's group holds its own checkpoints and those of the history it grew from (a rollback's
  // target and what came before it, recorded on an older branch): an abandoned branch shows only what was left.
  const inCurrent = (c) => c.current_branch || c.in_history;
  const branches = [...listing.branches].sort((a, b) => (b.current - a.current));
  const groups = branches.map((b) => {
    const cks = listing.data.filter((c) => (b.current ? inCurrent(c) : c.branch === b.id && !inCurrent(c)));  // newest first
    if (!b.current && !cks.length) return null;  // all of it is history of the current branch
    const label = b.current ? "Current branch" : "Abandoned branch";
    const from = b.from ? ` · grew from ${ref(b.from)}` : "";
    return el("div.branch" + (b.current ? ".current" : ".abandoned"), { dataset: { branch: b.id } },
      el("h3", {}, `${label}${from} · ${cks.length} checkpoint${cks.length === 1 ? "" : "s"}`),
      cks.length ? el("ol.checkpoints", {}, cks.map((c) => row(c, b))) : empty("No checkpoint on this branch yet."));
  });
  const shown = `${listing.next_cursor ? "the newest " : ""}${listing.data.length} checkpoint${listing.data.length === 1 ? "" : "s"}`;
  const stats = el("p.hint", {}, `${shown[0].toUpperCase()}${shown.slice(1)} · store ${fmtBytes(listing.store_bytes)}`
    + ` · sandbox ${fmtBytes(listing.sandbox_bytes)} · retention keeps the newest turns, one a day, named ones and every branch's tip.`);
  // Older checkpoints: the next page, added to these (each branch's group then lists its older ones too).
  let older = null;
  if (listing.next_cursor) {
    older = el("button", { id: "checkpoints-more", type: "button" }, "Show older checkpoints");
    older.addEventListener("click", async () => {
      older.disabled = true;
      message.textContent = "";
      try {
        const page = await api(`${base}?limit=${TIMELINE_PAGE}&cursor=${enc(listing.next_cursor)}`);
        const more = { ...listing, data: [...listing.data, ...page.data], next_cursor: page.next_cursor };
        panel.replaceWith(checkpointsPanel(agent, user, more, agentInfo, autoOff, canTravel));
      } catch (e) {
        if (e instanceof Unauthorized) { route(); return; }
        message.textContent = `Could not read older checkpoints: ${e.message}`;
        older.disabled = false;
      }
    });
  }
  const panel = section(title, "checkpoints", stats, notice, message, groups, older);
  return panel;
}

async function traceView(traceId, who) {
  // A key limited to one agent gets that agent's spans of the trace (the API filters them).
  const trace = await api(`/v1/traces/${enc(traceId)}`);
  const spans = trace.spans;
  const t0 = Math.min(...spans.map((s) => s.start_ts));
  const t1 = Math.max(...spans.map((s) => s.end_ts || s.start_ts));
  const total = Math.max(t1 - t0, 1e-6);

  // Depth from the parent links, so children sit under their parent; orphans (a parent outside this trace)
  // are drawn at the top level.
  const byId = new Map(spans.map((s) => [s.span_id, s]));
  const depth = (s, seen = new Set()) => {
    if (!s.parent_id || !byId.has(s.parent_id) || seen.has(s.span_id)) return 0;
    seen.add(s.span_id);
    return 1 + depth(byId.get(s.parent_id), seen);
  };

  // Rows in tree order: each span right after its parent (then its own children), siblings by start. The API
  // lists by start time, which puts a child after any sibling of its parent that started in between.
  const children = new Map();
  const roots = [];
  for (const s of spans) {
    const parent = s.parent_id && byId.has(s.parent_id) && s.parent_id !== s.span_id ? s.parent_id : null;
    if (parent) children.set(parent, [...(children.get(parent) || []), s]);
    else roots.push(s);
  }
  const ordered = [];
  const placed = new Set();
  const visit = (s) => {
    if (placed.has(s.span_id)) return;
    placed.add(s.span_id);
    ordered.push(s);
    for (const c of children.get(s.span_id) || []) visit(c);
  };
  roots.forEach(visit);
  spans.forEach(visit);  // a parent cycle leaves spans unreached from any root: still drawn, in start order

  const rows = ordered.map((s) => {
    const end = s.end_ts || s.start_ts;
    const left = (100 * (s.start_ts - t0)) / total;
    // A zero-length span still gets a visible sliver.
    const width = Math.max((100 * (end - s.start_ts)) / total, 0.4);
    const attrs = Object.entries(s.attrs || {}).filter(([, v]) => v !== null).map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`).join("\n");
    return el("div.span-row", {},
      el("div.span-label", { style: { paddingLeft: `${depth(s) * 14}px` }, title: s.name }, s.name),
      el("div.span-track", {},
        el("div.span-bar.status-" + (s.status === "error" ? "error" : "ok"),
          { style: { left: `${left}%`, width: `${Math.min(width, 100 - left)}%` }, title: `${s.name}\n${fmtMs((end - s.start_ts) * 1000)}\n${attrs}` })),
      el("div.span-ms.num", {}, fmtMs((end - s.start_ts) * 1000)));
  });

  const ticks = [0, 0.25, 0.5, 0.75, 1].map((f) => el("span.tick", { style: { left: `${f * 100}%` } }, fmtMs(f * total * 1000)));
  return [
    el("div.pagehead", {}, el("h1", {}, "Trace"), el("span.sub.mono", {}, traceId)),
    section(`${spans.length} spans · ${fmtMs(total * 1000)} · started ${fmtTime(t0)}`, "timeline",
      el("div.timeline", { id: "timeline" },
        el("div.span-row.axis", {}, el("div.span-label", {}), el("div.span-track", {}, ticks), el("div.span-ms", {})),
        rows)),
  ];
}

// --- routing and sign-in -------------------------------------------------------------------------------------

function showLogin(message) {
  routeSeq++;  // a view still loading must not appear under the sign-in form
  document.getElementById("login").hidden = false;
  document.getElementById("signout").hidden = true;
  view.replaceChildren();
  document.getElementById("login-error").textContent = message || "";
  document.getElementById("key").focus();
}

// Each call of route() draws one view; one the user has left (a later route() began) is dropped when its
// answers come, so a slow view never replaces the one navigated to after it.
let routeSeq = 0;

async function route() {
  const seq = ++routeSeq;
  if (!apiKey()) { showLogin(); return; }
  document.getElementById("login").hidden = true;
  document.getElementById("signout").hidden = false;
  let parts;
  try {
    parts = location.hash.replace(/^#\/?/, "").split("/").map(decodeURIComponent);
  } catch (e) {
    parts = ["malformed"];  // a cut-off or mistyped link (a lone "%"): said so below, not left on the last view
  }
  let render;
  let name = parts[0] || "fleet";
  if (name === "malformed") render = async () => { throw new Error(`this address is not valid: ${location.hash}`); };
  else if (name === "user" && parts.length >= 3) {
    render = (who) => userView(parts[1], parts[2], who, parts[3] === "session" && parts[4] ? parts[4] : null);
  }
  else if (name === "trace" && parts[1]) render = (who) => traceView(parts[1], who);
  else if (name === "agent" && parts[1]) render = (who) => agentView(parts[1], who);
  else if (name === "approvals") render = (who) => approvalsView(parts[1] || null, who);
  else { name = "fleet"; render = fleetView; }
  document.body.dataset.view = name;
  statusEl.textContent = "loading…";
  document.body.dataset.loaded = "";
  try {
    const who = await me();
    const agentOnly = who && who.agent;
    // A key limited to one agent lands on that agent: its page shows that agent's share of the fleet.
    if (name === "fleet" && agentOnly) { name = "agent"; render = () => agentView(who.agent, who); }
    if (seq !== routeSeq) return;
    document.body.dataset.view = name;
    const home = document.querySelector("nav a[data-nav=fleet]");
    home.textContent = agentOnly ? `Agent ${who.agent}` : "Fleet";
    const nodes = await render(who);
    if (seq !== routeSeq) return;
    view.replaceChildren(...[takeDeletedNotice(name), ...nodes].filter(Boolean));  // a panel a view leaves out is null
    statusEl.textContent = `updated ${new Date().toLocaleTimeString()}`;
    document.body.dataset.loaded = name;
  } catch (e) {
    if (seq !== routeSeq) return;  // a view left behind: the current one reports its own errors
    if (e instanceof Unauthorized) {
      sessionStorage.removeItem(KEY_STORAGE);
      showLogin("That key was refused. Enter a valid tenant API key.");
      return;
    }
    statusEl.textContent = "";
    view.replaceChildren(el("p.error", { role: "alert" }, `Could not load this view: ${e.message}`));
    document.body.dataset.loaded = "error";
  }
}

document.getElementById("login-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const input = document.getElementById("key");
  const key = input.value.trim();
  input.value = "";  // the key lives in sessionStorage from here, not in the form
  if (!key) return;
  sessionStorage.setItem(KEY_STORAGE, key);
  route();
});

document.getElementById("signout").addEventListener("click", () => {
  sessionStorage.removeItem(KEY_STORAGE);
  showLogin();
});

window.addEventListener("hashchange", route);
route();
