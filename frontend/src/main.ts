// The workspace page: sign-in, then the workspace's panes wired to its live events.

import { call, login, logout, me, setCsrf, workspace } from "./api";
import { Chat } from "./chat";
import { Connection } from "./connection";
import { h } from "./dom";
import { Editor } from "./editor";
import { EventHub } from "./events";
import { Feed } from "./feed";
import { DiffView, Git } from "./git";
import { QuickOpen, Search } from "./search";
import { loadXterm, Terminals } from "./terminal";
import { FileTree } from "./tree";
import { Workspaces } from "./workspaces";

// xterm.js's chunk (preloaded by index.html) runs while the page asks who is signed in.
void loadXterm();

const root = document.getElementById("app") as HTMLElement;
const nonce = document.querySelector<HTMLMetaElement>("meta[name=csp-nonce]")?.content ?? "";
const dark = window.matchMedia("(prefers-color-scheme: dark)");

// The editor and the terminal add <style> elements at run time; the policy admits those
// that carry this answer's nonce (CodeMirror also takes it through EditorView.cspNonce).
if (nonce) {
  const proto = Document.prototype as unknown as {
    createElement: (this: Document, tag: string, options?: ElementCreationOptions) => HTMLElement;
  };
  const create = proto.createElement;
  proto.createElement = function (this: Document, tag: string, options?: ElementCreationOptions) {
    const el = create.call(this, tag, options);
    if (tag.toLowerCase() === "style") el.setAttribute("nonce", nonce);
    return el;
  };
}

function applyTheme(): void {
  document.documentElement.dataset.theme = dark.matches ? "dark" : "light";
}
applyTheme();

function signIn(error = ""): void {
  const key = h("input", { type: "password", id: "api-key", "data-testid": "login-key", autocomplete: "current-password", required: true, placeholder: "sl_…" });
  const message = h("p", { class: "error", role: "alert", text: error });
  const form = h(
    "form",
    { class: "login", "data-testid": "login", "aria-label": "Sign in" },
    h("h1", { text: "sandlot" }),
    h("p", { text: "Sign in with your API key, or open the one-time link `sandlot open` prints." }),
    h("label", { for: "api-key", text: "API key" }),
    key,
    h("button", { type: "submit", "data-testid": "login-submit", text: "Sign in" }),
    message,
  );
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    login(key.value)
      .then(() => boot())
      .catch((err: unknown) => {
        message.textContent = err instanceof Error ? err.message : "sign-in failed";
      });
  });
  root.className = "app signed-out";
  root.replaceChildren(form);
  key.focus();
}

function signOutButton(): HTMLElement {
  const button = h("button", { type: "button", class: "small", text: "Sign out" });
  button.addEventListener("click", () => void logout().then(() => location.reload()));
  return button;
}

/** The top bar of a page without a workspace open. */
function bareTopbar(user: string): HTMLElement {
  return h(
    "header",
    { class: "topbar" },
    h("h1", { text: "sandlot" }),
    h("span", { class: "spacer" }),
    h("span", { class: "user", text: user }),
    signOutButton(),
  );
}

/** The page without a workspace: the user's threads and sandboxes, to open one. */
function choose(user: string, spaces: Workspaces): void {
  const main = h(
    "main",
    { class: "chooser", "aria-label": "Choose a workspace" },
    h("p", { text: "Open a thread or a sandbox below, or the link `sandlot open THREAD` prints." }),
    newThread(),
    spaces.el,
  );
  root.className = "app signed-in choosing";
  root.replaceChildren(bareTopbar(user), main);
}

/** A form that creates a thread's sandbox and opens it. */
function newThread(): HTMLElement {
  const name = h("input", { id: "new-thread", "data-testid": "new-thread", required: true, pattern: "[A-Za-z0-9][A-Za-z0-9_.:@\\-]{0,199}", placeholder: "thread id" });
  const message = h("span", { class: "error", role: "alert" });
  const form = h(
    "form",
    { class: "new-thread", "aria-label": "New thread" },
    h("label", { for: "new-thread", text: "New thread" }),
    name,
    h("button", { type: "submit", "data-testid": "new-thread-create", text: "Create" }),
    message,
  );
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    const thread = name.value.trim();
    message.textContent = "Creating the sandbox…";
    call("/api/v1/workspace", { thread }, { method: "POST" })
      .then(() => location.assign(`/?thread=${encodeURIComponent(thread)}`))
      .catch((err: unknown) => {
        message.textContent = err instanceof Error ? err.message : "could not create the sandbox";
      });
  });
  return form;
}

/** A thread with no sandbox yet: the page makes one only when its user asks (opening a
 * link never does, so no other site can make sandboxes in the user's account). */
