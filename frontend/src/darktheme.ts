// The editor's dark theme: One Dark's look, with the colours its highlight style uses for
// names, headings, keywords and comments raised to a 4.5:1 contrast on the editor's
// background and its active line (WCAG AA; One Dark's own are 3.6:1 to 4.4:1).

import { HighlightStyle, syntaxHighlighting } from "@codemirror/language";
import { oneDarkTheme } from "@codemirror/theme-one-dark";
import type { Extension } from "@codemirror/state";
import { tags as t } from "@lezer/highlight";

const chalky = "#e5c07b";
const coral = "#ef8f96";
const cyan = "#56b6c2";
const invalid = "#ffffff";
const ivory = "#abb2bf";
const stone = "#a0a8b8";
const malibu = "#61afef";
const sage = "#98c379";
const whiskey = "#d19a66";
const violet = "#d699e6";

const highlight = HighlightStyle.define([
  { tag: t.keyword, color: violet },
  { tag: [t.name, t.deleted, t.character, t.propertyName, t.macroName], color: coral },
  { tag: [t.function(t.variableName), t.labelName], color: malibu },
  { tag: [t.color, t.constant(t.name), t.standard(t.name)], color: whiskey },
  { tag: [t.definition(t.name), t.separator], color: ivory },
  {
    tag: [t.typeName, t.className, t.number, t.changed, t.annotation, t.modifier, t.self, t.namespace],
    color: chalky,
  },
  {
    tag: [t.operator, t.operatorKeyword, t.url, t.escape, t.regexp, t.link, t.special(t.string)],
    color: cyan,
  },
  { tag: [t.meta, t.comment], color: stone },
  { tag: t.strong, fontWeight: "bold" },
  { tag: t.emphasis, fontStyle: "italic" },
  { tag: t.strikethrough, textDecoration: "line-through" },
  { tag: t.link, color: stone, textDecoration: "underline" },
  { tag: t.heading, fontWeight: "bold", color: coral },
  { tag: [t.atom, t.bool, t.special(t.variableName)], color: whiskey },
  { tag: [t.processingInstruction, t.string, t.inserted], color: sage },
  { tag: t.invalid, color: invalid },
]);

export const darkTheme: Extension = [oneDarkTheme, syntaxHighlighting(highlight)];
