// Content search (grep, the dataplane's ripgrep) and quick open (file names).

import { call } from "./api";
import { h } from "./dom";

interface Match {
  path: string;
  line: number;
  text: string;
}

export class Search {
  readonly el: HTMLElement;
  readonly input: HTMLInputElement;
  private readonly results: HTMLElement;
  private readonly note: HTMLElement;
  private timer = 0;
  private controller: AbortController | null = null;

  constructor(private readonly openAt: (path: string, line: number) => void) {
    this.input = h("input", { type: "search", class: "search-input", "data-testid": "search-input", placeholder: "Search in files (Ctrl+Shift+F)", "aria-label": "Search in files" });
    this.results = h("ul", { class: "search-results", "aria-label": "Search results" });
    this.note = h("p", { class: "note", role: "status" });
    this.input.addEventListener("input", () => {
      window.clearTimeout(this.timer);
      this.timer = window.setTimeout(() => void this.run(), 250);
    });
    this.input.addEventListener("keydown", (e) => {
      if (e.key === "Enter") void this.run();
    });
    this.el = h("section", { class: "panel search", "aria-label": "Search" }, this.input, this.note, this.results);
  }

  focus(): void {
    this.input.focus();
    this.input.select();
  }

  private async run(): Promise<void> {
    const q = this.input.value;
    this.controller?.abort();
    if (!q.trim()) {
      this.results.replaceChildren();
      this.note.textContent = "";
      return;
    }
    const controller = new AbortController();
    this.controller = controller;
    this.note.textContent = "searching…";
    try {
      const found = await call<{ matches: Match[]; truncated: boolean }>(
        "/api/v1/grep",
        { q, path: ".", ignore_case: "true" },
        { signal: controller.signal },
      );
      const items = found.matches.slice(0, 500).map((m) => {
        const b = h(
          "button",
          { type: "button", class: "result" },
          h("span", { class: "where", text: `${m.path}:${m.line}` }),
          h("code", { text: m.text.slice(0, 300) }),
        );
        b.addEventListener("click", () => this.openAt(m.path, m.line));
        return h("li", { "data-testid": "search-result", "data-path": m.path, "data-line": m.line }, b);
      });
      this.results.replaceChildren(...items);
      this.note.textContent = `${found.matches.length}${found.truncated ? "+" : ""} match${found.matches.length === 1 ? "" : "es"}`;
    } catch (e) {
      if (!controller.signal.aborted) this.note.textContent = e instanceof Error ? e.message : "search failed";
    }
  }
}

export class QuickOpen {
  readonly el: HTMLDialogElement;
  private readonly input: HTMLInputElement;
  private readonly list: HTMLElement;
  private timer = 0;
  private controller: AbortController | null = null;

  constructor(private readonly openFile: (path: string) => void) {
    this.input = h("input", { type: "text", "aria-label": "File name", placeholder: "Type a file name", autocomplete: "off" });
    this.list = h("ul", { class: "quick-results", role: "listbox", "aria-label": "Files found" });
    this.el = h("dialog", { class: "quick-open", "data-testid": "quick-open", "aria-label": "Quick open" }, this.input, this.list);
    this.input.addEventListener("input", () => {
      window.clearTimeout(this.timer);
      this.timer = window.setTimeout(() => void this.run(), 120);
    });
    this.input.addEventListener("keydown", (e) => {
      const items = [...this.list.querySelectorAll<HTMLElement>("[data-testid=quick-open-result]")];
      const at = items.findIndex((i) => i.getAttribute("aria-selected") === "true");
      if (e.key === "ArrowDown" || e.key === "ArrowUp") {
        e.preventDefault();
        const next = Math.max(0, Math.min(items.length - 1, at + (e.key === "ArrowDown" ? 1 : -1)));
        items.forEach((item, i) => item.setAttribute("aria-selected", String(i === next)));
      } else if (e.key === "Enter") {
        e.preventDefault();
        const chosen = items[Math.max(0, at)];
        if (chosen?.dataset.path) this.choose(chosen.dataset.path);
      }
    });
    this.el.addEventListener("click", (e) => {
      if (e.target === this.el) this.el.close();
    });
  }

  show(): void {
    if (!this.el.open) this.el.showModal();
    this.input.select();
    if (this.input.value) void this.run();
  }

  private choose(path: string): void {
    this.el.close();
    this.openFile(path);
  }

  private async run(): Promise<void> {
    const term = this.input.value.trim();
    this.controller?.abort();
    if (!term) {
      this.list.replaceChildren();
      return;
    }
    const controller = new AbortController();
    this.controller = controller;
    const pattern = /[*?[]/.test(term) ? term : `*${term}*`;
    try {
      const found = await call<{ results: { name: string; path: string; dir: boolean | string }[] }>(
        "/api/search",
        { q: pattern, path: "." },
        { signal: controller.signal },
      );
      const files = found.results.filter((r) => !r.path.startsWith(".git/")).slice(0, 100);
      this.list.replaceChildren(
        ...files.map((r, i) => {
          const li = h(
            "li",
            { role: "option", "data-testid": "quick-open-result", "data-path": r.path, "aria-selected": String(i === 0) },
            h("span", { class: "name", text: r.name }),
            h("span", { class: "where", text: r.path }),
          );
          li.addEventListener("click", () => this.choose(r.path));
          return li;
        }),
      );
    } catch {
      // aborted, or a refused pattern: the list stays
    }
  }
}
