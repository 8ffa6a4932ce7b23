// Diffs as text: a unified diff rendered line by line (each line a text node), and a
// line diff of two versions for the save conflict.

import { h } from "./dom";

export function renderUnified(target: HTMLElement, diff: string): void {
  const lines = diff.split("\n");
  if (lines.length && lines[lines.length - 1] === "") lines.pop();
  const out: HTMLElement[] = lines.map((line) => {
    const kind = line.startsWith("+++") || line.startsWith("---")
      ? "file"
      : line.startsWith("@@")
        ? "hunk"
        : line.startsWith("+")
          ? "add"
          : line.startsWith("-")
            ? "del"
            : "ctx";
    return h("div", { class: `diff-line diff-${kind}`, text: line || " " });
  });
  if (!out.length) out.push(h("div", { class: "diff-line diff-ctx", text: "No differences." }));
  target.replaceChildren(...out);
}

/** A unified diff of ``before`` → ``after`` (whole-file context trimmed to 3 lines). */
export function lineDiff(before: string, after: string, from = "theirs", to = "mine"): string {
  const a = before.split("\n");
  const b = after.split("\n");
  let start = 0;
  while (start < a.length && start < b.length && a[start] === b[start]) start++;
  let endA = a.length;
  let endB = b.length;
  while (endA > start && endB > start && a[endA - 1] === b[endB - 1]) {
    endA--;
    endB--;
  }
  const midA = a.slice(start, endA);
  const midB = b.slice(start, endB);
  const ops: string[] = [];
  if (midA.length * midB.length <= 4_000_000) {
    // Longest common subsequence over the changed middle.
    const n = midA.length;
    const m = midB.length;
    const table = new Uint32Array((n + 1) * (m + 1));
    for (let i = n - 1; i >= 0; i--)
      for (let j = m - 1; j >= 0; j--)
        table[i * (m + 1) + j] =
          midA[i] === midB[j]
            ? (table[(i + 1) * (m + 1) + j + 1] ?? 0) + 1
            : Math.max(table[(i + 1) * (m + 1) + j] ?? 0, table[i * (m + 1) + j + 1] ?? 0);
    let i = 0;
    let j = 0;
    while (i < n && j < m) {
      if (midA[i] === midB[j]) {
        ops.push(` ${midA[i]}`);
        i++;
        j++;
      } else if ((table[(i + 1) * (m + 1) + j] ?? 0) >= (table[i * (m + 1) + j + 1] ?? 0)) ops.push(`-${midA[i++]}`);
      else ops.push(`+${midB[j++]}`);
    }
    while (i < n) ops.push(`-${midA[i++]}`);
    while (j < m) ops.push(`+${midB[j++]}`);
  } else {
    for (const line of midA) ops.push(`-${line}`);
    for (const line of midB) ops.push(`+${line}`);
  }
  if (!ops.length) return "";
  const before3 = a.slice(Math.max(0, start - 3), start).map((l) => ` ${l}`);
  const after3 = a.slice(endA, endA + 3).map((l) => ` ${l}`);
  // Unified diff ranges: first line (1-based) and line count of the hunk on each side.
  const first = start - before3.length + 1;
  const context = before3.length + after3.length;
  const oldCount = midA.length + context;
  const newCount = midB.length + context;
  const header = `@@ -${oldCount ? first : first - 1},${oldCount} +${newCount ? first : first - 1},${newCount} @@`;
  return [`--- ${from}`, `+++ ${to}`, header, ...before3, ...ops, ...after3].join("\n") + "\n";
}
