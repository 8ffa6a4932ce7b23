// The editor's CodeMirror 6 view, in a chunk of its own: the page loads it when a file is
// first opened (or once the page is idle), so CodeMirror's code is not run before the page
// is usable. Language modes are chunks of their own too (languages.ts).

import { basicSetup } from "codemirror";
import { Compartment, EditorState } from "@codemirror/state";
import type { Extension } from "@codemirror/state";
import { EditorView } from "@codemirror/view";
import { darkTheme } from "./darktheme";

export class CodeView {
  private readonly view: EditorView;
  private readonly language = new Compartment();
  private readonly theme = new Compartment();
  private dark: boolean;

  constructor(
    parent: HTMLElement,
    private readonly nonce: string,
    private readonly onChange: () => void,
  ) {
    this.dark = document.documentElement.dataset.theme === "dark";
    this.view = new EditorView({ parent, state: this.state("", "", [], false) });
  }

  private state(doc: string, path: string, language: Extension, editable: boolean): EditorState {
    return EditorState.create({
      doc,
      extensions: [
        basicSetup,
        EditorView.cspNonce.of(this.nonce),
        this.language.of(language),
        EditorState.readOnly.of(!editable),
        EditorView.editable.of(editable),
        this.theme.of(this.dark ? darkTheme : []),
        EditorView.contentAttributes.of({ "aria-label": path ? `Contents of ${path}` : "Editor" }),
        EditorView.updateListener.of((u) => {
          if (u.docChanged) this.onChange();
        }),
      ],
    });
  }

  /** Shows ``doc`` (the file at ``path``), editable or not. */
  load(doc: string, path: string, language: Extension, editable: boolean): void {
    this.view.setState(this.state(doc, path, language, editable));
  }

  get text(): string {
    return this.view.state.doc.toString();
  }

  setTheme(dark: boolean): void {
    this.dark = dark;
    this.view.dispatch({ effects: this.theme.reconfigure(dark ? darkTheme : []) });
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

  /** The selection, to put back after the document is replaced by a newer version. */
  selection(): { anchor: number; head: number } {
    const main = this.view.state.selection.main;
    return { anchor: main.anchor, head: main.head };
  }

  select(selection: { anchor: number; head: number }): void {
    const end = this.view.state.doc.length;
    if (selection.head <= end) this.view.dispatch({ selection: { anchor: Math.min(selection.anchor, end), head: selection.head } });
  }
}
