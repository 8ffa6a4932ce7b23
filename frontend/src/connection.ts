// The page's live connection state: "connected" while the activity stream is open,
// "reconnecting" while it is being opened again, "offline" when the browser is offline.

import { h } from "./dom";

export type State = "connected" | "reconnecting" | "offline";

export class Connection {
  readonly el = h("span", {
    class: "connection",
    "data-testid": "connection",
    "data-state": "reconnecting",
    role: "status",
    "aria-live": "polite",
    text: "connecting…",
  });
  private state: State = "reconnecting";

  constructor() {
    window.addEventListener("offline", () => this.set("offline"));
    window.addEventListener("online", () => this.set("reconnecting"));
  }

  set(state: State): void {
    if (state !== "offline" && !navigator.onLine) state = "offline";
    this.state = state;
    this.el.dataset.state = state;
    this.el.textContent =
      state === "connected" ? "connected" : state === "offline" ? "offline" : "reconnecting…";
  }

  get current(): State {
    return this.state;
  }
}
