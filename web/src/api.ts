// The control plane, typed by hand after /v1/openapi.json (checked by the e2e test against the live API).
// Every request carries the CSRF header; the session cookie (HttpOnly) or a pasted token authenticates it.

export type Phase =
  | 'queued' | 'provisioning' | 'running' | 'delivering' | 'idle' | 'hibernated' | 'failed' | 'canceled';
export const PHASES: Phase[] = ['queued', 'provisioning', 'running', 'delivering', 'idle', 'hibernated', 'failed', 'canceled'];
export const LIVE: Phase[] = ['queued', 'provisioning', 'running', 'delivering'];

export interface Failure { code: string; reason: string }
export interface Usage { compute_seconds: number; input_tokens: number; output_tokens: number }
export interface Session {
  id: string; workspace: string; repo: string; base: string | null; branch: string; agent: string;
  model: string | null; title: string; phase: Phase; queued_reason: string | null; turns: number;
  current_turn: number | null; head_sha: string | null; pr: { url: string; number: number } | null;
  failure: Failure | null; egress: { allow: string[] }; usage: Usage; archived: boolean;
  created_at: string; updated_at: string;
}
export interface Turn {
  n: number; prompt: string; status: string; mode: string; created_at: string; started_at: string | null;
  completed_at: string | null; head_sha: string | null; failure: Failure | null; priming?: string | null;
  timings?: Record<string, number> | null;
}
export interface CreateSession {
  repo: string; task: string; agent?: string; base?: string; model?: string; egress?: { allow: string[] }; setup?: string; title?: string;
}

export class ApiError extends Error {
  constructor(public status: number, public code: string, message: string, public details: Record<string, unknown> = {}) {
    super(message);
  }
}

/** The header the session cookie is accepted with (a cross-site form cannot set it). */
export const CSRF_HEADER = 'X-Sortie-Csrf';
const TOKEN_KEY = 'sortie.token';

export const auth = {
  token(): string | null { return sessionStorage.getItem(TOKEN_KEY); },
  setToken(token: string | null) {
    if (token) sessionStorage.setItem(TOKEN_KEY, token); else sessionStorage.removeItem(TOKEN_KEY);
  },
};

let onUnauthorized: () => void = () => {};
export function setUnauthorizedHandler(handler: () => void) { onUnauthorized = handler; }

export function headers(extra: Record<string, string> = {}): Record<string, string> {
  const h: Record<string, string> = { [CSRF_HEADER]: '1', ...extra };
  const token = auth.token();
  if (token) h.Authorization = `Bearer ${token}`;
  return h;
}

export async function api<T>(method: string, path: string, body?: unknown): Promise<T> {
  const init: RequestInit = { method, credentials: 'same-origin', headers: headers(body === undefined ? {} : { 'Content-Type': 'application/json' }) };
  if (body !== undefined) init.body = JSON.stringify(body);
  const res = await fetch(path, init);
  if (res.status === 204) return undefined as T;
  const text = await res.text();
  let json: unknown = null;
  try { json = text ? JSON.parse(text) : null; } catch { /* not JSON */ }
  if (!res.ok) {
    const err = (json as { error?: { code: string; message: string; details?: Record<string, unknown> } } | null)?.error;
    if (res.status === 401) onUnauthorized();
    throw new ApiError(res.status, err?.code ?? `HTTP_${res.status}`, err?.message ?? (text || res.statusText), err?.details ?? {});
  }
  return json as T;
}

export const client = {
  sessions: (q: { phase?: string; repo?: string; archived?: boolean }) => {
    const p = new URLSearchParams();
    if (q.phase) p.set('phase', q.phase);
    if (q.repo) p.set('repo', q.repo);
    if (q.archived) p.set('archived', 'true');
    p.set('limit', '100');
    return api<{ sessions: Session[]; next_cursor?: string | null }>('GET', `/v1/sessions?${p}`);
  },
  session: (id: string) => api<Session>('GET', `/v1/sessions/${id}`),
  turns: (id: string) => api<{ turns: Turn[] }>('GET', `/v1/sessions/${id}/turns`),
  messages: (id: string) => api<unknown[]>('GET', `/v1/sessions/${id}/messages`),
  create: (body: CreateSession) => api<Session>('POST', '/v1/sessions', body),
  steer: (id: string, prompt: string, mode: 'queue' | 'interrupt') => api<unknown>('POST', `/v1/sessions/${id}/steer`, { prompt, mode }),
  action: (id: string, action: 'stop' | 'cancel' | 'resume' | 'archive') => api<unknown>('POST', `/v1/sessions/${id}/${action}`),
  egress: (id: string, allow: string[]) => api<unknown>('POST', `/v1/sessions/${id}/egress`, { allow }),
  ticket: async (id: string, action: 'attach' | 'turn') =>
    (await api<{ ticket: string }>('POST', `/v1/sessions/${id}/attach-ticket`, { action })).ticket,
  agents: () => api<{ agents: { id: string }[]; default: string }>('GET', '/v1/agents'),
  exchange: (code: string) => api<unknown>('POST', '/v1/auth/signin', { code }),
  signout: () => api<unknown>('POST', '/v1/auth/signout'),
};
