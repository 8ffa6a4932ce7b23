// The user's threads and sandboxes: state, template, who is attached.

import { call, workspace } from "./api";
import { h } from "./dom";

interface Entry {
  id: string;
  thread: string | null;
  sandbox: string | null;
  name: string | null;
  state: string;
  template: string | null;
  attached: string[] | null;
}

export class Workspaces {
  readonly el: HTMLElement;
  private readonly list: HTMLElement;
  private readonly note: HTMLElement;

  constructor() {
    this.list = h("ul", { class: "workspaces", "data-testid": "workspaces", "aria-label": "Workspaces" });
    this.note = h("p", { class: "note", role: "status" });
    this.el = h("section", { class: "panel workspaces-panel", "aria-label": "Workspaces" }, h("h2", { text: "Workspaces" }), this.note, this.list);
  }

  /** Lists the workspaces again; answers the server's mode (``null`` if it could not say). */
  async refresh(): Promise<string | null> {
    try {
      const answer = await call<{ workspaces: Entry[]; mode: string }>("/api/v1/workspaces", {}, { plain: true });
      this.note.textContent = answer.workspaces.length ? "" : "No workspaces yet.";
      this.list.replaceChildren(...answer.workspaces.map((w) => this.item(w)));
      return answer.mode;
    } catch (e) {
      this.note.textContent = e instanceof Error ? e.message : "could not list workspaces";
      return null;
    }
  }

  private item(w: Entry): HTMLElement {
    const current =
      (w.thread !== null && w.thread === workspace.thread) ||
      (w.sandbox !== null && w.sandbox === workspace.sandbox) ||
      (w.thread === null && w.sandbox === null);
    const href = w.thread ? `/?thread=${encodeURIComponent(w.thread)}` : w.sandbox ? `/?sandbox=${encodeURIComponent(w.sandbox)}` : "/";
    const label = w.thread ?? w.name ?? w.sandbox ?? w.id;
    const who = w.attached?.length ? w.attached.join(", ") : "";
    return h(
      "li",
      {
        class: `workspace-item${current ? " current" : ""}`,
        "data-testid": "workspace-item",
        "data-thread": w.thread ?? undefined,
        "data-sandbox": w.sandbox ?? undefined,
        "data-state": w.state,
      },
      h("a", { href, "aria-current": current ? "page" : undefined, text: label }),
      h("span", { class: `state state-${w.state}`, text: w.state }),
      h("span", { class: "template", text: w.template ?? "" }),
      who ? h("span", { class: "attached", text: `attached: ${who}` }) : null,
    );
  }
}
