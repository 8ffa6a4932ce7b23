// The editor: CodeMirror 6, a file at a time, saved with its etag. A save that meets a
// newer version (someone else wrote the file meanwhile) shows the conflict and its diff,
// and keeps what was typed until the user chooses.

import { basicSetup } from "codemirror";
import { Compartment, EditorState } from "@codemirror/state";
import { EditorView } from "@codemirror/view";
import { darkTheme } from "./darktheme";
import { ApiError, call } from "./api";
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
  private view: EditorView;
  private readonly language = new Compartment();
  private readonly readOnly = new Compartment();
  private readonly theme = new Compartment();
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
    this.host = h("div", { class: "editor-host", "data-testid": "editor" });
    this.el = h(
      "section",
      { class: "panel editor", "aria-label": "Editor" },
      h("div", { class: "toolbar editor-bar" }, this.pathEl, this.statusEl, h("span", { class: "spacer" }), diff, save),
      this.conflict,
      this.host,
    );
    const dark = document.documentElement.dataset.theme === "dark";
    this.view = new EditorView({
      parent: this.host,
      state: this.state("", ""),
    });
    this.setTheme(dark);
  }

  private nonce = "";
  onDiff: (path: string) => void = () => undefined;

  private state(doc: string, path: string): EditorState {
    return EditorState.create({
      doc,
      extensions: [
        basicSetup,
        EditorView.cspNonce.of(this.nonce),
        this.language.of(languageFor(path)),
        this.readOnly.of([EditorState.readOnly.of(!this.editable), EditorView.editable.of(this.editable)]),
        this.theme.of(document.documentElement.dataset.theme === "dark" ? darkTheme : []),
        EditorView.contentAttributes.of({ "aria-label": path ? `Contents of ${path}` : "Editor" }),
        EditorView.updateListener.of((u) => {
          if (u.docChanged) this.status(this.dirty ? "modified" : "saved");
        }),
      ],
    });
  }

  setTheme(dark: boolean): void {
    this.view.dispatch({ effects: this.theme.reconfigure(dark ? darkTheme : []) });
  }

  get dirty(): boolean {
    return this.editable && this.view.state.doc.toString() !== this.saved;
  }

  get current(): string | null {
    return this.path;
  }

  private status(text: string): void {
    this.statusEl.textContent = text;
    this.statusEl.dataset.state = text;
  }

  focus(): void {
    this.view.focus();
  }

  /** Puts the cursor on a line (1-based) and shows it. */
  goto(line: number): void {
    const doc = this.view.state.doc;
    const at = doc.line(Math.max(1, Math.min(line, doc.lines))).from;
    this.view.dispatch({ selection: { anchor: at }, effects: EditorView.scrollIntoView(at, { y: "center" }) });
    this.view.focus();
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
    this.show(found);
  }

  private show(found: FileAnswer): void {
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
    this.view.setState(this.state(text, found.path));
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
    if (!this.path) return;
    const content = this.view.state.doc.toString();
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
    if (this.theirs) this.show(this.theirs);
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
      const selection = this.view.state.selection;
      this.show(found);
      const end = this.view.state.doc.length;
      if (selection.main.head <= end) this.view.dispatch({ selection: { anchor: Math.min(selection.main.anchor, end), head: selection.main.head } });
      this.status(`reloaded: changed by ${who}`);
    } catch {
      // gone meanwhile: the next event says so
    }
  }
}
