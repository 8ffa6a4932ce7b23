// Terminals: tabs over the workspace's shared shells (/ws/pty). Every tab is a shell the
// CLI can attach to by name; observers watch, drivers type. A lost socket reattaches from
// the last byte seen (nothing lost, nothing twice); a reloaded page reattaches its tabs and
// gets the shell's recent output back. Output goes to xterm as it comes, in pieces, with
// flow control: xterm parses a piece in one go, so pieces bound how long a task runs while
// a command floods the terminal; what xterm has not parsed yet is bounded, the rest waits
// here in order (nothing is dropped). A flood goes to xterm four times a second.
// Output comes in binary frames (/ws/pty?binary=1): the offset of the first byte (8 bytes,
// big-endian), then the bytes, given to xterm as they are (it decodes UTF-8 itself). A
// tab's socket opens before xterm.js is built: the shell answers while the page loads it.

import type { Terminal } from "@xterm/xterm";
import type { FitAddon } from "@xterm/addon-fit";
import "@xterm/xterm/css/xterm.css";
import { wsUrl } from "./api";
import { h } from "./dom";

type Role = "driver" | "observer";

type Xterm = typeof import("./xterm");
let xterm: Promise<Xterm> | null = null;
/** xterm.js's chunk, asked for once (the page asks at its start). */
export function loadXterm(): Promise<Xterm> {
  xterm ??= import("./xterm");
  return xterm;
}

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
/** The UTF-8 length of ``text`` (the shell's offsets count bytes), without encoding it. */
function utf8Length(text: string): number {
  let n = text.length;
  for (let i = 0; i < text.length; i++) {
    const c = text.charCodeAt(i);
    if (c < 0x80) continue;
    if (c < 0x800) n += 1;
    else if (c >= 0xd800 && c < 0xdc00 && i + 1 < text.length) {
      const next = text.charCodeAt(i + 1);
      if (next >= 0xdc00 && next < 0xe000) {
        n += 2; // a pair: 4 bytes for 2 UTF-16 units
        i++;
      } else n += 2;
    } else n += 2;
  }
  return n;
}
/** Output for xterm: text (history, notes) or the shell's bytes. */
type Chunk = string | Uint8Array;
/** Most characters (or bytes) given to xterm in one write: xterm parses a write in one go. */
const PIECE = 16 * 1024;
/** Most characters xterm holds unparsed; more output waits in the tab's queue. */
const AHEAD = 128 * 1024;
/** Output of more than FLOOD characters within PACE ms is a flood: xterm then gets it once
 * per PACE ms, what came meanwhile in one go, so that it parses, scrolls and draws it four
 * times a second rather than at every frame (each of those is a frame's style, layout and
 * paint: most of the page's work in a flood). */
const FLOOD = 32 * 1024;
const PACE = 250;

const DARK = { background: "#1b1d23", foreground: "#d7dae0", cursor: "#d7dae0", selectionBackground: "#3e4451" };
const LIGHT = { background: "#fbfbfc", foreground: "#1f2328", cursor: "#1f2328", selectionBackground: "#c8d7f0" };

class Tab {
  /** xterm.js, once its chunk is in (output waits in the queue until then). */
  term: Terminal | null = null;
  fit: FitAddon | null = null;
  readonly pane: HTMLElement;
  readonly button: HTMLButtonElement;
  ws: WebSocket | null = null;
  sessionId: string | null;
  offset = -1;
  ended = false;
  closed = false;
  /** Output not given to xterm yet, in order, and what xterm holds unparsed. */
  private queue: Chunk[] = [];
  private ahead = 0;
  /** Characters of output since ``windowStart``; while ``pacing`` (a flood), xterm gets
   * output at ticks only, at most ``released`` characters of it. */
  private windowStart = 0;
  private windowChars = 0;
  private pacing = false;
  private released = 0;
  private ticker = 0;
  private retry = 500;

  constructor(
    public name: string,
    public role: Role,
    sessionId: string | null,
    private readonly owner: Terminals,
  ) {
    this.sessionId = sessionId;
    this.pane = h("div", { class: "terminal-pane", role: "tabpanel", "aria-label": `Shell ${name}` });
    this.button = h("button", { type: "button", role: "tab", class: "terminal-tab", "data-testid": "terminal-tab" });
    this.button.addEventListener("click", () => owner.activate(this));
    this.label();
  }

