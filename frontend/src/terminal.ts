// Terminals: tabs over the workspace's shared shells (/ws/pty). Every tab is a shell the
// CLI can attach to by name; observers watch, drivers type. A lost socket reattaches from
// the last byte seen (nothing lost, nothing twice); a reloaded page reattaches its tabs and
// gets the shell's recent output back. Output is written once per frame, in one piece.

import { Terminal } from "@xterm/xterm";
import { FitAddon } from "@xterm/addon-fit";
import "@xterm/xterm/css/xterm.css";
import { wsUrl } from "./api";
import { h } from "./dom";

type Role = "driver" | "observer";

interface Frame {
  type: string;
  data?: string;
  offset?: number;
  session_id?: string;
  name?: string;
  role?: string;
  code?: number;
  from?: number;
  to?: number;
  error?: { code?: string; message?: string };
}

interface Saved {
  name: string;
  sessionId: string | null;
  role: Role;
}

const STORE = `sandlot.terminals.${location.search}`;
const encoder = new TextEncoder();

const DARK = { background: "#1b1d23", foreground: "#d7dae0", cursor: "#d7dae0", selectionBackground: "#3e4451" };
const LIGHT = { background: "#fbfbfc", foreground: "#1f2328", cursor: "#1f2328", selectionBackground: "#c8d7f0" };

class Tab {
  readonly term: Terminal;
  readonly fit = new FitAddon();
  readonly pane: HTMLElement;
  readonly button: HTMLButtonElement;
  ws: WebSocket | null = null;
  sessionId: string | null;
  offset = -1;
  ended = false;
  closed = false;
  private pending: string[] = [];
  private scheduled = false;
  private retry = 500;

  constructor(
    public name: string,
    public role: Role,
    sessionId: string | null,
    private readonly owner: Terminals,
  ) {
    this.sessionId = sessionId;
    this.term = new Terminal({
      fontFamily: "ui-monospace, SFMono-Regular, Menlo, Consolas, monospace",
      fontSize: 13,
      scrollback: 5000,
      cursorBlink: true,
      theme: document.documentElement.dataset.theme === "dark" ? DARK : LIGHT,
      screenReaderMode: false,
    });
    this.term.loadAddon(this.fit);
    this.pane = h("div", { class: "terminal-pane", role: "tabpanel", "aria-label": `Shell ${name}` });
    this.button = h("button", { type: "button", role: "tab", class: "terminal-tab", "data-testid": "terminal-tab" });
    this.button.addEventListener("click", () => owner.activate(this));
    this.label();
    this.term.onData((data) => {
      if (this.role === "driver") this.send({ type: "input", data });
    });
    this.term.attachCustomKeyEventHandler((e) => this.keys(e));
  }

  label(): void {
    this.button.dataset.session = this.name;
    this.button.dataset.role = this.role;
    this.button.textContent = `${this.name}${this.role === "observer" ? " (watching)" : ""}${this.ended ? " ✕" : ""}`;
    this.button.title = `Shell ${this.name}: ${this.role}`;
  }

  private keys(e: KeyboardEvent): boolean {
    if (e.type !== "keydown") return true;
    const mod = e.ctrlKey || e.metaKey;
    if (mod && e.shiftKey && e.key.toLowerCase() === "c") {
      void navigator.clipboard?.writeText(this.term.getSelection());
      return false;
    }
    if (mod && e.shiftKey && e.key.toLowerCase() === "v") {
      void navigator.clipboard?.readText().then((text) => this.term.paste(text));
      return false;
    }
    if (e.ctrlKey && !e.shiftKey && e.key === "c" && this.term.hasSelection()) {
      void navigator.clipboard?.writeText(this.term.getSelection());
      this.term.clearSelection();
      return false;
    }
    // The page's own shortcuts pass through.
    if (mod && ["p", "s"].includes(e.key.toLowerCase())) return false;
    return true;
  }

  open(): void {
    if (!this.term.element) this.term.open(this.pane);
    this.connect();
  }

