// The file tree: directories load when opened, only the rows in view are in the page
// (so a folder of 10,000 files paints at once), and the workspace's file events update
// it live, marking what someone else changed.

import { call, upload, url, ApiError } from "./api";
import { h, formatBytes, patch } from "./dom";
import type { WorkspaceEvent } from "./events";

interface Entry {
  name: string;
  path: string;
  is_dir: boolean;
  size?: number;
}

interface Node {
  path: string;
  name: string;
  isDir: boolean;
  size?: number;
  children: string[] | null;
  expanded: boolean;
  changed?: { by: string; until: number };
}

const ROW = 24;
const MARK_MS = 60_000;

function parentOf(path: string): string {
  const i = path.lastIndexOf("/");
  return i < 0 ? "." : path.slice(0, i);
}

function nameOf(path: string): string {
  return path.slice(path.lastIndexOf("/") + 1);
}

function compare(a: Node, b: Node): number {
  if (a.isDir !== b.isDir) return a.isDir ? -1 : 1;
  const x = a.name.toLowerCase();
  const y = b.name.toLowerCase();
  return x < y ? -1 : x > y ? 1 : a.name < b.name ? -1 : a.name > b.name ? 1 : 0;
}

export class FileTree {
  readonly el: HTMLElement;
  private readonly viewport: HTMLElement;
  private readonly spacer: HTMLElement;
  private readonly rows: HTMLElement;
  readonly progress: HTMLElement;
  private readonly nodes = new Map<string, Node>();
  private visible: string[] = [];
  private selected: string | null = null;
  private refreshing = new Set<string>();
  private frame = 0;
  private painted = new Map<string, HTMLElement>();
  private failures = new Map<string, number>();

  constructor(
    private readonly openFile: (path: string) => void,
    private readonly me: () => string,
  ) {
    this.nodes.set(".", { path: ".", name: ".", isDir: true, children: null, expanded: true });
    this.rows = h("div", { class: "tree-rows" });
    this.spacer = h("div", { class: "tree-spacer" }, this.rows);
    this.viewport = h(
      "div",
      { class: "tree", "data-testid": "tree", role: "tree", "aria-label": "Files", "aria-busy": "true", tabindex: 0 },
      this.spacer,
    );
    this.progress = h("div", {
      class: "transfer",
      "data-testid": "upload-progress",
      role: "status",
      "aria-live": "polite",
      hidden: true,
    });
    const upload = h("input", { type: "file", multiple: true, class: "visually-hidden", "aria-label": "Upload files", tabindex: -1 });
    upload.addEventListener("change", () => {
      const files = [...(upload.files ?? [])].map((f) => ({ file: f, path: f.name }));
      void this.uploadAll(this.targetDir(), files);
      upload.value = "";
    });
    const toolbar = h(
      "div",
      { class: "toolbar", role: "toolbar", "aria-label": "File actions" },
      button("New file", () => void this.newFile()),
      button("Upload", () => upload.click()),
      button("Download", () => void this.download()),
      button("Refresh", () => void this.reload()),
      upload,
    );
    this.el = h("section", { class: "panel files", "aria-label": "Files" }, toolbar, this.viewport, this.progress);
    this.viewport.addEventListener("scroll", () => this.paint());
    new ResizeObserver(() => this.paint()).observe(this.viewport);
    this.viewport.addEventListener("click", (e) => this.clicked(e));
    this.viewport.addEventListener("keydown", (e) => this.key(e));
    this.dropTarget();
  }

  async start(): Promise<void> {
    await this.load(".");
  }

  async reload(): Promise<void> {
    const open = [...this.nodes.values()].filter((n) => n.isDir && (n.children !== null || n.path === ".")).map((n) => n.path);
    await Promise.all(open.map((p) => this.load(p)));
  }

