// The workspace's event log, pushed: one EventSource on /api/v1/activity/stream. Events
// are delivered to the listeners in order, batched per animation frame; the browser
// reconnects on its own from the last event id.

import { url } from "./api";
import type { Connection } from "./connection";

export interface Actor {
  type: string;
  id: string;
}

export interface WorkspaceEvent {
  sequence: number;
  event_type: string;
  timestamp: string;
  actor: Actor | null;
  details: {
    fs?: { path?: string; op?: string; is_dir?: boolean; from?: string };
    exec?: {
      exec_id?: string;
      command_id?: string | null;
      command?: string;
      exit_code?: number | null;
      status?: string;
      signal?: string | null;
    };
    shell?: Record<string, unknown>;
    phase?: Record<string, unknown>;
  };
  path?: string;
  from?: string;
}

/** ``live`` is false for the events the log held when the stream opened. */
export type Listener = (events: WorkspaceEvent[], live: boolean) => void;

/** Events of the log's past a page starts with. */
const BACKLOG = 200;

export class EventHub {
  private source: EventSource | null = null;
  private listeners: Listener[] = [];
  private pending: WorkspaceEvent[] = [];
  private scheduled = false;
  private isLive = false;
  private last = 0;
  private onLive: (() => void)[] = [];

  constructor(private readonly connection: Connection) {}

  /** Resolves once the stream is first live, or after ``timeout`` ms. */
  live(timeout: number): Promise<void> {
    if (this.isLive) return Promise.resolve();
    return new Promise((resolve) => {
      this.onLive.push(resolve);
      window.setTimeout(resolve, timeout);
    });
  }

  on(listener: Listener): void {
    this.listeners.push(listener);
  }

  start(): void {
    this.open(0);
  }

  private open(after: number): void {
    this.source?.close();
    // The first open asks for the log's recent past only (the tree and the editor read
    // the files themselves; the feed shows its latest); a reconnection gets all it missed.
    const query = after ? { after } : { after, tail: BACKLOG };
    const source = new EventSource(url("/api/v1/activity/stream", query));
    this.source = source;
    // Connected once the log's backlog is through (``ready``): from then on every event is
    // live, and marked as such in the tree and the editor.
    source.onerror = () => {
      if (source.readyState === EventSource.CLOSED) {
        // A refused answer (signed out, workspace gone): try again in a while.
        this.connection.set("reconnecting");
        window.setTimeout(() => this.open(this.last), 3000);
      } else {
        this.connection.set("reconnecting");
      }
    };
    source.onmessage = (message: MessageEvent<string>) => {
      try {
        const event = JSON.parse(message.data) as WorkspaceEvent;
        if (event.sequence <= this.last) return;
        this.last = event.sequence;
        this.pending.push(event);
        this.schedule();
      } catch {
        // not an event
      }
    };
    source.addEventListener("ready", () => {
      this.flush();
      this.isLive = true;
      this.connection.set("connected");
      for (const resolve of this.onLive.splice(0)) resolve();
    });
    source.addEventListener("expired", () => {
      // Older than the log keeps: start again from its beginning.
      this.last = 0;
      this.open(0);
    });
  }

  private schedule(): void {
    if (this.scheduled) return;
    this.scheduled = true;
    // A hidden tab gets no animation frames: a timer then.
    if (document.hidden) window.setTimeout(() => this.flush(), 50);
    else requestAnimationFrame(() => this.flush());
  }

  private flush(): void {
    this.scheduled = false;
    if (!this.pending.length) return;
    const batch = this.pending;
    this.pending = [];
    for (const listener of this.listeners) listener(batch, this.isLive);
  }
}