  connect(): void {
    if (this.closed || this.ended) return;
    const q: Record<string, string | number | undefined> = { provider: "shell" };
    if (this.sessionId) {
      q.session_id = this.sessionId;
      q.resume = 1;
      if (this.offset >= 0) q.offset = this.offset;
    } else if (this.name) {
      q.shell = this.name;
    } else {
      q.force_new = 1;
    }
    if (this.role === "observer") q.role = "observer";
    q.cols = this.term.cols;
    q.rows = this.term.rows;
    const ws = new WebSocket(wsUrl("/ws/pty", q));
    this.ws = ws;
    ws.onopen = () => {
      this.retry = 500;
    };
    ws.onmessage = (m: MessageEvent<string>) => this.frame(JSON.parse(m.data) as Frame);
    ws.onclose = (e) => {
      if (this.ws !== ws) return;
      this.ws = null;
      if (e.code === 1000 || this.closed) return;
      if (e.code === 4404) {
        this.sessionId = null;
        this.offset = -1;
      }
      if (e.code === 4003) return;
      this.owner.state(this, "reconnecting");
      window.setTimeout(() => this.connect(), this.retry);
      this.retry = Math.min(this.retry * 2, 8000);
    };
  }

  private frame(f: Frame): void {
    switch (f.type) {
      case "session":
        this.sessionId = f.session_id ?? null;
        if (f.name) this.name = f.name;
        if (f.role === "observer" || f.role === "driver") this.role = f.role;
        this.label();
        this.owner.saved();
        this.owner.state(this, "connected");
        this.resize();
        break;
      case "history":
        this.term.reset();
        this.pending = [];
        this.write(f.data ?? "");
        this.offset = (f.offset ?? 0) + encoder.encode(f.data ?? "").length;
        break;
      case "output":
        this.write(f.data ?? "");
        this.offset = (f.offset ?? 0) + encoder.encode(f.data ?? "").length;
        break;
      case "gap":
        this.write(`\r\n\x1b[2m[${(f.to ?? 0) - (f.from ?? 0)} bytes of output were lost]\x1b[0m\r\n`);
        this.offset = f.to ?? this.offset;
        break;
      case "exit":
        this.ended = true;
        this.write(`\r\n\x1b[2m[the shell exited with code ${f.code ?? "?"}]\x1b[0m\r\n`);
        this.label();
        break;
      case "session_not_found":
        this.sessionId = null;
        this.offset = -1;
        break;
      case "error":
        if (f.error?.code !== "RATE_LIMITED")
          this.write(`\r\n\x1b[2m[${f.error?.message ?? f.data ?? "error"}]\x1b[0m\r\n`);
        break;
      default:
        break;
    }
  }

  private write(data: string): void {
    if (!data) return;
    if (!this.scheduled && data.length <= 1024 && !document.hidden) {
      // Interactive output (an echo, a prompt): straight to xterm, which parses it now and
      // paints it at the next frame. A flood is gathered per frame below.
      this.term.write(data);
      return;
    }
    this.pending.push(data);
    if (this.scheduled) return;
    this.scheduled = true;
    const flush = (): void => {
      this.scheduled = false;
      const text = this.pending.join("");
      this.pending = [];
      this.term.write(text);
    };
    if (document.hidden) window.setTimeout(flush, 100);
    else requestAnimationFrame(flush);
  }

  send(frame: object): void {
    if (this.ws?.readyState === WebSocket.OPEN) this.ws.send(JSON.stringify(frame));
  }

  resize(): void {
    if (!this.pane.offsetParent) return;
    try {
      this.fit.fit();
    } catch {
      return;
    }
    this.send({ type: "resize", rows: this.term.rows, cols: this.term.cols });
  }

  setRole(role: Role): void {
    this.role = role;
    this.label();
    this.owner.saved();
    const ws = this.ws;
    this.ws = null;
    ws?.close();
    this.connect();
  }

  dispose(): void {
    this.closed = true;
    this.ws?.close();
    this.term.dispose();
    this.pane.remove();
    this.button.remove();
  }
}

