// The conversation: UIMessage parts (AI SDK UI message stream v1, DESIGN §5.1) rendered one by one.
import { memo, useState, type ReactNode } from 'react';
import { Markdown } from './markdown';
import { commandRun, TerminalBlock, type CommandRun } from './terminal';
import { Link } from './link';
import { allows } from './status';
import { files, ms } from './util';

export interface Part { type: string; [key: string]: unknown }
export interface Message { id: string; role: 'user' | 'assistant' | 'system'; parts: Part[] }

const str = (v: unknown) => (typeof v === 'string' ? v : v == null ? '' : JSON.stringify(v, null, 2));

/**
 * A part's own timestamps: `providerMetadata.sortie.at` (when it began, on its start chunk) and
 * `sortie.endedAt` (when it ended, on its end chunk, which carries `at` again because the SDK replaces a
 * reasoning part's metadata with the end chunk's). Tool calls keep the call's and the result's metadata
 * apart (`callProviderMetadata`, `resultProviderMetadata`); history from `GET /messages` uses
 * `providerMetadata`. A part without `endedAt` has no duration: the next part's start is not its end.
 */
export function span(p: Part): { start?: number; end?: number } {
  const sortie = (slot: unknown) => ((slot as { sortie?: { at?: unknown; endedAt?: unknown } } | undefined)?.sortie ?? {});
  const merged = { ...sortie(p.callProviderMetadata), ...sortie(p.providerMetadata), ...sortie(p.resultProviderMetadata) };
  const time = (v: unknown) => { const t = typeof v === 'string' ? Date.parse(v) : NaN; return Number.isNaN(t) ? undefined : t; };
  return { start: time(merged.at), end: time(merged.endedAt) };
}

/** How long a finished part took, from its own timestamps; null when it has not both. */
export function took(p: Part): number | null {
  const { start, end } = span(p);
  return start != null && end != null ? Math.max(0, end - start) : null;
}

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

/** A terminal part's output as a command run (the command, when known, is the tool call's). */
function terminalRun(terminal: Part, command: string | null): CommandRun {
  const data = (terminal.data ?? {}) as { output?: unknown; exitStatus?: { exitCode?: unknown; signal?: unknown } | null; truncated?: unknown };
  const exit = data.exitStatus ?? {};
  return {
    command,
    text: `${data.truncated ? '[earlier output dropped]\n' : ''}${typeof data.output === 'string' ? data.output : ''}`,
    exitCode: typeof exit.exitCode === 'number' ? exit.exitCode : null,
    signal: typeof exit.signal === 'string' ? exit.signal : null,
  };
}

function Tool({ part, terminal }: { part: Part; terminal?: Part }) {
  const input = part.input as { title?: string } | undefined;
  const title = str(part.title ?? input?.title ?? part.toolName);
  const state = str(part.state);
  const status = state === 'output-available' ? 'done' : state === 'output-error' ? 'failed' : 'running';
  const duration = status === 'running' ? null : took(part);
  // A command's output reads as a terminal, open, whether it failed or not; any other tool keeps its
  // input and output as JSON one click away.
  const called = commandRun(part);
  // An agent that reports the output as a terminal (Codex) has it there, not in the call's output.
  const run = terminal ? terminalRun(terminal, called?.command ?? title) : called;
  return (
    <details className={`card tool tool-${status}${run ? ' tool-cmd' : ''}`} open={run != null}>
      <summary>
        <span className="kind">{str(part.toolName)}</span> {title} <span className={`status status-${status}`}>{status}</span>
        {duration != null && <span className="took" title="how long the call took">{ms(duration)}</span>}
      </summary>
      {run ? <TerminalBlock run={run} running={status === 'running'} /> : (
        <>
          {part.input != null && <pre className="io">{str(part.input)}</pre>}
          {part.output != null && <pre className="io">{str(part.output)}</pre>}
          {part.errorText != null && <pre className="io err">{str(part.errorText)}</pre>}
        </>
      )}
    </details>
  );
}

function Reasoning({ part }: { part: Part }) {
  const streaming = part.state === 'streaming';
  const duration = streaming ? null : took(part);
  const label = streaming ? 'Thinking…' : duration == null ? 'Thought' : `Thought for ${duration < 1000 ? '<1' : Math.round(duration / 1000)}s`;
  return (
    <details className="reasoning">
      <summary>{label}</summary>
      <Markdown text={str(part.text)} />
    </details>
  );
}