function offerToCreate(user: string, spaces: Workspaces, thread: string): void {
  const message = h("p", { class: "error", role: "alert" });
  const create = h("button", { type: "button", "data-testid": "workspace-create", text: "Create its sandbox" });
  create.addEventListener("click", () => {
    create.setAttribute("disabled", "");
    message.textContent = "Creating the sandbox…";
    call("/api/v1/workspace", {}, { method: "POST" })
      .then(() => boot())
      .catch((err: unknown) => {
        create.removeAttribute("disabled");
        message.textContent = err instanceof Error ? err.message : "could not create the sandbox";
      });
  });
  const main = h(
    "main",
    { class: "chooser", "data-testid": "workspace-absent", "aria-label": "Create a workspace" },
    h("p", {}, "The thread ", h("strong", { text: thread }), " has no sandbox yet."),
    create,
    message,
    spaces.el,
  );
  root.className = "app signed-in choosing";
  root.replaceChildren(bareTopbar(user), main);
  void spaces.refresh();
  create.focus();
}

/** Whether the thread the page names has a sandbox (``false``: it has none yet). Other
 * failures are left to the panes, which say what they are. */
async function exists(): Promise<boolean> {
  if (!workspace.thread) return true;
  try {
    const answer = await call<{ workspace: unknown }>("/api/v1/workspace");
    return answer.workspace !== null;
  } catch {
    return true;
  }
}

async function boot(): Promise<void> {
  let who;
  try {
    who = await me();
  } catch {
    who = null;
  }
  if (!who) {
    signIn();
    return;
  }
  setCsrf(who.csrf_token);
  const user = who.user;
  const mine = (): string => user;
  const spaces = new Workspaces();
  if (!workspace.thread && !workspace.sandbox && (await spaces.refresh()) !== "local") {
    // A server of sandboxes, and no workspace named: the user picks one.
    choose(user, spaces);
    return;
  }
  if (workspace.thread && !(await exists())) {
    offerToCreate(user, spaces, workspace.thread);
    return;
  }

  // What the page needs to be usable first (the live stream, the tree, the terminal) is
  // asked for before anything else is built: the server answers while the page builds
  // itself. The rest (other workspaces, git status) once those are in.
  const connection = new Connection();
  const hub = new EventHub(connection);
  const tree = new FileTree((path) => void editor.open(path), mine);
  const terminals = new Terminals();
  hub.start();
  const listed = tree.start();
  void terminals.start();
  const diffView = new DiffView();
  const editor = new Editor(nonce, mine);
  const openAt = (path: string, line: number): void => {
    void editor.open(path).then(() => editor.goto(line));
  };
  const showDiff = (path: string): void => void diffView.show(path);
  editor.onDiff = showDiff;
  const feed = new Feed((path) => {
    void tree.reveal(path);
    void editor.open(path);
  }, showDiff);
  const search = new Search(openAt);
  const quick = new QuickOpen((path) => {
    void tree.reveal(path);
    void editor.open(path);
  });
  const git = new Git(showDiff);
  const chat = new Chat();

  hub.on((events, live) => {
    tree.apply(events, live);
    editor.apply(events, live);
    if (live) feed.apply(events);
    else feed.backlog(events);
    if (live && events.some((e) => e.details.fs)) git.soon();
  });

  const name = workspace.thread ?? workspace.sandbox ?? "local folder";
  const quickButton = h("button", { type: "button", class: "small", text: "Open file… (Ctrl+P)" });
  quickButton.addEventListener("click", () => quick.show());
  const header = h(
    "header",
    { class: "topbar" },
    h("h1", { text: "sandlot" }),
    h("span", { class: "workspace-name", title: "Workspace", text: name }),
    h("span", { class: "spacer" }),
    quickButton,
    connection.el,
    h("span", { class: "user", text: user }),
    signOutButton(),
  );
  const left = h("aside", { class: "left", "aria-label": "Workspace" }, spaces.el, search.el, tree.el, git.el);
  const center = h("main", { class: "center" }, editor.el, diffView.el, terminals.el);
  const right = h("aside", { class: "right", "aria-label": "Activity and chat" }, feed.el, chat.el);
  root.className = "app signed-in";
  root.replaceChildren(header, left, center, right, tree.progress, quick.el);

  dark.addEventListener("change", () => {
    applyTheme();
    editor.setTheme(dark.matches);
    terminals.setTheme(dark.matches);
  });

  document.addEventListener("keydown", (e) => {
    const mod = e.ctrlKey || e.metaKey;
    if (!mod) return;
    const key = e.key.toLowerCase();
    if (key === "s" && !e.shiftKey) {
      e.preventDefault();
      void editor.save();
    } else if (key === "p" && !e.shiftKey) {
      e.preventDefault();
      quick.show();
    } else if (key === "f" && e.shiftKey) {
      e.preventDefault();
      search.focus();
    } else if (key === "`" || (key === "j" && !e.shiftKey)) {
      e.preventDefault();
      terminals.focus();
    } else if (key === "e" && e.shiftKey) {
      e.preventDefault();
      tree.el.querySelector<HTMLElement>("[role=tree]")?.focus();
    }
  });

  await Promise.all([listed, hub.live(2000)]);
  await Promise.all([spaces.refresh(), git.refresh()]);
  if (chat.resumable) chat.start();
  // The editor's code, once the page has nothing else to do.
  if (typeof window.requestIdleCallback === "function") window.requestIdleCallback(() => editor.preload(), { timeout: 3000 });
  else window.setTimeout(() => editor.preload(), 1000); // Safari has no idle callbacks
}

void boot();