export class Terminals {
  readonly el: HTMLElement;
  private readonly tabsEl: HTMLElement;
  private readonly panes: HTMLElement;
  private readonly roleButton: HTMLButtonElement;
  private readonly stateEl: HTMLElement;
  private tabs: Tab[] = [];
  private active: Tab | null = null;

  constructor() {
    this.tabsEl = h("div", { class: "terminal-tabs", role: "tablist", "aria-label": "Shells" });
    const add = h("button", { type: "button", class: "small", "data-testid": "terminal-new", text: "+", title: "New shell", "aria-label": "New shell" });
    add.addEventListener("click", () => this.add(null, "driver", null));
    this.roleButton = h("button", { type: "button", class: "small", text: "Watch only" });
    this.roleButton.addEventListener("click", () => {
      if (this.active) this.active.setRole(this.active.role === "driver" ? "observer" : "driver");
      this.updateRoleButton();
    });
    const close = h("button", { type: "button", class: "small", text: "Close tab", title: "Close this tab (the shell keeps running)" });
    close.addEventListener("click", () => this.active && this.close(this.active));
    this.stateEl = h("span", { class: "terminal-state", role: "status" });
    this.panes = h("div", { class: "terminal-panes", "data-testid": "terminal" });
    this.el = h(
      "section",
      { class: "panel terminals", "aria-label": "Terminal" },
      h("div", { class: "toolbar" }, this.tabsEl, add, h("span", { class: "spacer" }), this.stateEl, this.roleButton, close),
      this.panes,
    );
    new ResizeObserver(() => this.active?.resize()).observe(this.panes);
  }

  start(): void {
    let saved: Saved[];
    try {
      saved = JSON.parse(sessionStorage.getItem(STORE) ?? "[]") as Saved[];
    } catch {
      saved = [];
    }
    if (!saved.length) saved = [{ name: "main", sessionId: null, role: "driver" }];
    for (const s of saved) this.add(s.name, s.role, s.sessionId);
    if (this.tabs[0]) this.activate(this.tabs[0]);
  }

  private add(name: string | null, role: Role, sessionId: string | null): void {
    const tab = new Tab(name ?? "", role, sessionId, this);
    this.tabs.push(tab);
    this.tabsEl.append(tab.button);
    this.panes.append(tab.pane);
    tab.pane.hidden = true;
    if (!this.active || name === null) this.activate(tab);
    tab.open();
  }

  activate(tab: Tab): void {
    this.active = tab;
    for (const t of this.tabs) {
      t.pane.hidden = t !== tab;
      t.button.setAttribute("aria-selected", String(t === tab));
      t.button.tabIndex = t === tab ? 0 : -1;
    }
    window.sandlotTerminal = tab.term;
    window.sandlotTerminalSession = tab.name;
    this.updateRoleButton();
    requestAnimationFrame(() => {
      tab.resize();
    });
  }

  private close(tab: Tab): void {
    tab.dispose();
    this.tabs = this.tabs.filter((t) => t !== tab);
    this.saved();
    const next = this.tabs[0];
    if (next) this.activate(next);
    else this.add(null, "driver", null);
  }

  private updateRoleButton(): void {
    const role = this.active?.role ?? "driver";
    this.roleButton.textContent = role === "driver" ? "Watch only" : "Take control";
    this.roleButton.setAttribute("aria-pressed", String(role === "observer"));
  }

  state(tab: Tab, state: string): void {
    if (tab === this.active) this.stateEl.textContent = state === "connected" ? "" : state;
    if (tab === this.active) window.sandlotTerminalSession = tab.name;
  }

  saved(): void {
    const data: Saved[] = this.tabs.filter((t) => !t.ended).map((t) => ({ name: t.name, sessionId: t.sessionId, role: t.role }));
    sessionStorage.setItem(STORE, JSON.stringify(data));
    if (this.active) window.sandlotTerminalSession = this.active.name;
  }

  focus(): void {
    this.active?.term.focus();
  }

  setTheme(dark: boolean): void {
    for (const t of this.tabs) t.term.options.theme = dark ? DARK : LIGHT;
  }
}
