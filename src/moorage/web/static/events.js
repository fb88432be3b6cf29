// moorage dashboard: a user's episodic memory, newest first, read back from the logs' ends a page at a time.
// Loaded before app.js, whose helpers (api, el, section, …) these functions call when they run.
"use strict";

const EVENTS_PAGE = 25;
const byTime = (a, b) => a.ts - b.ts || a.id - b.id;

// The events of several logs (the user's scope and their recent sessions': a turn logs in its session's), merged
// newest first, `n` at a time. Each log is read back from its end (`order=newest`), one page of EVENTS_PAGE when
// the merge needs its next event: a long history is never loaded whole.
function eventsFeed(paths) {
  const logs = paths.map((path) => ({ path, buffer: [], cursor: null, started: false }));
  const pending = (log) => log.buffer.length > 0 || !log.started || log.cursor !== null;

  async function fill(log) {
    if (log.buffer.length || (log.started && !log.cursor)) return;
    const url = `${log.path}&limit=${EVENTS_PAGE}${log.cursor ? `&cursor=${enc(log.cursor)}` : ""}`;
    const page = await api(url);
    log.started = true;
    log.cursor = page.next_cursor;
    log.buffer.push(...page.data);
  }

  return {
    async next(n) {
      const out = [];
      while (out.length < n) {
        await Promise.all(logs.map(fill));  // a log's next event must be known before the newest can be picked
        const live = logs.filter((l) => l.buffer.length);
        if (!live.length) break;
        const newest = live.reduce((a, b) => (byTime(b.buffer[0], a.buffer[0]) > 0 ? b : a));
        out.push(newest.buffer.shift());
      }
      return out;
    },
    exhausted: () => !logs.some(pending),
  };
}

// The newest summary event (`kind` "summary") of the logs: what the page shows as working memory.
async function newestSummary(paths) {
  const found = await Promise.all(paths.map((p) => api(`${p}&kind=summary&limit=1`)));
  return found.flatMap((page) => page.data).sort(byTime).pop() || null;
}

function eventItem(e) {
  return el("li", { dataset: { event: e.id } },
    el("span.speaker.speaker-" + (e.speaker || "x").replace(/[^a-z]/g, ""), {}, e.speaker || e.kind),
    el("span.content", {}, e.content),
    el("time", { title: fmtTime(e.ts) }, ago(e.ts)));
}

// The panel: the newest EVENTS_PAGE events, and "Older events" for the next ones, until the logs' beginnings.
// `about` says whose logs they are (the user's merged with their recent sessions', or one session's).
async function episodicPanel(paths, about) {
  const feed = eventsFeed(paths);
  const first = await feed.next(EVENTS_PAGE);
  const list = el("ol.events", {}, first.map(eventItem));
  const message = el("p.error", { role: "alert" });
  const older = el("button.older", { type: "button", id: "events-older" }, "Older events");
  older.hidden = feed.exhausted();
  older.addEventListener("click", async () => {
    older.disabled = true;
    message.textContent = "";
    try {
      list.append(...(await feed.next(EVENTS_PAGE)).map(eventItem));
      older.hidden = feed.exhausted();
    } catch (e) {
      message.textContent = `Could not read older events: ${e.message}`;
    }
    older.disabled = false;
  });
  return section("Episodic memory (newest first)", "events",
    first.length ? list : empty("No events."), message, first.length ? el("p.more", {}, older) : null,
    el("p.hint", {}, about));
}
