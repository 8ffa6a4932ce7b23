// The chat pane: the agent program of the server's template over /ws/claude-stream.
// Messages are text; the agent's stream-JSON lines are read for their text parts.

import { wsUrl } from "./api";
import { h } from "./dom";

type Role = "user" | "assistant" | "system";

interface Block {
  type?: string;
  text?: string;
  name?: string;
  input?: unknown;
  content?: unknown;
}

interface StreamFrame {
  type: string;
  subtype?: string;
  session_id?: string;
  message?: { role?: string; content?: string | Block[] };
  result?: string;
  data?: string;
  exit_code?: number;
}

export class Chat {
  readonly el: HTMLElement;
  private readonly log: HTMLElement;
  private readonly input: HTMLTextAreaElement;
  private ws: WebSocket | null = null;
  private sessionId: string | null = sessionStorage.getItem(`sandlot.chat.${location.search}`);
  private queue: string[] = [];
  private retry = 1000;
  private started = false;

  constructor() {
    this.log = h("ol", { class: "chat-log", "aria-label": "Conversation", "aria-live": "polite" });
    this.input = h("textarea", { class: "chat-input", "data-testid": "chat-input", rows: 2, placeholder: "Ask the agent (Enter to send, Shift+Enter for a new line)", "aria-label": "Message to the agent" });
    const send = h("button", { type: "button", "data-testid": "chat-send", text: "Send" });
    send.addEventListener("click", () => this.send());
    this.input.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey) {
        e.preventDefault();
        this.send();
      }
    });
    const stop = h("button", { type: "button", class: "small", text: "Stop" });
    stop.addEventListener("click", () => this.ws?.send(JSON.stringify({ type: "interrupt" })));
    this.el = h(
      "section",
      { class: "panel chat", "data-testid": "chat", "aria-label": "Chat" },
      h("div", { class: "toolbar" }, h("h2", { text: "Chat" }), h("span", { class: "spacer" }), stop),
      this.log,
      h("div", { class: "chat-compose" }, this.input, send),
    );
  }

  private connect(): void {
    this.started = true;
    const q: Record<string, string | undefined> = {};
    if (this.sessionId) {
      q.session_id = this.sessionId;
      q.resume = "1";
    }
    const ws = new WebSocket(wsUrl("/ws/claude-stream", q));
    this.ws = ws;
    ws.onopen = () => {
      this.retry = 1000;
      for (const text of this.queue) ws.send(JSON.stringify({ type: "user", message: text }));
      this.queue = [];
    };
    ws.onmessage = (m: MessageEvent<string>) => {
      try {
        this.frame(JSON.parse(m.data) as StreamFrame);
      } catch {
        // not JSON
      }
    };
    ws.onclose = (e) => {
      if (this.ws !== ws) return;
      this.ws = null;
      if (e.code === 4404) {
        this.sessionId = null;
        return;
      }
      if (e.code === 1000 || e.code === 4003 || e.code === 1008) return;
      window.setTimeout(() => this.connect(), this.retry);
      this.retry = Math.min(this.retry * 2, 15000);
    };
  }

  private send(): void {
    const text = this.input.value.trim();
    if (!text) return;
    this.input.value = "";
    this.add("user", text);
    if (this.ws?.readyState === WebSocket.OPEN) this.ws.send(JSON.stringify({ type: "user", message: text }));
    else {
      this.queue.push(text);
      if (!this.ws) this.connect();
    }
  }

  private frame(f: StreamFrame): void {
    if (f.type === "system") {
      if (f.subtype === "connected" && f.session_id) {
        this.sessionId = f.session_id;
        sessionStorage.setItem(`sandlot.chat.${location.search}`, f.session_id);
      } else if (f.subtype === "error") this.add("system", (f as { message?: string }).message ?? "error");
      else if (f.subtype === "exited") this.add("system", `the agent exited (${f.exit_code ?? "?"})`);
      else if (f.subtype === "session_not_found") this.sessionId = null;
      return;
    }
    if (f.type === "assistant" && f.message) {
      const content = f.message.content;
      const text = typeof content === "string" ? content : (content ?? []).map((b) => (b.type === "text" ? b.text ?? "" : b.type === "tool_use" ? `[${b.name ?? "tool"}]` : "")).filter(Boolean).join("\n");
      if (text) this.add("assistant", text);
    } else if (f.type === "result" && f.result && !this.log.lastElementChild?.matches("[data-role=assistant]")) {
      this.add("assistant", f.result);
    } else if (f.type === "raw" && f.data) {
      this.add("system", f.data);
    }
  }

  private add(role: Role, text: string): void {
    const item = h("li", { class: `chat-message chat-${role}`, "data-testid": "chat-message", "data-role": role }, h("span", { class: "who", text: role === "user" ? "You" : role === "assistant" ? "Agent" : "System" }), h("div", { class: "text", text }));
    this.log.append(item);
    item.scrollIntoView({ block: "end" });
  }

  /** Whether an earlier chat of this tab can be resumed (a page that never chats starts no
   * agent: the stream opens at the first message). */
  get resumable(): boolean {
    return this.sessionId !== null && !this.started;
  }

  start(): void {
    this.connect();
  }
}
