// The editor: CodeMirror 6, a file at a time, saved with its etag. A save that meets a
// newer version (someone else wrote the file meanwhile) shows the conflict and its diff,
// and keeps what was typed until the user chooses. CodeMirror itself (codeview.ts) is a
// chunk loaded with the first file opened, or once the page is idle.

import { ApiError, call } from "./api";
import type { CodeView } from "./codeview";
import { h } from "./dom";
import { lineDiff, renderUnified } from "./diff";
import type { WorkspaceEvent } from "./events";
import { languageFor } from "./languages";

interface FileAnswer {
  path: string;
  content: string;
  encoding: "utf-8" | "base64";
  etag: string;
  size: number | null;
}

/** Files above this are shown read-only. */
const LARGE = 2 * 1024 * 1024;

export class Editor {
  readonly el: HTMLElement;
  private readonly pathEl: HTMLElement;
  private readonly statusEl: HTMLElement;
  private readonly host: HTMLElement;
  private readonly conflict: HTMLElement;
  private readonly conflictDiff: HTMLElement;
  private code: CodeView | null = null;
  private loading: Promise<CodeView> | null = null;
  /** Counts the files shown: a slower load never replaces a later one. */
  private shown = 0;
  private path: string | null = null;
  private etag: string | null = null;
  private saved = "";
  private editable = false;
  private theirs: FileAnswer | null = null;

  constructor(nonce: string, private readonly me: () => string) {
    this.nonce = nonce;
    this.pathEl = h("span", { class: "editor-path", "data-testid": "editor-path", text: "No file open" });
    this.statusEl = h("span", { class: "editor-status", "data-testid": "editor-status", role: "status", "aria-live": "polite" });
    const save = h("button", { type: "button", class: "small", text: "Save", title: "Save (Ctrl+S)" });
    save.addEventListener("click", () => void this.save());
    const diff = h("button", { type: "button", class: "small", text: "Diff vs HEAD" });
    diff.addEventListener("click", () => this.path && this.onDiff(this.path));
    this.conflictDiff = h("pre", { class: "diff", "data-testid": "conflict-diff", "aria-label": "Their version against yours" });
    const overwrite = h("button", { type: "button", "data-testid": "conflict-overwrite", text: "Overwrite with mine" });
    overwrite.addEventListener("click", () => void this.overwrite());
    const reload = h("button", { type: "button", "data-testid": "conflict-reload", text: "Take theirs" });
    reload.addEventListener("click", () => this.takeTheirs());
    this.conflict = h(
      "div",
      { class: "conflict", "data-testid": "conflict", role: "alertdialog", "aria-label": "Save conflict", hidden: true },
      h("p", { text: "This file was changed by someone else since you opened it. Their version (−) against yours (+):" }),
      this.conflictDiff,
      h("div", { class: "toolbar" }, overwrite, reload),
    );
    this.host = h(
      "div",
      { class: "editor-host", "data-testid": "editor" },
      h("p", { class: "editor-empty", text: "Open a file from the tree, or with Ctrl+P." }),
    );
    this.el = h(
      "section",
      { class: "panel editor", "aria-label": "Editor" },
      h("div", { class: "toolbar editor-bar" }, this.pathEl, this.statusEl, h("span", { class: "spacer" }), diff, save),
      this.conflict,
      this.host,
    );
  }

  private nonce = "";
  onDiff: (path: string) => void = () => undefined;

  /** CodeMirror's view, loaded (once) and put in the editor's place. */
  private view(): Promise<CodeView> {
    this.loading ??= import("./codeview").then(
      ({ CodeView }) => {
        this.host.replaceChildren();
        this.code = new CodeView(this.host, this.nonce, () => this.status(this.dirty ? "modified" : "saved"));
        return this.code;
      },
      (e: unknown) => {
        this.loading = null; // tried again with the next file
        throw e;
      },
    );
    return this.loading;
  }

  /** Loads CodeMirror ahead of the first file (the page calls it once it is idle). */
  preload(): void {
    this.view().catch(() => undefined);
  }

  setTheme(dark: boolean): void {
    this.code?.setTheme(dark);
  }

  get dirty(): boolean {
    return this.editable && this.code !== null && this.code.text !== this.saved;
  }

  get current(): string | null {
    return this.path;
  }

  private status(text: string): void {
    this.statusEl.textContent = text;
    this.statusEl.dataset.state = text;
  }

  focus(): void {
    this.code?.focus();
  }

  /** Puts the cursor on a line (1-based) and shows it. */
  goto(line: number): void {
    this.code?.goto(line);
  }

