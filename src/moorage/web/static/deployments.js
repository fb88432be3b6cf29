// moorage dashboard: an agent's deployments (docs/api.md, agents), newest first, the live one marked; with the
// deploy scope, making an earlier ready one live again (POST /v1/agents/{agent}/rollback) and deleting one that is
// neither live nor building (DELETE …/deployments/{number}). Deploying stays with the CLI and API (it uploads the
// agent's directory). Loaded before app.js, whose helpers (api, el, section, …) these functions call when they run.
"use strict";

const DEPLOYMENTS_SHOWN = 20;

// `agentInfo`: the promise of the agent's record (GET /v1/agents/{agent}), which names its live deployment.
async function deploymentsPanel(agent, agentInfo) {
  const title = "Deployments";
  const base = `/v1/agents/${enc(agent)}`;
  let listing;
  let canChange;
  let liveId;
  try {
    let info;
    [info, listing, canChange] = await Promise.all([agentInfo, api(`${base}/deployments?limit=500`), mayUse("deploy")]);
    liveId = info.live_deployment;
  } catch (e) {
    if (e instanceof Unauthorized) throw e;
    return section(title, "deployments", el("p.error", {}, `No deployments shown: ${e.message}`));
  }
  const message = el("p.error", { id: "deployment-error", role: "alert" });
  const newest = [...listing.data].sort((a, b) => b.number - a.number);
  const rows = newest.slice(0, DEPLOYMENTS_SHOWN).map((d) => {
    const live = d.id === liveId;
    const actions = [];
    if (canChange && !live && d.status === "ready") {
      actions.push(changeButton("make-live", "Make live", null, message, async () => {
        await apiSend("POST", `${base}/rollback`, { number: d.number });
        return `Deployment ${d.number} of ${agent} is live again: users' next turns run it.`;
      }));
    }
    if (canChange && !live && (d.status === "ready" || d.status === "failed")) {
      actions.push(changeButton("delete-deployment", "Delete",
        `Delete deployment ${d.number} of ${agent}? It can no longer be made live; its package is deleted.`, message,
        async () => {
          await apiSend("DELETE", `${base}/deployments/${d.number}`);
          return `Deleted deployment ${d.number} of ${agent}.`;
        }));
    }
    return el("tr", { dataset: { deployment: d.number, status: live ? "live" : d.status } },
      el("td.num", {}, d.number),
      el("td", {}, badge(live ? "live" : d.status)),
      el("td", { title: fmtTime(d.created_at) }, ago(d.created_at)),
      el("td", { title: d.package_sha256 || "" }, el("code", {}, (d.package_sha256 || "").slice(0, 12))),
      canChange ? el("td.actions", {}, actions) : null);
  });
  return section(title, "deployments",
    rows.length ? table(["#", "Status", "Deployed", "Package", ...(canChange ? [""] : [])], rows, { id: "deployments-table" })
      : empty(`Agent ${agent} has no deployments.`),
    newest.length > DEPLOYMENTS_SHOWN ? el("p.hint", {}, `The newest ${DEPLOYMENTS_SHOWN} of ${newest.length} are shown.`) : null,
    message);
}

// A change of one deployment: asks `question` first where there is one, then `run()`, whose words the agent's page,
// drawn again (its live deployment may have changed), shows once.
function changeButton(cls, label, question, message, run) {
  return actionButton(`button.${cls}${question ? ".danger" : ""}`, label, question, message, async () => {
    deletedNotice = { view: "agent", text: await run() };  // deletes.js: shown once by the next drawing
    route();
  });
}