  /** Builds the tab's xterm.js in its pane and gives it the output that came meanwhile. */
  build(lib: Xterm): void {
    if (this.term || this.closed) return;
    const fit = new lib.FitAddon();
    const term = new lib.Terminal({
      fontFamily: "ui-monospace, SFMono-Regular, Menlo, Consolas, monospace",
      fontSize: 13,
      scrollback: 5000,
      cursorBlink: true,
      theme: document.documentElement.dataset.theme === "dark" ? DARK : LIGHT,
      screenReaderMode: false,
    });
    term.loadAddon(fit);
    term.onData((data) => {
      if (this.role === "driver") this.send({ type: "input", data });
    });
    term.attachCustomKeyEventHandler((e) => this.keys(e));
    term.open(this.pane);
    this.term = term;
    this.fit = fit;
    this.feed();
  }

  label(): void {
    this.button.dataset.session = this.name;
    this.button.dataset.role = this.role;
    this.button.textContent = `${this.name}${this.role === "observer" ? " (watching)" : ""}${this.ended ? " ✕" : ""}`;
    this.button.title = `Shell ${this.name}: ${this.role}`;
  }

  private keys(e: KeyboardEvent): boolean {
    const term = this.term;
    if (e.type !== "keydown" || !term) return true;
    const mod = e.ctrlKey || e.metaKey;
    if (mod && e.shiftKey && e.key.toLowerCase() === "c") {
      void navigator.clipboard?.writeText(term.getSelection());
      return false;
    }
    if (mod && e.shiftKey && e.key.toLowerCase() === "v") {
      void navigator.clipboard?.readText().then((text) => term.paste(text));
      return false;
    }
    if (e.ctrlKey && !e.shiftKey && e.key === "c" && term.hasSelection()) {
      void navigator.clipboard?.writeText(term.getSelection());
      term.clearSelection();
      return false;
    }
    // The page's own shortcuts pass through.
    if (mod && ["p", "s"].includes(e.key.toLowerCase())) return false;
    return true;
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
    // Before xterm is built, its default size: the first resize sets the real one.
    q.cols = this.term?.cols ?? 80;
    q.rows = this.term?.rows ?? 24;
    q.binary = 1;
    const ws = new WebSocket(wsUrl("/ws/pty", q));
    ws.binaryType = "arraybuffer";
    this.ws = ws;
    ws.onopen = () => {
      this.retry = 500;
    };
    ws.onmessage = (m: MessageEvent<string | ArrayBuffer>) => {
      if (typeof m.data === "string") this.frame(JSON.parse(m.data) as Frame);
      else this.output(m.data);
    };
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

  /** A binary frame of output: its first byte's offset (8 bytes, big-endian), the bytes. */
  private output(buffer: ArrayBuffer): void {
    if (buffer.byteLength < 8) return;
    const view = new DataView(buffer);
    const offset = view.getUint32(0) * 2 ** 32 + view.getUint32(4);
    const data = new Uint8Array(buffer, 8);
    this.write(data);
    this.offset = offset + data.byteLength;
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
        // The shell's recent output replaces the screen: a full reset (ESC c) parsed in
        // order, after what xterm already holds.
        this.queue = [];
        this.write(`\x1bc${f.data ?? ""}`, false);
        this.offset = (f.offset ?? 0) + utf8Length(f.data ?? "");
        break;
      case "output":
        this.write(f.data ?? "");
        this.offset = (f.offset ?? 0) + utf8Length(f.data ?? "");
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

  /** Output for xterm, in order; ``counted`` output may start a flood (the history a tab
   * opens with does not: it goes to xterm at once). */
  private write(data: Chunk, counted = true): void {
    if (!data.length) return;
    this.queue.push(data);
    if (!counted) {
      if (!this.pacing) this.feed();
      return;
    }
    const now = performance.now();
    if (now - this.windowStart > PACE) {
      this.windowStart = now;
      this.windowChars = 0;
    }
    this.windowChars += data.length;
    if (this.pacing) return; // the next tick gives it to xterm
    if (this.windowChars > FLOOD) {
      this.pacing = true;
      this.ticker = window.setTimeout(() => this.tick(), PACE);
    }
    this.feed();
  }

  /** A flood's tick: what came since the last one goes to xterm; the flood goes on while
   * more than FLOOD characters came. */
  private tick(): void {
    const flooding = this.windowChars > FLOOD;
    this.windowStart = performance.now();
    this.windowChars = 0;
    this.released = this.queue.reduce((n, part) => n + part.length, 0);
    this.feed();
    if (flooding && !this.closed) {
      this.ticker = window.setTimeout(() => this.tick(), PACE);
    } else {
      this.pacing = false;
      this.ticker = 0;
      this.feed();
    }
  }

  /** Gives xterm the queued output, a piece at a time, while it holds less than AHEAD
   * unparsed; each piece parsed gives it more. The first output after a keystroke (an
   * echo) is parsed at once by xterm, and painted with the next frame. In a flood, what
   * a tick released only. */
  private feed(): void {
    const term = this.term;
    if (!term) return; // xterm.js is not built yet: it gets all of it once it is
    while (this.queue.length && this.ahead < AHEAD && (!this.pacing || this.released > 0)) {
      let piece: Chunk = this.queue[0] ?? "";
      if (piece.length > PIECE) {
        // Bytes are cut anywhere: xterm decodes UTF-8 across writes.
        this.queue[0] = typeof piece === "string" ? piece.slice(PIECE) : piece.subarray(PIECE);
        piece = typeof piece === "string" ? piece.slice(0, PIECE) : piece.subarray(0, PIECE);
      } else {
        this.queue.shift();
      }
      const size = piece.length;
      this.ahead += size;
      if (this.pacing) this.released -= size;
      term.write(piece, () => {
        this.ahead -= size;
        if (!this.closed) this.feed();
      });
    }
  }

  send(frame: object): void {
    if (this.ws?.readyState === WebSocket.OPEN) this.ws.send(JSON.stringify(frame));
  }

  resize(): void {
    const term = this.term;
    if (!term || !this.fit || !this.pane.offsetParent) return;
    try {
      this.fit.fit();
    } catch {
      return;
    }
    this.send({ type: "resize", rows: term.rows, cols: term.cols });
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
    window.clearTimeout(this.ticker);
    this.ws?.close();
    this.term?.dispose();
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
  private lib: Xterm | null = null;
  private started = false;

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

  /** Opens the saved tabs (or ``main``): their sockets at once, their screens once
   * xterm.js's chunk is in. */
  async start(): Promise<void> {
    let saved: Saved[];
    try {
      saved = JSON.parse(sessionStorage.getItem(STORE) ?? "[]") as Saved[];
    } catch {
      saved = [];
    }
    if (!saved.length) saved = [{ name: "main", sessionId: null, role: "driver" }];
    for (const s of saved) this.add(s.name, s.role, s.sessionId);
    this.lib = await loadXterm();
    for (const tab of this.tabs) tab.build(this.lib);
    if (this.active) this.activate(this.active);
  }

  private add(name: string | null, role: Role, sessionId: string | null): void {
    if (!this.started && name === null) return; // not started yet
    this.started = true;
    const tab = new Tab(name ?? "", role, sessionId, this);
    this.tabs.push(tab);
    this.tabsEl.append(tab.button);
    this.panes.append(tab.pane);
    tab.pane.hidden = true;
    // The socket first: the shell answers while xterm.js is loaded and built.
    tab.connect();
    if (this.lib) tab.build(this.lib);
    if (!this.active || name === null) this.activate(tab);
  }

  activate(tab: Tab): void {
    this.active = tab;
    for (const t of this.tabs) {
      t.pane.hidden = t !== tab;
      t.button.setAttribute("aria-selected", String(t === tab));
      t.button.tabIndex = t === tab ? 0 : -1;
    }
    if (tab.term) window.sandlotTerminal = tab.term;
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
    this.active?.term?.focus();
  }

  setTheme(dark: boolean): void {
    for (const t of this.tabs) if (t.term) t.term.options.theme = dark ? DARK : LIGHT;
  }
}