  async open(path: string): Promise<void> {
    if (this.dirty && this.path !== path && !window.confirm(`Discard your changes to ${this.path ?? ""}?`)) return;
    this.status("opening…");
    let found: FileAnswer;
    try {
      found = await call<FileAnswer>("/api/v1/file", { path });
    } catch (e) {
      this.status(e instanceof Error ? e.message : "could not open");
      return;
    }
    try {
      await this.show(found);
    } catch {
      this.status("the editor could not be loaded: try again");
    }
  }

  private async show(found: FileAnswer): Promise<void> {
    const shown = ++this.shown;
    const [code, language] = await Promise.all([this.view(), languageFor(found.path)]);
    if (shown !== this.shown) return;
    this.path = found.path;
    this.etag = found.etag;
    this.conflict.hidden = true;
    this.theirs = null;
    this.pathEl.textContent = found.path;
    const size = found.size ?? found.content.length;
    let text = found.content;
    this.editable = true;
    if (found.encoding === "base64") {
      this.editable = false;
      text = `Binary file (${size} bytes): shown read-only. Download it from the file tree.`;
    } else if (size > LARGE) {
      this.editable = false;
    }
    this.saved = text;
    code.load(text, found.path, language, this.editable);
    this.status(this.editable ? "saved" : "read-only");
    this.host.dataset.readonly = String(!this.editable);
  }

  private saving = false;

  /** Saves with the file's etag (Ctrl+S is the page's, in main.ts). */
  async save(force = false): Promise<void> {
    if (!this.path || !this.editable || this.saving) return;
    this.saving = true;
    try {
      await this.write(force);
    } finally {
      this.saving = false;
    }
  }

  private async write(force: boolean): Promise<void> {
    if (!this.path || !this.code) return;
    const content = this.code.text;
    this.status("saving…");
    const headers: Record<string, string> = {};
    if (this.etag && !force) headers["If-Match"] = `"${this.etag}"`;
    try {
      const written = await call<{ etag: string }>(
        "/api/v1/file",
        { path: this.path },
        { method: "PUT", body: { content }, headers },
      );
      this.etag = written.etag;
      this.saved = content;
      this.conflict.hidden = true;
      this.theirs = null;
      this.status(this.dirty ? "modified" : "saved");
    } catch (e) {
      if (e instanceof ApiError && e.status === 412) await this.showConflict(content);
      else this.status(e instanceof Error ? `not saved: ${e.message}` : "not saved");
    }
  }

  private async showConflict(mine: string): Promise<void> {
    if (!this.path) return;
    this.status("conflict");
    try {
      this.theirs = await call<FileAnswer>("/api/v1/file", { path: this.path });
    } catch {
      this.theirs = { path: this.path, content: "", encoding: "utf-8", etag: "", size: 0 };
    }
    renderUnified(this.conflictDiff, lineDiff(this.theirs.content, mine));
    this.conflict.hidden = false;
  }

  private async overwrite(): Promise<void> {
    if (this.theirs?.etag) this.etag = this.theirs.etag;
    await this.save(!this.theirs?.etag);
  }

  private takeTheirs(): void {
    if (this.theirs) this.show(this.theirs).catch(() => this.status("the editor could not be loaded: try again"));
    else if (this.path) void this.open(this.path);
  }

  /** File events: the open file changed by someone else is reloaded, unless edited. */
  apply(events: WorkspaceEvent[], live: boolean): void {
    if (!live || !this.path) return;
    for (const event of events) {
      if (event.path !== this.path || !event.details.fs) continue;
      const actor = event.actor;
      if (actor?.type === "human" && actor.id === this.me()) continue;
      const who = actor?.type ?? "someone";
      if (event.details.fs.op === "deleted") {
        this.status(`deleted by ${who}`);
      } else if (this.dirty || !this.conflict.hidden) {
        this.status(`changed by ${who}: saving will show the conflict`);
      } else {
        void this.reloadQuietly(who);
      }
    }
  }

  private async reloadQuietly(who: string): Promise<void> {
    if (!this.path) return;
    try {
      const found = await call<FileAnswer>("/api/v1/file", { path: this.path });
      if (this.dirty || found.path !== this.path) return;
      if (found.etag === this.etag) return;
      const selection = this.code?.selection();
      await this.show(found);
      if (selection) this.code?.select(selection);
      this.status(`reloaded: changed by ${who}`);
    } catch {
      // gone meanwhile: the next event says so
    }
  }
}
