declare module "*.css";

interface Window {
  sandlotTerminal?: import("@xterm/xterm").Terminal;
  sandlotTerminalSession?: string;
}