  private async load(dir: string): Promise<void> {
    const node = this.nodes.get(dir);
    if (!node) return;
    let entries: Entry[];
    try {
      const answer = await call<{ entries: Entry[] }>("/api/tree", { path: dir, depth: 1 });
      entries = answer.entries;
    } catch (e) {
      if (e instanceof ApiError && e.status === 404 && dir !== ".") this.remove(dir);
      // A folder whose listing failed for a reason that may pass (the network, a busy or
      // restarting server) is listed again, with a message meanwhile; a refused one is not.
      else if (!(e instanceof ApiError) || e.status >= 500 || e.status === 408 || e.status === 429) {
        this.say(`Could not list ${dir === "." ? "the workspace" : dir}; trying again…`, 3000);
        const wait = Math.min(5000, 500 * 2 ** (this.failures.get(dir) ?? 0));
        this.failures.set(dir, (this.failures.get(dir) ?? 0) + 1);
        window.setTimeout(() => void this.load(dir), wait);
      }
      return;
    }
    this.failures.delete(dir);
    if (dir === ".") this.viewport.setAttribute("aria-busy", "false");
    const old = new Set(node.children ?? []);
    const children: string[] = [];
    for (const entry of entries) {
      const path = entry.path.replace(/^\.\//, "");
      children.push(path);
      old.delete(path);
      const known = this.nodes.get(path);
      if (known) {
        known.isDir = entry.is_dir;
        known.size = entry.size;
      } else {
        this.nodes.set(path, { path, name: entry.name, isDir: entry.is_dir, size: entry.size, children: null, expanded: false });
      }
    }
    for (const gone of old) this.forget(gone);
    node.children = children;
    this.layout();
  }

  private forget(path: string): void {
    const node = this.nodes.get(path);
    if (!node) return;
    for (const child of node.children ?? []) this.forget(child);
    this.nodes.delete(path);
  }

  private remove(path: string): void {
    const parent = this.nodes.get(parentOf(path));
    if (parent?.children) parent.children = parent.children.filter((c) => c !== path);
    this.forget(path);
    this.layout();
  }

  private add(path: string, isDir: boolean): void {
    const parent = this.nodes.get(parentOf(path));
    if (!parent?.children) return;
    if (!this.nodes.has(path)) {
      this.nodes.set(path, { path, name: nameOf(path), isDir, children: null, expanded: false });
    }
    if (!parent.children.includes(path)) {
      parent.children.push(path);
      const nodes = parent.children.map((c) => this.nodes.get(c)).filter((n): n is Node => !!n);
      parent.children = nodes.sort(compare).map((n) => n.path);
    }
  }

  /** The workspace's events: file changes update the tree at once. */
  apply(events: WorkspaceEvent[], live: boolean): void {
    let touched = false;
    const now = Date.now();
    for (const event of events) {
      const fs = event.details.fs;
      const path = event.path;
      if (!fs || !path || path === ".") continue;
      touched = true;
      const op = fs.op ?? "";
      if (op === "deleted") {
        this.remove(path);
      } else {
        if (op === "moved" && event.from) this.remove(event.from);
        const isDir = fs.is_dir ?? this.nodes.get(path)?.isDir ?? false;
        this.add(path, isDir);
        // A directory's contents, or a name whose kind was guessed: ask again.
        if (fs.is_dir === undefined && op !== "modified") this.refresh(parentOf(path));
      }
      const actor = event.actor;
      const mine = actor?.type === "human" && actor.id === this.me();
      if (live && !mine) {
        const node = this.nodes.get(path);
        const by = actor?.type === "agent" ? "agent" : actor?.type === "human" ? "human" : "unknown";
        if (node) node.changed = { by, until: now + MARK_MS };
        // Its folders show that something inside changed.
        for (let p = parentOf(path); p !== "."; p = parentOf(p)) {
          const dir = this.nodes.get(p);
          if (dir) dir.changed = { by, until: now + MARK_MS };
        }
      }
    }
    if (touched) {
      this.layout();
      window.setTimeout(() => this.paint(), MARK_MS + 50);
    }
  }

  private refresh(dir: string): void {
    if (this.refreshing.has(dir) || !this.nodes.get(dir)?.children) return;
    this.refreshing.add(dir);
    window.setTimeout(() => {
      this.refreshing.delete(dir);
      void this.load(dir);
    }, 100);
  }

  private layout(): void {
    const out: string[] = [];
    const walk = (dir: string): void => {
      for (const child of this.nodes.get(dir)?.children ?? []) {
        out.push(child);
        const node = this.nodes.get(child);
        if (node?.isDir && node.expanded) walk(child);
      }
    };
    walk(".");
    this.visible = out;
    this.spacer.style.height = `${out.length * ROW}px`;
    if (!this.frame) this.frame = requestAnimationFrame(() => this.paint());
  }

  private paint(): void {
    this.frame = 0;
    const top = this.viewport.scrollTop;
    const height = this.viewport.clientHeight || 600;
    const first = Math.max(0, Math.floor(top / ROW) - 10);
    const last = Math.min(this.visible.length, Math.ceil((top + height) / ROW) + 10);
    const now = Date.now();
    const rows: HTMLElement[] = [];
    // Rows already on screen are kept and updated, not replaced: a click whose press came
    // before a repaint (a live change, a mark fading) and whose release came after must
    // still reach its row.
    const painted = new Map<string, HTMLElement>();
    for (let i = first; i < last; i++) {
      const node = this.nodes.get(this.visible[i] ?? "");
      if (!node) continue;
      const fresh = this.row(node, i, now);
      const old = this.painted.get(node.path);
      const row = old ? patch(old, fresh) : fresh;
      painted.set(node.path, row);
      rows.push(row);
    }
    this.painted = painted;
    this.rows.style.transform = `translateY(${first * ROW}px)`;
    if (rows.length !== this.rows.children.length || rows.some((row, i) => this.rows.children[i] !== row)) {
      this.rows.replaceChildren(...rows);
    }
  }

  private row(node: Node, index: number, now: number): HTMLElement {
    const depth = node.path.split("/").length;
    const changed = node.changed && node.changed.until > now ? node.changed.by : undefined;
    const icon = node.isDir ? (node.expanded ? "▾" : "▸") : "";
    const label = `${node.name}${node.isDir ? " (folder)" : ""}`;
    const row = h(
      "div",
      {
        class: `tree-node${node.path === this.selected ? " selected" : ""}`,
        role: "treeitem",
        "data-testid": "tree-node",
        "data-path": node.path,
        "data-kind": node.isDir ? "dir" : "file",
        "data-changed": changed,
        "aria-level": depth,
        "aria-selected": node.path === this.selected ? "true" : "false",
        "aria-expanded": node.isDir ? String(node.expanded) : undefined,
        "aria-label": changed ? `${label}, changed by ${changed}` : label,
        "aria-setsize": this.visible.length,
        "aria-posinset": index + 1,
        title: node.path + (node.size !== undefined ? ` — ${formatBytes(node.size)}` : ""),
      },
      h("span", { class: "twisty", "aria-hidden": "true", text: icon }),
      h("span", { class: "name", text: node.name }),
      changed ? h("span", { class: `mark mark-${changed}`, "aria-hidden": "true", text: changed === "agent" ? "A" : "●" }) : null,
    );
    row.style.paddingLeft = `${(depth - 1) * 14 + 6}px`;
    return row;
  }

  private clicked(event: MouseEvent): void {
    const row = (event.target as HTMLElement).closest<HTMLElement>("[data-testid=tree-node]");
    if (!row?.dataset.path) return;
    this.activate(row.dataset.path);
  }

  private activate(path: string): void {
    const node = this.nodes.get(path);
    if (!node) return;
    this.selected = path;
    if (node.isDir) {
      node.expanded = !node.expanded;
      if (node.expanded && node.children === null) void this.load(path);
      this.layout();
    } else {
      this.openFile(path);
      this.layout();
    }
  }

  private key(event: KeyboardEvent): void {
    const index = this.selected ? this.visible.indexOf(this.selected) : -1;
    let next: number;
    if (event.key === "ArrowDown") next = Math.min(this.visible.length - 1, index + 1);
    else if (event.key === "ArrowUp") next = Math.max(0, index - 1);
    else if (event.key === "Enter" && this.selected) {
      this.activate(this.selected);
      event.preventDefault();
      return;
    } else return;
    event.preventDefault();
    this.selected = this.visible[next] ?? null;
    const top = next * ROW;
    if (top < this.viewport.scrollTop) this.viewport.scrollTop = top;
    else if (top + ROW > this.viewport.scrollTop + this.viewport.clientHeight)
      this.viewport.scrollTop = top + ROW - this.viewport.clientHeight;
    this.paint();
  }

  /** Reveals a path (its folders opened, the row selected). */
  async reveal(path: string): Promise<void> {
    const parts = path.split("/");
    let dir = ".";
    for (const part of parts.slice(0, -1)) {
      dir = dir === "." ? part : `${dir}/${part}`;
      const node = this.nodes.get(dir);
      if (!node) break;
      node.expanded = true;
      if (node.children === null) await this.load(dir);
    }
    this.selected = path;
    this.layout();
  }

  private targetDir(): string {
    const node = this.selected ? this.nodes.get(this.selected) : undefined;
    if (!node) return ".";
    return node.isDir ? node.path : parentOf(node.path);
  }

  private async newFile(): Promise<void> {
    const dir = this.targetDir();
    const name = window.prompt(`New file in ${dir === "." ? "the workspace" : dir}:`);
    if (!name) return;
    const path = dir === "." ? name : `${dir}/${name}`;
    try {
      await call("/api/v1/file", { path }, { method: "PUT", body: { content: "" }, headers: { "If-None-Match": "*" } });
      await this.reveal(path);
      this.openFile(path);
    } catch (e) {
      this.say(e instanceof Error ? e.message : "could not create the file");
    }
  }

  private say(text: string, hideAfter = 4000): void {
    this.progress.hidden = false;
    this.progress.textContent = text;
    if (hideAfter) window.setTimeout(() => (this.progress.hidden = true), hideAfter);
  }

  /** Downloads the selected file, or the selected folder as an archive, with progress. */
  async download(): Promise<void> {
    const node = this.selected ? this.nodes.get(this.selected) : this.nodes.get(".");
    if (!node) return;
    const route = node.isDir ? "/api/v1/archive" : "/api/v1/download";
    const name = node.path === "." ? "workspace.tar.gz" : node.isDir ? `${node.name}.tar.gz` : node.name;
    try {
      const response = await fetch(url(route, { path: node.path }), { credentials: "same-origin" });
      if (!response.ok || !response.body) throw new Error(`download failed (${response.status})`);
      const total = Number(response.headers.get("Content-Length") ?? 0);
      const reader = response.body.getReader();
      const parts: Uint8Array[] = [];
      let received = 0;
      for (;;) {
        const { done, value } = await reader.read();
        if (done) break;
        parts.push(value);
        received += value.length;
        this.say(`Downloading ${name}: ${formatBytes(received)}${total ? ` of ${formatBytes(total)}` : ""}`, 0);
      }
      const blob = new Blob(parts as BlobPart[]);
      const link = h("a", { href: URL.createObjectURL(blob), download: name });
      link.click();
      window.setTimeout(() => URL.revokeObjectURL(link.href), 10_000);
      this.say(`Downloaded ${name} (${formatBytes(received)})`);
    } catch (e) {
      this.say(e instanceof Error ? e.message : "download failed");
    }
  }

  private dropTarget(): void {
    const over = (e: DragEvent): void => {
      if (!e.dataTransfer?.types.includes("Files")) return;
      e.preventDefault();
      this.viewport.classList.add("dropping");
    };
    this.viewport.addEventListener("dragenter", over);
    this.viewport.addEventListener("dragover", over);
    this.viewport.addEventListener("dragleave", () => this.viewport.classList.remove("dropping"));
    this.viewport.addEventListener("drop", (e) => {
      e.preventDefault();
      this.viewport.classList.remove("dropping");
      const row = (e.target as HTMLElement).closest<HTMLElement>("[data-testid=tree-node]");
      const at = row?.dataset.path ? this.nodes.get(row.dataset.path) : undefined;
      const dir = at ? (at.isDir ? at.path : parentOf(at.path)) : ".";
      void this.dropped(dir, e.dataTransfer);
    });
  }

  private async dropped(dir: string, data: DataTransfer | null): Promise<void> {
    if (!data) return;
    const files: { file: File; path: string }[] = [];
    const entries = [...data.items]
      .map((item) => item.webkitGetAsEntry?.())
      .filter((e): e is FileSystemEntry => !!e);
    try {
      if (entries.length) {
        for (const entry of entries) await collect(entry, "", files);
      } else {
        for (const file of data.files) files.push({ file, path: file.name });
      }
    } catch (e) {
      this.progress.dataset.state = "failed";
      this.say(`Could not read what was dropped: ${e instanceof Error ? e.message : String(e)}`);
      return;
    }
    if (!files.length) {
      this.say("Nothing to upload in what was dropped");
      return;
    }
    await this.uploadAll(dir, files);
  }

  async uploadAll(dir: string, files: { file: File; path: string }[]): Promise<void> {
    if (!files.length) return;
    const total = files.reduce((n, f) => n + f.file.size, 0);
    let done = 0;
    this.progress.dataset.state = "running";
    try {
      for (const [i, { file, path }] of files.entries()) {
        const target = dir === "." ? path : `${dir}/${path}`;
        await upload(target, file, (sent) => {
          const share = total ? Math.round(((done + sent) / total) * 100) : 100;
          this.say(`Uploading ${i + 1}/${files.length} (${share}%): ${path}`, 0);
        });
        done += file.size;
      }
      this.say(`Uploaded ${files.length} file${files.length === 1 ? "" : "s"} (${formatBytes(total)})`);
      this.progress.dataset.state = "done";
      if (dir !== ".") await this.reveal(`${dir}/x`);
      await this.load(dir);
    } catch (e) {
      this.progress.dataset.state = "failed";
      this.say(e instanceof Error ? e.message : "upload failed");
    }
  }
}

function button(label: string, onClick: () => void): HTMLButtonElement {
  const b = h("button", { type: "button", class: "small", text: label });
  b.addEventListener("click", onClick);
  return b;
}

async function collect(entry: FileSystemEntry, prefix: string, out: { file: File; path: string }[]): Promise<void> {
  const path = prefix ? `${prefix}/${entry.name}` : entry.name;
  if (entry.isFile) {
    const file = await new Promise<File>((resolve, reject) => (entry as FileSystemFileEntry).file(resolve, reject));
    out.push({ file, path });
  } else if (entry.isDirectory) {
    const reader = (entry as FileSystemDirectoryEntry).createReader();
    for (;;) {
      const batch = await new Promise<FileSystemEntry[]>((resolve, reject) => reader.readEntries(resolve, reject));
      if (!batch.length) break;
      for (const child of batch) await collect(child, path, out);
    }
  }
}
