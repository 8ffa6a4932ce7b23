// Syntax highlighting by file type. Each mode is a chunk of its own, loaded with the first
// file of its type (its parser tables are built when its module runs).

import type { Extension } from "@codemirror/state";
import type { StreamParser } from "@codemirror/language";

async function legacy<T>(mode: Promise<StreamParser<T>>): Promise<Extension> {
  const [{ StreamLanguage }, parser] = await Promise.all([import("@codemirror/language"), mode]);
  return StreamLanguage.define(parser);
}

export async function languageFor(path: string): Promise<Extension> {
  const name = path.slice(path.lastIndexOf("/") + 1).toLowerCase();
  const ext = name.includes(".") ? name.slice(name.lastIndexOf(".") + 1) : name;
  switch (ext) {
    case "js": case "mjs": case "cjs": return (await import("@codemirror/lang-javascript")).javascript();
    case "jsx": return (await import("@codemirror/lang-javascript")).javascript({ jsx: true });
    case "ts": case "mts": case "cts": return (await import("@codemirror/lang-javascript")).javascript({ typescript: true });
    case "tsx": return (await import("@codemirror/lang-javascript")).javascript({ typescript: true, jsx: true });
    case "py": case "pyi": return (await import("@codemirror/lang-python")).python();
    case "json": case "jsonl": return (await import("@codemirror/lang-json")).json();
    case "md": case "markdown": return (await import("@codemirror/lang-markdown")).markdown();
    case "css": return (await import("@codemirror/lang-css")).css();
    case "html": case "htm": case "svg": case "xml": return (await import("@codemirror/lang-html")).html();
    case "yml": case "yaml": return (await import("@codemirror/lang-yaml")).yaml();
    case "sh": case "bash": case "zsh": case "bashrc": case "profile":
      return legacy(import("@codemirror/legacy-modes/mode/shell").then((m) => m.shell));
    case "toml": case "ini": case "cfg": return legacy(import("@codemirror/legacy-modes/mode/toml").then((m) => m.toml));
    case "go": return legacy(import("@codemirror/legacy-modes/mode/go").then((m) => m.go));
    case "rs": return legacy(import("@codemirror/legacy-modes/mode/rust").then((m) => m.rust));
    case "dockerfile": return legacy(import("@codemirror/legacy-modes/mode/dockerfile").then((m) => m.dockerFile));
    case "c": case "h": return legacy(import("@codemirror/legacy-modes/mode/clike").then((m) => m.c));
    case "cc": case "cpp": case "hpp": case "cxx": return legacy(import("@codemirror/legacy-modes/mode/clike").then((m) => m.cpp));
    case "java": return legacy(import("@codemirror/legacy-modes/mode/clike").then((m) => m.java));
    default: return [];
  }
}
