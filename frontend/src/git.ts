// git status of the workspace, and a diff view (a file against HEAD).

import { call } from "./api";
import { h } from "./dom";
import { renderUnified } from "./diff";

const NAMES: Record<string, string> = { M: "modified", A: "added", D: "deleted", U: "untracked", C: "conflicted" };

export class Git {
  readonly el: HTMLElement;
  private readonly list: HTMLElement;
  private readonly note: HTMLElement;
  private timer = 0;

  constructor(private readonly showDiff: (path: string) => void) {
    this.list = h("ul", { class: "git-list", "data-testid": "git", "aria-label": "Changed files" });
    // Says something from the start, so the first answer does not move the panels above.
    this.note = h("p", { class: "note", role: "status", text: "Looking for changes…" });
    const refresh = h("button", { type: "button", class: "small", text: "Refresh" });
    refresh.addEventListener("click", () => void this.refresh());
    this.el = h(
      "section",
      { class: "panel git", "aria-label": "Source control" },
      h("div", { class: "toolbar" }, h("h2", { text: "Changes" }), h("span", { class: "spacer" }), refresh),
      this.note,
      this.list,
    );
  }

  /** Refreshes soon (several file events in a row ask once). */
  soon(): void {
    window.clearTimeout(this.timer);
    this.timer = window.setTimeout(() => void this.refresh(), 1000);
  }

  async refresh(): Promise<void> {
    try {
      const status = await call<{ is_repo: boolean; available?: boolean; files: Record<string, string> | [] }>("/api/git/status");
      if (!status.is_repo) {
        this.note.textContent = status.available === false ? "git is not available here" : "Not a git repository";
        this.list.replaceChildren();
        return;
      }
      const files = Object.entries(status.files as Record<string, string>).sort(([a], [b]) => (a < b ? -1 : 1));
      this.note.textContent = files.length ? "" : "No changes";
      this.list.replaceChildren(
        ...files.map(([path, code]) => {
          const b = h(
            "button",
            { type: "button", class: "result", title: `Diff of ${path} against HEAD` },
            h("span", { class: `git-code git-${code}`, text: code, "aria-label": NAMES[code] ?? code }),
            h("span", { class: "name", text: path }),
          );
          b.addEventListener("click", () => this.showDiff(path));
          return h("li", { "data-testid": "git-item", "data-path": path, "data-status": code }, b);
        }),
      );
    } catch (e) {
      this.note.textContent = e instanceof Error ? e.message : "git status failed";
    }
  }
}

export class DiffView {
  readonly el: HTMLElement;
  private readonly title: HTMLElement;
  private readonly body: HTMLElement;

  constructor() {
    this.title = h("h2", { text: "Diff" });
    this.body = h("pre", { class: "diff", "data-testid": "diff-view", tabindex: 0, "aria-label": "Diff" });
    const close = h("button", { type: "button", class: "small", text: "Close diff" });
    close.addEventListener("click", () => (this.el.hidden = true));
    this.el = h("section", { class: "panel diff-panel", "aria-label": "Diff", hidden: true }, h("div", { class: "toolbar" }, this.title, h("span", { class: "spacer" }), close), this.body);
  }

  async show(path: string): Promise<void> {
    this.el.hidden = false;
    this.title.textContent = `${path} against HEAD`;
    this.body.textContent = "loading…";
    try {
      const d = await call<{ diff: string | null; binary: boolean; is_repo: boolean; in_head: boolean; last_agent_change: { actor?: { type: string; id: string }; timestamp?: string } | null }>(
        "/api/v1/file/diff",
        { path },
      );
      if (d.binary) this.body.textContent = "Binary file: no text diff.";
      else renderUnified(this.body, d.diff ?? "");
      const change = d.last_agent_change;
      if (change?.actor) this.title.textContent = `${path} against HEAD — last changed by agent ${change.actor.id}`;
    } catch (e) {
      this.body.textContent = e instanceof Error ? e.message : "no diff";
    }
  }
}
