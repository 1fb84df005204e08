// What a session means to the person looking at it: the outcome that needs them (ready for review, PR
// open, failed, running, canceled) rather than the control plane's phase, and what the agent is doing now.
import type { Session } from './api';
import type { Message, Part } from './conversation';
import { span } from './conversation';

export type Tone = 'ok' | 'run' | 'fail' | 'muted' | 'attention';
export interface Outcome { label: string; tone: Tone; detail?: string }

/** The outcome a user cares about, from the session alone (`needsInput` when the page knows the agent waits). */
export function outcome(s: Pick<Session, 'phase' | 'failure' | 'pr' | 'head_sha' | 'queued_reason' | 'budget'>, needsInput?: string | null): Outcome {
  // The model proxy holds the agent at its token budget: it waits for someone to raise it.
  needsInput = needsInput || (s.budget?.paused_at ? 'budget reached' : null);
  switch (s.phase) {
    case 'canceled': return { label: 'Canceled', tone: 'muted' };
    case 'canceling': return { label: 'Canceling', tone: 'run' };
    case 'failed': return { label: 'Failed', tone: 'fail', detail: s.failure?.code };
    case 'queued': return { label: 'Queued', tone: 'run', detail: s.queued_reason ?? undefined };
    case 'provisioning':
    case 'running':
    case 'delivering':
      // The phase says more only while the agent is not yet, or no longer, at work.
      return needsInput ? { label: 'Needs input', tone: 'attention', detail: needsInput }
        : { label: 'Running', tone: 'run', detail: s.phase === 'running' ? undefined : s.phase };
    case 'idle':
    case 'hibernated':
      if (s.pr) return { label: 'PR open', tone: 'ok', detail: `#${s.pr.number}` };
      if (s.head_sha) return { label: 'Ready for review', tone: 'ok' };
      return { label: 'No changes', tone: 'muted' };
  }
}

/** Whether an egress allowlist admits `host`: the gateway allows listed names exactly (no wildcards). */
export function allows(allowlist: readonly string[], host: string): boolean {
  const name = host.toLowerCase().replace(/\.$/, '');
  return allowlist.some((entry) => entry.toLowerCase().replace(/\.$/, '') === name);
}

/**
 * The host the running agent is blocked on, if the newest thing it did was run into an egress denial
 * that the allowlist still refuses: the agent waits (or retries) until someone allows it.
 */
export function blockedOn(messages: readonly Message[], allowlist: readonly string[]): string | null {
  const last = messages[messages.length - 1];
  if (!last || last.role !== 'assistant') return null;
  for (let i = last.parts.length - 1; i >= 0; i--) {
    const p = last.parts[i];
    if (p.type === 'data-sortie-egress-denied') {
      const host = String((p.data as { host?: unknown } | undefined)?.host ?? '');
      return host && !allows(allowlist, host) ? host : null;
    }
    if (p.type === 'text' || p.type === 'reasoning' || p.type === 'dynamic-tool' && p.state === 'output-available') return null;
  }
  return null;
}

/** What the agent is doing now, from the newest part of a streaming answer, and since when (ms epoch). */
export interface Activity { what: string; since: number | null; command: boolean }

export function activity(messages: readonly Message[]): Activity | null {
  const last = messages[messages.length - 1];
  if (!last || last.role !== 'assistant') return null;
  for (let i = last.parts.length - 1; i >= 0; i--) {
    const p: Part = last.parts[i];
    if (p.type === 'dynamic-tool' || p.type.startsWith('tool-')) {
      const running = p.state !== 'output-available' && p.state !== 'output-error';
      if (!running) return { what: 'Working', since: null, command: false };
      const input = p.input as { title?: unknown } | undefined;
      const title = String(p.title ?? input?.title ?? p.toolName ?? 'a tool');
      return { what: `Running ${title}`, since: span(p).start ?? null, command: true };
    }
    if (p.type === 'reasoning') return { what: p.state === 'streaming' ? 'Thinking' : 'Working', since: null, command: false };
    if (p.type === 'text') return { what: p.state === 'streaming' ? 'Writing' : 'Working', since: null, command: false };
  }
  return { what: 'Starting', since: null, command: false };
}

/** A duration as a clock: `42s`, `3m05s`, `1h02m`. */
export function clock(ms: number): string {
  const s = Math.max(0, Math.floor(ms / 1000));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(s % 60).padStart(2, '0')}s`;
  return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, '0')}m`;
}

/** The turn number an assistant message answers (`<session>-t<n>`). */
export function turnOf(messageId: string): number | null {
  const n = /-t(\d+)$/.exec(messageId);
  return n ? Number(n[1]) : null;
}