const PRIMING: Record<string, string> = {
  session_load: 'The agent picked up its own saved session.',
  transcript: 'The agent was given the conversation so far (a fresh agent process).',
  task: 'The agent was given the original task (a fresh agent process).',
  none: 'The agent starts afresh: no earlier context could be given.',
};

/** The turn's token usage as the model proxy read it (`data-sortie-usage`, cumulative) and the agent's own
 * context-window report (`data-acp-usage` id `usage`). */
function UsageLine({ tokens, context }: { tokens?: Record<string, unknown>; context?: Record<string, unknown> }) {
  const n = (v: unknown) => (typeof v === 'number' ? v.toLocaleString('en-US') : '?');
  const bits: string[] = [];
  if (tokens) bits.push(`${n(tokens.inputTokens)} in · ${n(tokens.outputTokens)} out tokens${tokens.model ? ` (${str(tokens.model)})` : ''}`);
  if (context && typeof context.used === 'number' && typeof context.size === 'number' && context.size > 0) {
    bits.push(`context ${n(context.used)} / ${n(context.size)} (${Math.round((100 * context.used) / context.size)}%)`);
  }
  if (bits.length === 0) return null;
  return <div className="usage-line" aria-label="turn usage">{bits.join(' · ')}</div>;
}

/** How a turn ended, when the answer should say so below it. */
export interface TurnEnd { status: string; failure?: { code: string; reason: string } | null }

export interface Actions {
  /** Adds a host to the session's egress allowlist (the button on a blocked connection). */
  allowHost?: (host: string) => void;
  /** The session's allowlist: a blocked host it admits shows as allowed instead of offering the button. */
  allowed?: string[];
  /** Adds tokens to the session's budget (the button on a paused budget card). */
  raiseBudget?: (tokens: number) => void;
  /** Where the session's Files changed view is (the delivery card's file count links there). */
  filesHref?: string;
  /** Ended turns by number: an interrupted one is marked, a failed one ends with its failure. */
  ends?: Record<number, TurnEnd>;
}

