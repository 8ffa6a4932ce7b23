// xterm.js and its fit addon: a chunk of its own, which the page's first lines ask for at
// once (index.html preloads it) and which runs while the page waits for the server.

export { Terminal } from "@xterm/xterm";
export { FitAddon } from "@xterm/addon-fit";
