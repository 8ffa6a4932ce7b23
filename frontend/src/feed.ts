// The activity feed: every command (who ran it, its exit code) and every file change
// (who made it), newest first, from the workspace's ordered event log.

import { h, shortTime } from "./dom";
import type { WorkspaceEvent } from "./events";

const KEEP = 300;
/** The longest the log's past waits for the page to be idle, in ms. */
const BACKLOG_WAIT = 200;

export class Feed {
  readonly el: HTMLElement;
  private readonly list: HTMLElement;
  private readonly execs = new Map<string, HTMLElement>();
  private waiting: WorkspaceEvent[] | null = null;

  constructor(
    private readonly openFile: (path: string) => void,
    private readonly openDiff: (path: string) => void,
  ) {
    this.list = h("ol", { class: "feed", "data-testid": "feed", "aria-label": "Activity", reversed: true });
    this.el = h("section", { class: "panel feed-panel", "aria-label": "Activity" }, h("h2", { text: "Activity" }), this.list);
  }

  /** The log's past the page opened on: shown once the page has drawn what it needs
   * first (at most BACKLOG_WAIT ms later); events that come meanwhile wait behind it. */
  backlog(events: WorkspaceEvent[]): void {
    if (this.waiting) {
      this.waiting.push(...events);
      return;
    }
    this.waiting = [...events];
    const show = (): void => {
      const waiting = this.waiting ?? [];
      this.waiting = null;
      this.render(waiting);
    };
    if (typeof window.requestIdleCallback === "function") window.requestIdleCallback(show, { timeout: BACKLOG_WAIT });
    else window.setTimeout(show, 50);
  }

  apply(events: WorkspaceEvent[]): void {
    if (this.waiting) this.waiting.push(...events);
    else this.render(events);
  }

  private render(events: WorkspaceEvent[]): void {
    const items: HTMLElement[] = [];
    for (const event of events.slice(-KEEP)) {
      const item = this.item(event);
      if (item) items.push(item);
    }
    if (!items.length) return;
    items.reverse();
    this.list.prepend(...items);
    while (this.list.childElementCount > KEEP) this.list.lastElementChild?.remove();
  }

  private item(event: WorkspaceEvent): HTMLElement | null {
    const actor = event.actor?.type === "agent" ? "agent" : event.actor?.type === "human" ? "human" : "unknown";
    const who = event.actor ? `${actor} ${event.actor.id}` : "unknown";
    const time = h("time", { datetime: event.timestamp, text: shortTime(event.timestamp) });
    const exec = event.details.exec;
    if (exec) {
      const id = exec.exec_id ?? "";
      if (event.event_type === "exec.started") {
        const command = exec.command ?? "";
        const li = h(
          "li",
          { class: `feed-item actor-${actor}`, "data-testid": "feed-item", "data-kind": "exec", "data-actor": actor, "data-exec": id, "data-command": command },
          time,
          h("span", { class: "who", text: who }),
          h("code", { class: "command", text: command }),
          h("span", { class: "exit", text: "running" }),
        );
        this.execs.set(id, li);
        return li;
      }
      const started = this.execs.get(id);
      const code = exec.exit_code;
      const text = exec.status === "killed" ? `killed${exec.signal ? ` (${exec.signal})` : ""}` : `exit ${code ?? "?"}`;
      if (started) {
        started.dataset.exit = String(code ?? "");
        const exit = started.querySelector(".exit");
        if (exit) {
          exit.textContent = text;
          exit.className = `exit ${code === 0 ? "ok" : "failed"}`;
        }
        this.execs.delete(id);
        return null;
      }
      // Its start is older than the page: a line of its own.
      return h(
        "li",
        { class: `feed-item actor-${actor}`, "data-testid": "feed-item", "data-kind": "exec", "data-actor": actor, "data-exec": id, "data-exit": String(code ?? "") },
        time,
        h("span", { class: "who", text: who }),
        h("code", { class: "command", text: `command ${id}` }),
        h("span", { class: `exit ${code === 0 ? "ok" : "failed"}`, text }),
      );
    }
    const fs = event.details.fs;
    if (fs && event.path) {
      const path = event.path;
      const op = fs.op ?? "changed";
      const open = h("button", { type: "button", class: "link", text: path, title: `Open ${path}` });
      open.addEventListener("click", () => this.openFile(path));
      const diff = h("button", { type: "button", class: "link small", text: "diff", "aria-label": `Diff of ${path}` });
      diff.addEventListener("click", () => this.openDiff(path));
      return h(
        "li",
        { class: `feed-item actor-${actor}`, "data-testid": "feed-item", "data-kind": "file", "data-actor": actor, "data-path": path, "data-op": op },
        time,
        h("span", { class: "who", text: who }),
        h("span", { class: "op", text: event.from ? `moved from ${event.from} to` : op }),
        open,
        op === "deleted" ? null : diff,
      );
    }
    return null;
  }
}