export const PartView = memo(function PartView({ part, actions, repeats, terminal }: { part: Part; actions: Actions; repeats?: number; terminal?: Part }) {
  const data = (part.data ?? {}) as Record<string, unknown>;
  switch (part.type) {
    case 'text':
      return <Markdown text={str(part.text)} />;
    case 'reasoning':
      return <Reasoning part={part} />;
    case 'dynamic-tool':
      return <Tool part={part} terminal={terminal} />;
    case 'data-acp-diff':
      return <Diff data={data} />;
    case 'data-acp-plan':
      return <Plan data={data} />;
    case 'data-acp-terminal':
      // Shown in its tool call's card when the message has that call (see MessageView).
      return <div className="card terminal"><TerminalBlock run={terminalRun(part, null)} running={data.exitStatus == null} /></div>;
    case 'data-sortie-egress-denied': {
      const host = str(data.host);
      const allowed = allows(actions.allowed ?? [], host);
      return (
        <div className={`card egress${allowed ? ' egress-allowed' : ''}`} role={allowed ? undefined : 'alert'}>
          <span>Blocked connection to <code>{host}:{str(data.port)}</code> ({str(data.reason)}){repeats != null && repeats > 1 && <span className="repeats"> ×{repeats}</span>}</span>
          {allowed ? <span className="status status-done">allowed: the next connection goes through</span>
            : actions.allowHost && <button onClick={() => actions.allowHost?.(host)}>Allow {host}</button>}
        </div>
      );
    }
    case 'data-sortie-delivery': {
      const stat = (data.diffStat ?? {}) as { files?: number; insertions?: number; deletions?: number };
      const error = data.error as { code?: string; reason?: string } | undefined;
      const count = <>{files(stat.files ?? 0)} <span className="add">+{stat.insertions ?? 0}</span> <span className="del">−{stat.deletions ?? 0}</span></>;
      if (!data.pushed) {
        return (
          <div className={`card delivery-none${error ? ' delivery-failed' : ''}`} aria-label="delivery">
            <span className="kind">{error ? 'not delivered' : 'no changes'}</span>{' '}
            {error ? <span><strong>{error.code}</strong>: {error.reason}</span> : <span>This turn changed no files; <code>{str(data.branch)}</code> is as it was.</span>}
          </div>
        );
      }
      return (
        <div className="card delivery" aria-label="delivery">
          <span className="kind">delivered</span> <code>{str(data.branch)}</code>{' '}
          <code>{str(data.headSha).slice(0, 10)}</code>{' '}
          {actions.filesHref ? <Link to={actions.filesHref} className="stat">{count}</Link> : <span className="stat">{count}</span>}
          {typeof data.prUrl === 'string' && <> · <a href={data.prUrl}>pull request</a></>}
        </div>
      );
    }
    case 'data-acp-permission': {
      // The agent asked before a tool call; sortie's driver answers for the unattended agent.
      const answer = str(data.answer);
      const said = answer === 'allow_once' ? 'allowed once' : answer === 'allow_always' ? 'allowed always' : answer === 'cancelled' ? 'refused (no option to allow)' : answer;
      return (
        <div className={`note permission permission-${answer}`} role="status">
          Permission asked: {said}{typeof data.option === 'string' && data.option && <> (“{data.option}”)</>}, answered by sortie
        </div>
      );
    }
    case 'data-sortie-priming': {
      const rung = str(data.rung);
      return (
        <div className="note priming" data-rung={rung}>
          {PRIMING[rung] ?? `Context: ${rung}`}
          {data.loadError != null && <> (its saved session did not load: {str(data.loadError)})</>}
        </div>
      );
    }
    case 'data-sortie-notice':
      return <div className="note notice" role="status">{str(data.message)}</div>;
    case 'data-sortie-budget': {
      // One card per turn (id `budget`), replaced as the pause is raised or runs out.
      const state = str(data.state);
      const limit = Number(data.limit) || 0;
      const unit = data.kind === 'tokens' ? 'tokens' : 'CPU seconds';
      return (
        <div className={`card budget budget-${state}`} role={state === 'paused' ? 'alert' : 'status'}>
          <span className="kind">budget {state}</span>{' '}
          <span>{str(data.spent)} of {limit} {unit}. {str(data.how)}</span>
          {state === 'paused' && data.kind === 'tokens' && actions.raiseBudget && limit > 0
            && <button onClick={() => actions.raiseBudget?.(limit)}>Add {limit} tokens</button>}
        </div>
      );
    }
    case 'data-sortie-truncated':
      return <div className="note notice" role="status">{str(data.reason)}</div>;
    case 'step-start':
    case 'data-sortie-usage': // one line at the end of the message (UsageLine)
    case 'data-acp-usage':
    case 'data-acp-mode':
    case 'data-acp-commands':
      return null;
    case 'data-sortie-phase': {
      // Timings show in the header; a phase says something only while it waits (the next one replaces it).
      const note = (part.data as { note?: unknown } | undefined)?.note;
      return typeof note === 'string' && note ? <div className="note waiting" role="status">{note}</div> : null;
    }
    default:
      if (part.type.startsWith('tool-')) return <Tool part={{ ...part, toolName: part.type.slice(5) }} />;
      return <div className="note">{part.type}</div>;
  }
});

