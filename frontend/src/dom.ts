// Building elements. Data (file names, contents, commands, chat text) only ever reaches
// the page as text nodes or attribute values, never as markup.

type Attrs = Record<string, string | number | boolean | undefined | null>;
type Child = Node | string | null | undefined | false;

export function h<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  attrs: Attrs = {},
  ...children: Child[]
): HTMLElementTagNameMap[K] {
  const el = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "class") el.className = String(value);
    else if (name === "text") el.textContent = String(value);
    else el.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    el.append(typeof child === "string" ? document.createTextNode(child) : child);
  }
  return el;
}

/**
 * Makes `target` look like `source` while keeping `target` itself: a click begun on an
 * element that is repainted meanwhile still lands on it. Attributes and the inline style
 * (through the CSSOM, which the page's policy allows) are copied; children are replaced
 * only where they differ.
 */
export function patch(target: HTMLElement, source: HTMLElement): HTMLElement {
  for (const { name } of Array.from(target.attributes)) {
    if (name !== "style" && !source.hasAttribute(name)) target.removeAttribute(name);
  }
  for (const { name, value } of Array.from(source.attributes)) {
    if (name !== "style" && target.getAttribute(name) !== value) target.setAttribute(name, value);
  }
  if (target.style.cssText !== source.style.cssText) target.style.cssText = source.style.cssText;
  const old = target.childNodes;
  const fresh = Array.from(source.childNodes);
  if (old.length !== fresh.length || fresh.some((child, i) => !child.isEqualNode(old[i] ?? null))) {
    target.replaceChildren(...fresh);
  }
  return target;
}

export function clear(el: Element): void {
  el.replaceChildren();
}

export function byTestId(id: string, root: ParentNode = document): HTMLElement {
  const el = root.querySelector<HTMLElement>(`[data-testid="${id}"]`);
  if (!el) throw new Error(`no element ${id}`);
  return el;
}

/** A short, human time for an ISO timestamp (local clock). */
export function shortTime(iso: string | null | undefined): string {
  if (!iso) return "";
  const when = new Date(iso);
  if (Number.isNaN(when.getTime())) return "";
  return when.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit" });
}

export function formatBytes(n: number): string {
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} KiB`;
  if (n < 1024 * 1024 * 1024) return `${(n / 1024 / 1024).toFixed(1)} MiB`;
  return `${(n / 1024 / 1024 / 1024).toFixed(2)} GiB`;
}
