// Calls to the server: every one names the workspace (?thread= or ?sandbox=), sends the
// session's CSRF token on state-changing requests, and reads the error envelope.

export interface Workspace {
  thread: string | null;
  sandbox: string | null;
}

export class ApiError extends Error {
  constructor(
    readonly status: number,
    readonly code: string,
    message: string,
    readonly metadata: Record<string, unknown> = {},
  ) {
    super(message);
  }
}

const params = new URLSearchParams(location.search);
export const workspace: Workspace = {
  thread: params.get("thread"),
  sandbox: params.get("thread") ? null : params.get("sandbox"),
};

let csrfToken = "";
export function setCsrf(token: string): void {
  csrfToken = token;
}

export function workspaceQuery(extra: Record<string, string | number | undefined> = {}): string {
  const q = new URLSearchParams();
  if (workspace.thread) q.set("thread", workspace.thread);
  else if (workspace.sandbox) q.set("sandbox", workspace.sandbox);
  for (const [k, v] of Object.entries(extra)) if (v !== undefined) q.set(k, String(v));
  const text = q.toString();
  return text ? `?${text}` : "";
}

export function url(path: string, extra: Record<string, string | number | undefined> = {}): string {
  return path + workspaceQuery(extra);
}

export function wsUrl(path: string, extra: Record<string, string | number | undefined> = {}): string {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${location.host}${url(path, extra)}`;
}

/** Headers of a state-changing request. */
export function writeHeaders(extra: Record<string, string> = {}): Record<string, string> {
  return { "X-CSRF-Token": csrfToken, ...extra };
}

async function errorOf(response: Response): Promise<ApiError> {
  try {
    const body = (await response.json()) as {
      error?: { code?: string; message?: string; metadata?: Record<string, unknown> };
    };
    const e = body.error ?? {};
    return new ApiError(
      response.status,
      e.code ?? "ERROR",
      e.message ?? response.statusText,
      e.metadata ?? {},
    );
  } catch {
    return new ApiError(response.status, "ERROR", response.statusText || "request failed");
  }
}

export interface CallOptions {
  method?: string;
  body?: unknown;
  headers?: Record<string, string>;
  signal?: AbortSignal;
  plain?: boolean;
}

/** A JSON call to a route of the workspace (``path`` with ``query``). */
export async function call<T>(
  path: string,
  query: Record<string, string | number | undefined> = {},
  options: CallOptions = {},
): Promise<T> {
  const method = options.method ?? "GET";
  const headers: Record<string, string> = { Accept: "application/json", ...(options.headers ?? {}) };
  let body: string | undefined;
  if (options.body !== undefined) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(options.body);
  }
  if (method !== "GET" && method !== "HEAD") Object.assign(headers, writeHeaders());
  const target = options.plain ? path : url(path, query);
  const response = await fetch(target, {
    method,
    headers,
    body,
    credentials: "same-origin",
    signal: options.signal,
  });
  if (!response.ok) throw await errorOf(response);
  return (await response.json()) as T;
}

export interface Me {
  user: string;
  csrf_token: string;
  expires_at: number | string;
}

export async function me(): Promise<Me | null> {
  const response = await fetch("/api/auth/me", { credentials: "same-origin" });
  if (response.status === 401) return null;
  if (!response.ok) throw await errorOf(response);
  return (await response.json()) as Me;
}

export async function login(apiKey: string): Promise<Me> {
  const response = await fetch("/api/auth/login", {
    method: "POST",
    headers: { "Content-Type": "application/json", Accept: "application/json" },
    body: JSON.stringify({ api_key: apiKey }),
    credentials: "same-origin",
  });
  if (!response.ok) throw await errorOf(response);
  return (await response.json()) as Me;
}

export async function logout(): Promise<void> {
  await fetch("/api/auth/logout", {
    method: "POST",
    headers: writeHeaders(),
    credentials: "same-origin",
  });
}

/** An upload of ``body`` to ``path`` with progress (fetch has none for request bodies). */
export function upload(
  path: string,
  body: Blob,
  onProgress: (sent: number, total: number) => void,
): Promise<void> {
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    xhr.open("POST", url("/api/v1/upload", { path }));
    for (const [k, v] of Object.entries(writeHeaders({ "Content-Type": "application/octet-stream" })))
      xhr.setRequestHeader(k, v);
    xhr.upload.onprogress = (e) => onProgress(e.loaded, e.lengthComputable ? e.total : body.size);
    xhr.onload = () => {
      if (xhr.status >= 200 && xhr.status < 300) resolve();
      else reject(new ApiError(xhr.status, "UPLOAD_FAILED", `upload failed (${xhr.status})`));
    };
    xhr.onerror = () => reject(new ApiError(0, "NETWORK", "the connection was lost"));
    xhr.send(body);
  });
}
