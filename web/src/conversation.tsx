// The conversation: UIMessage parts (AI SDK UI message stream v1, DESIGN §5.1) rendered one by one.
import { memo, type ReactNode } from 'react';
import { Markdown } from './markdown';

export interface Part { type: string; [key: string]: unknown }
export interface Message { id: string; role: 'user' | 'assistant' | 'system'; parts: Part[] }

const str = (v: unknown) => (typeof v === 'string' ? v : v == null ? '' : JSON.stringify(v, null, 2));
const at = (p: Part): number | undefined => {
  const meta = (p.providerMetadata ?? p.callProviderMetadata) as { sortie?: { at?: string } } | undefined;
  const t = meta?.sortie?.at;
  return t ? Date.parse(t) : undefined;
};

/** A unified diff of two texts (line-level, common prefix and suffix trimmed; enough for agents' edits). */
export function unifiedDiff(path: string, oldText: string | null | undefined, newText: string): string[] {
  const lines = (text: string) => (text === '' ? [] : text.replace(/\n$/, '').split('\n'));
  const a = oldText ? lines(oldText) : [];
  const b = lines(newText);
  path = path.replace(/^\/workspace\//, '');
  let start = 0;
  while (start < a.length && start < b.length && a[start] === b[start]) start++;
  let endA = a.length, endB = b.length;
  while (endA > start && endB > start && a[endA - 1] === b[endB - 1]) { endA--; endB--; }
  const ctx = 3;
  const from = Math.max(0, start - ctx);
  const out = [`--- ${oldText == null ? '/dev/null' : `a/${path}`}`, `+++ b/${path}`,
    `@@ -${from + 1},${Math.min(a.length, endA + ctx) - from} +${from + 1},${Math.min(b.length, endB + ctx) - from} @@`];
  for (let i = from; i < start; i++) out.push(` ${a[i]}`);
  for (let i = start; i < endA; i++) out.push(`-${a[i]}`);
  for (let i = start; i < endB; i++) out.push(`+${b[i]}`);
  for (let i = endA; i < Math.min(a.length, endA + ctx); i++) out.push(` ${a[i]}`);
  return out;
}

function Diff({ data }: { data: { path?: string; oldText?: string | null; newText?: string } }) {
  const lines = unifiedDiff(data.path ?? '?', data.oldText, data.newText ?? '');
  return (
    <details className="card diff" open>
      <summary><span className="kind">diff</span> <code>{(data.path ?? '').replace(/^\/workspace\//, '')}</code></summary>
      <pre>{lines.map((l, i) => <div key={i} className={l.startsWith('+') && !l.startsWith('+++') ? 'add' : l.startsWith('-') && !l.startsWith('---') ? 'del' : l.startsWith('@@') ? 'hunk' : ''}>{l}</div>)}</pre>
    </details>
  );
}

function Plan({ data }: { data: { entries?: { content: string; status?: string; priority?: string }[] } }) {
  const entries = data.entries ?? [];
  return (
    <div className="card plan" aria-label="plan">
      <div className="kind">plan · {entries.filter((e) => e.status === 'completed').length}/{entries.length}</div>
      <ul>
        {entries.map((e, i) => (
          <li key={i} className={`plan-${e.status ?? 'pending'}`}>
            <input type="checkbox" readOnly checked={e.status === 'completed'} aria-label={e.content} />
            {e.status === 'in_progress' ? <strong>{e.content}</strong> : e.content}
          </li>
        ))}
      </ul>
    </div>
  );
}

function duration(part: Part, next?: Part): string | null {
  const a = at(part), b = next && at(next);
  if (a == null || b == null) return null;
  const ms = Math.max(0, b - a);
  return ms < 1000 ? `${ms} ms` : `${(ms / 1000).toFixed(1)} s`;
}

function Tool({ part, next }: { part: Part; next?: Part }) {
  const input = part.input as { title?: string } | undefined;
  const title = str(part.title ?? input?.title ?? part.toolName);
  const state = str(part.state);
  const status = state === 'output-available' ? 'done' : state === 'output-error' ? 'failed' : 'running';
  return (
    <details className={`card tool tool-${status}`}>
      <summary>
        <span className="kind">{str(part.toolName)}</span> {title} <span className={`status status-${status}`}>{status}</span>
        {status !== 'running' && duration(part, next) && <span className="took">{duration(part, next)}</span>}
      </summary>
      {part.input != null && <pre className="io">{str(part.input)}</pre>}
      {part.output != null && <pre className="io">{str(part.output)}</pre>}
      {part.errorText != null && <pre className="io err">{str(part.errorText)}</pre>}
    </details>
  );
}

function Reasoning({ part, seconds }: { part: Part; seconds?: number }) {
  const streaming = part.state === 'streaming';
  return (
    <details className="reasoning">
      <summary>{streaming ? 'Thinking…' : seconds != null ? `Thought for ${seconds}s` : 'Thought'}</summary>
      <Markdown text={str(part.text)} />
    </details>
  );
}

export interface Actions { allowHost?: (host: string) => void }

export const PartView = memo(function PartView({ part, next, actions }: { part: Part; next?: Part; actions: Actions }) {
  const data = (part.data ?? {}) as Record<string, unknown>;
  switch (part.type) {
    case 'text':
      return <Markdown text={str(part.text)} />;
    case 'reasoning': {
      const a = at(part), b = next && at(next);
      return <Reasoning part={part} seconds={a != null && b != null ? Math.max(0, Math.round((b - a) / 1000)) : undefined} />;
    }
    case 'dynamic-tool':
      return <Tool part={part} next={next} />;
    case 'data-acp-diff':
      return <Diff data={data} />;
    case 'data-acp-plan':
      return <Plan data={data} />;
    case 'data-acp-terminal':
      return (
        <div className="card terminal">
          <div className="kind">terminal {data.exitStatus != null ? `· exit ${str((data.exitStatus as { exitCode?: number }).exitCode ?? data.exitStatus)}` : ''}</div>
          <pre>{str(data.output)}</pre>
        </div>
      );
    case 'data-sortie-egress-denied':
      return (
        <div className="card egress" role="alert">
          <span>Blocked connection to <code>{str(data.host)}:{str(data.port)}</code> ({str(data.reason)})</span>
          {actions.allowHost && <button onClick={() => actions.allowHost?.(str(data.host))}>Allow {str(data.host)}</button>}
        </div>
      );
    case 'data-sortie-delivery': {
      const stat = (data.diffStat ?? {}) as { files?: number; insertions?: number; deletions?: number };
      return (
        <div className="card delivery" aria-label="delivery">
          <span className="kind">{data.pushed ? 'delivered' : 'not pushed'}</span> <code>{str(data.branch)}</code>{' '}
          <code>{str(data.headSha).slice(0, 10)}</code>{' '}
          <span>{stat.files ?? 0} files <span className="add">+{stat.insertions ?? 0}</span> <span className="del">−{stat.deletions ?? 0}</span></span>
          {typeof data.prUrl === 'string' && <> · <a href={data.prUrl}>pull request</a></>}
        </div>
      );
    }
    case 'data-sortie-priming':
      return <div className="note">context: {str(data.rung ?? data)}</div>;
    case 'step-start':
    case 'data-acp-usage':
    case 'data-acp-mode':
    case 'data-acp-commands':
    case 'data-sortie-phase':
    case 'data-sortie-usage':
      return null;
    default:
      if (part.type.startsWith('tool-')) return <Tool part={{ ...part, toolName: part.type.slice(5) }} />;
      return <div className="note">{part.type}</div>;
  }
});

const TOOLISH = new Set(['dynamic-tool', 'data-acp-diff', 'data-acp-terminal', 'step-start']);

export const MessageView = memo(function MessageView({ message, actions }: { message: Message; actions: Actions }) {
  if (message.role === 'user') {
    const text = message.parts.filter((p) => p.type === 'text').map((p) => str(p.text)).join('\n');
    return <div className="msg user" data-message-id={message.id}><div className="prompt">{text}</div></div>;
  }
  // Runs of two or more tool calls (with their diffs and terminals) are grouped in one collapsible box.
  const parts = message.parts;
  const out: ReactNode[] = [];
  const view = (i: number) => (
    <PartView key={(parts[i].id as string | undefined) ?? (parts[i].toolCallId as string | undefined) ?? i} part={parts[i]} next={parts[i + 1]} actions={actions} />
  );
  for (let i = 0; i < parts.length;) {
    let j = i;
    while (j < parts.length && TOOLISH.has(parts[j].type)) j++;
    const calls = parts.slice(i, j).filter((p) => p.type === 'dynamic-tool');
    if (calls.length >= 2) {
      const failed = calls.filter((p) => p.state === 'output-error').length;
      const running = calls.some((p) => p.state !== 'output-available' && p.state !== 'output-error');
      out.push(
        <details key={`group-${i}`} className="tools" open>
          <summary>{calls.length} tool calls{failed > 0 && <span className="status status-failed"> · {failed} failed</span>}{running && <span className="status status-running"> · running</span>}</summary>
          {Array.from({ length: j - i }, (_, k) => view(i + k))}
        </details>,
      );
      i = j;
    } else {
      for (let k = i; k < Math.max(j, i + 1); k++) out.push(view(k));
      i = Math.max(j, i + 1);
    }
  }
  return <div className="msg assistant" data-message-id={message.id}>{out}</div>;
});

export function Conversation({ messages, actions }: { messages: Message[]; actions: Actions }) {
  if (messages.length === 0) return <p className="empty">No messages yet.</p>;
  return <div className="conversation">{messages.map((m) => <MessageView key={m.id} message={m} actions={actions} />)}</div>;
}
