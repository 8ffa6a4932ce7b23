// Syntax highlighting by file type.

import type { Extension } from "@codemirror/state";
import { StreamLanguage } from "@codemirror/language";
import { javascript } from "@codemirror/lang-javascript";
import { python } from "@codemirror/lang-python";
import { json } from "@codemirror/lang-json";
import { markdown } from "@codemirror/lang-markdown";
import { css } from "@codemirror/lang-css";
import { html } from "@codemirror/lang-html";
import { yaml } from "@codemirror/lang-yaml";
import { shell } from "@codemirror/legacy-modes/mode/shell";
import { toml } from "@codemirror/legacy-modes/mode/toml";
import { go } from "@codemirror/legacy-modes/mode/go";
import { rust } from "@codemirror/legacy-modes/mode/rust";
import { dockerFile } from "@codemirror/legacy-modes/mode/dockerfile";
import { c, cpp, java } from "@codemirror/legacy-modes/mode/clike";

export function languageFor(path: string): Extension {
  const name = path.slice(path.lastIndexOf("/") + 1).toLowerCase();
  const ext = name.includes(".") ? name.slice(name.lastIndexOf(".") + 1) : name;
  switch (ext) {
    case "js": case "mjs": case "cjs": return javascript();
    case "jsx": return javascript({ jsx: true });
    case "ts": case "mts": case "cts": return javascript({ typescript: true });
    case "tsx": return javascript({ typescript: true, jsx: true });
    case "py": case "pyi": return python();
    case "json": case "jsonl": return json();
    case "md": case "markdown": return markdown();
    case "css": return css();
    case "html": case "htm": case "svg": case "xml": return html();
    case "yml": case "yaml": return yaml();
    case "sh": case "bash": case "zsh": case "bashrc": case "profile": return StreamLanguage.define(shell);
    case "toml": case "ini": case "cfg": return StreamLanguage.define(toml);
    case "go": return StreamLanguage.define(go);
    case "rs": return StreamLanguage.define(rust);
    case "dockerfile": return StreamLanguage.define(dockerFile);
    case "c": case "h": return StreamLanguage.define(c);
    case "cc": case "cpp": case "hpp": case "cxx": return StreamLanguage.define(cpp);
    case "java": return StreamLanguage.define(java);
    default: return [];
  }
}
