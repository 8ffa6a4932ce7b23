// Builds the page into ../src/sandlot/web/static (or the folder given as the first argument):
// index.html, app.js, app.css, the chunks app.js loads when it needs them (chunk-HASH.js:
// CodeMirror, each language mode) and the licenses of what the bundle holds. The output is
// the same bytes for the same sources and lockfile: no timestamps; the chunks' names are
// hashes of their contents, so a browser may keep them for good.
import { build } from "esbuild";
import { mkdir, readFile, rm, writeFile } from "node:fs/promises";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const out = resolve(process.argv[2] ?? join(here, "..", "src", "sandlot", "web", "static"));

await rm(out, { recursive: true, force: true });
await mkdir(out, { recursive: true });

const result = await build({
  entryPoints: { app: join(here, "src", "main.ts"), "app-style": join(here, "src", "style.css") },
  bundle: true,
  splitting: true,
  chunkNames: "chunk-[hash]",
  minify: true,
  format: "esm",
  target: ["chrome110", "firefox115", "safari16"],
  outdir: out,
  legalComments: "none",
  metafile: true,
  sourcemap: false,
  charset: "utf8",
  logLevel: "warning",
  loader: { ".css": "css" },
});

// esbuild names the CSS of the JS entry app.css; the stylesheet entry is merged into it.
const own = await readFile(join(out, "app-style.css"), "utf8");
let fromJs = "";
try {
  fromJs = await readFile(join(out, "app.css"), "utf8");
} catch {
  fromJs = "";
}
await writeFile(join(out, "app.css"), fromJs + own);
await rm(join(out, "app-style.css"));
await rm(join(out, "app-style.js"), { force: true });

// index.html preloads what app.js runs at its start: the chunks it imports, and xterm.js's,
// which it asks for at once; the browser then fetches them beside app.js, not after it.
const outputs = Object.entries(result.metafile.outputs);
const app = outputs.find(([name]) => name.endsWith("/app.js"))?.[1];
const early = new Set(app ? app.imports.filter((i) => i.kind === "import-statement").map((i) => i.path) : []);
for (const [name, meta] of outputs) if (meta.entryPoint?.endsWith("src/xterm.ts")) early.add(name);
const preloads = [...early]
  .map((path) => path.split("/").pop())
  .sort()
  .map((name) => `<link rel="modulepreload" href="/assets/${name}">`)
  .join("\n");
const index = await readFile(join(here, "index.html"), "utf8");
const mark = /<!-- preloads: .* -->\n/;
if (!mark.test(index)) throw new Error("index.html has no preloads mark");
await writeFile(join(out, "index.html"), index.replace(mark, preloads ? `${preloads}\n` : ""));

// The licenses of the packages the bundle holds, in a stable order.
const packages = new Set();
for (const input of Object.keys(result.metafile.inputs)) {
  const match = input.match(/node_modules\/((?:@[^/]+\/)?[^/]+)\//);
  if (match) packages.add(match[1]);
}
let notices = "Third-party software in app.js, its chunks and app.css\n";
for (const name of [...packages].sort()) {
  const dir = join(here, "node_modules", name);
  const meta = JSON.parse(await readFile(join(dir, "package.json"), "utf8"));
  notices += `\n== ${name} ${meta.version} (${meta.license ?? "see package"})\n`;
  for (const file of ["LICENSE", "LICENSE.md", "LICENSE.txt", "license"]) {
    try {
      notices += "\n" + (await readFile(join(dir, file), "utf8")).trim() + "\n";
      break;
    } catch {
      // next name
    }
  }
}
await writeFile(join(out, "licenses.txt"), notices);