/** A failure's reason; the output tail it quotes (the agent's stderr, the setup script's output) reads as a terminal. */
export function FailureReason({ text }: { text: string }) {
  const quote = /;? (?:the agent's|its) last (?:words|output):\s*/.exec(text);
  const cut = quote ? quote.index : text.indexOf('\n');
  if (cut < 0) return <span>{text}</span>;
  const tail = quote ? text.slice(quote.index + quote[0].length) : text.slice(cut + 1);
  return (
    <>
      <span>{text.slice(0, cut)}{quote && ' — its last output:'}</span>
      <TerminalBlock run={{ command: null, text: tail, exitCode: null, signal: null }} />
    </>
  );
}

/** A user prompt; a long one (a pasted log, a whole spec) shows its first lines until expanded. */
function Prompt({ text }: { text: string }) {
  const [open, setOpen] = useState(false);
  const lines = text.split('\n');
  const long = lines.length > PROMPT_LINES + 2;
  return (
    <>
      <div className="prompt">{long && !open ? lines.slice(0, PROMPT_LINES).join('\n') : text}</div>
      {long && <button className="link more" aria-expanded={open} onClick={() => setOpen(!open)}>{open ? 'Show less' : `Show all ${lines.length} lines`}</button>}
    </>
  );
}
const PROMPT_LINES = 6;

const TOOLISH = new Set(['dynamic-tool', 'data-acp-diff', 'data-acp-terminal', 'data-acp-permission', 'step-start']);

export const MessageView = memo(function MessageView({ message, actions }: { message: Message; actions: Actions }) {
  if (message.role === 'user') {
    const text = message.parts.filter((p) => p.type === 'text').map((p) => str(p.text)).join('\n');
    return <div className="msg user" data-message-id={message.id}><Prompt text={text} /></div>;
  }
  // Runs of two or more tool calls (with their diffs and terminals) are grouped in one collapsible box.
  const parts = message.parts;
  const out: ReactNode[] = [];
  // An agent that retries a blocked host gets one card for it, with the count.
  // The card sits where the host was first blocked and says the newest attempt's reason.
  const denials = new Map<string, { first: number; latest: number; count: number }>();
  parts.forEach((p, i) => {
    if (p.type !== 'data-sortie-egress-denied') return;
    const d = (p.data ?? {}) as { host?: unknown; port?: unknown };
    const key = `${str(d.host)}:${str(d.port)}`;
    const seen = denials.get(key);
    if (seen) { seen.count++; seen.latest = i; } else denials.set(key, { first: i, latest: i, count: 1 });
  });
  // Terminal parts by the tool call they belong to: the call's card shows them.
  const terminals = new Map<string, Part>();
  const calls = new Set<string>();
  for (const p of parts) {
    if (p.type === 'data-acp-terminal') terminals.set(String((p.data as { toolCallId?: unknown } | undefined)?.toolCallId ?? ''), p);
    else if (p.type === 'dynamic-tool' && typeof p.toolCallId === 'string') calls.add(p.toolCallId);
  }
  const view = (i: number) => {
    let repeats: number | undefined;
    const p = parts[i];
    if (p.type === 'data-acp-terminal' && calls.has(String((p.data as { toolCallId?: unknown } | undefined)?.toolCallId ?? ''))) return null;
    if (parts[i].type === 'data-sortie-egress-denied') {
      const d = (parts[i].data ?? {}) as { host?: unknown; port?: unknown };
      const seen = denials.get(`${str(d.host)}:${str(d.port)}`)!;
      if (seen.first !== i) return null;
      repeats = seen.count;
      return <PartView key={`egress-${i}`} part={parts[seen.latest]} actions={actions} repeats={repeats} />;
    }
    const terminal = p.type === 'dynamic-tool' ? terminals.get(String(p.toolCallId)) : undefined;
    return <PartView key={(parts[i].id as string | undefined) ?? (parts[i].toolCallId as string | undefined) ?? i} part={parts[i]} actions={actions} repeats={repeats} terminal={terminal} />;
  };
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
  const find = (type: string, id: string) => parts.find((p) => p.type === type && p.id === id)?.data as Record<string, unknown> | undefined;
  const n = /-t(\d+)$/.exec(message.id);
  const end = n ? actions.ends?.[Number(n[1])] : undefined;
  return (
    <div className="msg assistant" data-message-id={message.id}>
      {out}
      <UsageLine tokens={find('data-sortie-usage', 'tokens')} context={find('data-acp-usage', 'usage')} />
      {end?.status === 'stopped' && <div className="note interrupted" role="status">Interrupted: the turn was stopped here.</div>}
      {end?.failure && (end.status === 'failed' || end.status === 'lost') && (
        <div className="card failure" role="alert" aria-label="turn failure">
          <span className="kind">turn {end.status}</span> <strong>{end.failure.code}</strong>: <FailureReason text={end.failure.reason} />
        </div>
      )}
    </div>
  );
});

export function Conversation({ messages, actions }: { messages: Message[]; actions: Actions }) {
  if (messages.length === 0) return <p className="empty">No messages yet.</p>;
  return <div className="conversation">{messages.map((m) => <MessageView key={m.id} message={m} actions={actions} />)}</div>;
}
