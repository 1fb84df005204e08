import { useCallback, useEffect, useLayoutEffect, useMemo, useRef, useState, type FormEvent } from 'react';
import { useChat } from '@ai-sdk/react';
import { DefaultChatTransport, type UIMessage } from 'ai';
import { ApiError, client, LIVE, sentence, type MessagesPage, type Session, type Turn, type UiMessage } from './api';
import { Conversation, type Message, type TurnEnd } from './conversation';
import { subscribeEvents } from './events';
import { FilesChanged } from './files';
import { Link } from './link';
import { OutcomeBadge, PhaseBadge } from './sessions';
import { activity, blockedOn, clock, outcome } from './status';
import { age, files, ms } from './util';

/** `GET /messages` as useChat's messages: the API documents `parts` only as objects (they are AI SDK parts). */
const asUi = (m: UiMessage[]) => m as unknown as UIMessage[];

type Action = 'stop' | 'cancel' | 'resume' | 'archive' | 'retry';
/** The turn the last assistant message answers: its id is `<session>-t<n>` (the driver names it, every replay keeps it). */
export function turnOfLastAnswer(messages: UIMessage[]): number | null {
  for (let m = messages.length - 1; m >= 0; m--) {
    if (messages[m].role !== 'assistant') continue;
    const n = /-t(\d+)$/.exec(messages[m].id);
    return n ? Number(n[1]) : null;
  }
  return null;
}

/** The stored messages, each kept as shown instead where the page shows more of it (same id, larger parts). */
export function newest(stored: UIMessage[], shown: UIMessage[]): UIMessage[] {
  const byId = new Map(shown.map((m) => [m.id, m]));
  const size = (m: UIMessage) => JSON.stringify(m.parts).length;
  return stored.map((m) => {
    const seen = byId.get(m.id);
    return seen && size(seen) > size(m) ? seen : m;
  });
}

/**
 * Turns loaded on demand above the newest page: they end right before turn `upTo` (the first turn of the
 * newest page when they were loaded), and `older` is the cursor to the turns before them.
 */
export interface Earlier { upTo: number; messages: UIMessage[]; older: number | null }

/**
 * The earlier turns to show above a newest page whose older cursor is `older`: only those that end where
 * it begins. A turn added to a long session moves the newest page on; the turns loaded before are then
 * dropped (the button loads them again), never shown with a gap.
 */
export function earlierShown(earlier: Earlier | null, older: number | null): Earlier | null {
  return earlier && older !== null && earlier.upTo === older ? earlier : null;
}

/** The cursor the next "Show earlier turns" loads before, or null when every turn is shown. */
export function nextOlder(earlier: Earlier | null, older: number | null): number | null {
  const shown = earlierShown(earlier, older);
  return shown ? shown.older : older;
}

/** The earlier turns once `page` (the page before `nextOlder(earlier, older)`) has loaded. */
export function withEarlier(earlier: Earlier | null, older: number, page: MessagesPage): Earlier {
  const shown = earlierShown(earlier, older);
  return { upTo: older, messages: [...asUi(page.messages), ...(shown?.messages ?? [])], older: page.older };
}

/** The turn's phases in the order they happen (DESIGN §2), then any the server adds. */
const PHASE_ORDER = ['queued', 'clone', 'primed_clone', 'sandbox', 'warm_sandbox', 'setup', 'first_part', 'agent_turn', 'delivery'];
function phaseOrder(timings: Record<string, number>): [string, number][] {
  const rank = (k: string) => { const i = PHASE_ORDER.indexOf(k); return i < 0 ? PHASE_ORDER.length : i; };
  return Object.entries(timings).sort(([a], [b]) => rank(a) - rank(b) || a.localeCompare(b));
}

function Header({ s, turns, onAction, busy, streaming, needsInput, tab }: { s: Session; turns: Turn[]; onAction: (a: Action) => void; busy: boolean; streaming: boolean; needsInput: string | null; tab: Tab }) {
  const last = turns[turns.length - 1];
  const timings = last?.timings ?? {};
  const live = LIVE.includes(s.phase);
  const [stat, setStat] = useState<{ files: number; insertions: number; deletions: number } | null>(null);
  // The branch's totals, as Files changed counts them (one diff: the card, the header and the view agree).
  useEffect(() => {
    let on = true;
    if (!s.head_sha) { setStat(null); return; }
    client.diff(s.id).then((d) => { if (on) setStat({ files: d.files_changed, insertions: d.insertions, deletions: d.deletions }); }).catch(() => {});
    return () => { on = false; };
  }, [s.id, s.head_sha]);
  return (
    <section className="session-header" aria-label="session">
      <div className="title-row">
        <OutcomeBadge outcome={outcome(s, needsInput)} />
        <h1>{s.title || s.id}</h1>
        <div className="actions">
          {/* A turn this page started is live before the control plane's event says so. */}
          <button onClick={() => onAction('stop')} disabled={busy || !(live || streaming)}>Stop</button>
          <button onClick={() => onAction('cancel')} disabled={busy || s.phase === 'canceled' || s.phase === 'canceling'}>Cancel</button>
          {s.phase === 'failed' && last && <button onClick={() => onAction('retry')} disabled={busy} title="Run the last prompt again">Retry</button>}
          {s.phase === 'hibernated' && <button onClick={() => onAction('resume')} disabled={busy}>Wake</button>}
          <button onClick={() => onAction('archive')} disabled={busy || s.archived}>{s.archived ? 'Archived' : 'Archive'}</button>
        </div>
      </div>
      <dl className="facts">
        <div><dt>State</dt><dd><PhaseBadge phase={s.phase} /> <span className="sub">sandbox {s.sandbox}</span></dd></div>
        <div><dt>Repo</dt><dd><code>{s.repo}</code>{s.base && <> @ <code>{s.base}</code></>}</dd></div>
        <div><dt>Agent</dt><dd>{s.agent}{s.model && ` · ${s.model}`}</dd></div>
        <div><dt>Branch</dt><dd><code className="branch">{s.branch}</code>{s.head_sha && <> at <code>{s.head_sha.slice(0, 10)}</code></>}{s.pr && <> · <a href={s.pr.url}>PR #{s.pr.number}</a></>}
        </dd></div>
        {stat && <div><dt>Files changed</dt><dd><Link to={`/sessions/${s.id}/files`} className="stat"><span aria-label="diff stat">{files(stat.files)} <span className="add">+{stat.insertions}</span> <span className="del">−{stat.deletions}</span></span></Link></dd></div>}
        <div><dt>Turns</dt><dd>{s.turns}</dd></div>
        <div><dt>Usage</dt><dd>{s.usage.compute_seconds}s compute · {s.usage.input_tokens} in / {s.usage.output_tokens} out tokens</dd></div>
        <div><dt>Created</dt><dd title={s.created_at}>{age(s.created_at)} ago</dd></div>
      </dl>
      {Object.keys(timings).length > 0 && (
        <ol className="timings" aria-label={`turn ${last.n} timings`}>
          <li className="label">Turn {last.n}{last.status !== 'running' && ` · ${last.status}`}</li>
          {phaseOrder(timings).map(([k, v]) => <li key={k}><span>{k.replace('_', ' ')}</span> {ms(v)}</li>)}
        </ol>
      )}
      {s.failure && <p className="error failure-line" role="alert"><strong>{s.failure.code}</strong>: {s.failure.reason}</p>}
      {s.queued_reason && <p className="note">Queued: {s.queued_reason}</p>}
      <nav className="tabs" aria-label="session views">
        <Link to={`/sessions/${s.id}`} className={tab === 'conversation' ? 'tab active' : 'tab'}>Conversation</Link>
        <Link to={`/sessions/${s.id}/files`} className={tab === 'files' ? 'tab active' : 'tab'}>Files changed{stat && <span className="count"> {stat.files}</span>}</Link>
      </nav>
    </section>
  );
}

/** Re-renders every `ms` while `on`, for clocks. */
function useNow(on: boolean, ms = 1000): number {
  const [now, setNow] = useState(() => Date.now());
  useEffect(() => {
    if (!on) return;
    setNow(Date.now());
    const timer = setInterval(() => setNow(Date.now()), ms);
    return () => clearInterval(timer);
  }, [on, ms]);
  return now;
}

/** The pinned line of a running turn: what the agent does now, for how long, and the turn's clock. */
function StatusLine({ messages, turn }: { messages: UIMessage[]; turn: Turn | undefined }) {
  const now = useNow(true);
  const doing = activity(messages as unknown as Message[]);
  const started = turn?.started_at ? Date.parse(turn.started_at) : null;
  return (
    <div className="status-line" role="status" aria-label="agent status">
      <span className="pulse" aria-hidden="true" />
      <span className="doing">{doing?.what ?? 'Starting'}{doing?.since != null && <> · {clock(now - doing.since)}</>}</span>
      {started != null && <span className="turn-clock">turn {turn?.n} · {clock(now - started)}</span>}
    </div>
  );
}

type Tab = 'conversation' | 'files';

function Chat({ id, initial, onActivity, reattach, syncKey, runningTurn, allowed, session, turns, onBusy, onBlocked, visible }: { visible: boolean; id: string; initial: MessagesPage; onActivity: () => void; reattach: number; syncKey: string; runningTurn: number | null; allowed: string[]; session: Session; turns: Turn[]; onBusy: (busy: boolean) => void; onBlocked: (host: string | null) => void }) {
  const [streamError, setStreamError] = useState<string | null>(null);
  // The newest page's cursor to older turns, and the older turns loaded on demand.
  const [older, setOlder] = useState<number | null>(initial.older);
  const [earlier, setEarlier] = useState<Earlier | null>(null);
  const transport = useMemo(() => new DefaultChatTransport({
    api: `/v1/sessions/${id}/stream`,
    credentials: 'omit',
    resumeStreamIsReplay: true,
    // Every connect and every send mints a fresh single-use ticket.
    prepareSendMessagesRequest: async ({ messages, trigger, messageId, id: chatId }) => ({
      headers: { Authorization: `Ticket ${await client.ticket(id, 'turn')}` },
      body: { id: chatId, messages: messages.slice(-1), trigger, messageId },
    }),
    prepareReconnectToStreamRequest: async () => ({
      api: `/v1/sessions/${id}/stream`,
      headers: { Authorization: `Ticket ${await client.ticket(id, 'attach')}` },
    }),
  }), [id]);
  // The turn this chat has a stream of (or had, to its end); see the attach effect below.
  const attachedTurn = useRef<number | null>(runningTurn);
  // The prompt of a send in flight through the chat (null once its stream began or it was refused).
  const sending = useRef<string | null>(null);
  const { messages, sendMessage, status, resumeStream, setMessages } = useChat({
    id,
    messages: asUi(initial.messages),
    transport,
    resume: true,
    onError: (e: Error) => {
      // A refused send: the prompt goes back into the box, its optimistic message away, and the API's
      // sentence shows (the transport throws the error body as text).
      const prompt = sending.current;
      sending.current = null;
      if (prompt !== null) {
        setMessages((ms) => {
          const last = ms[ms.length - 1];
          return last?.role === 'user' ? ms.slice(0, -1) : ms;
        });
        setText((t) => t || prompt);
        setError(`Not sent: ${sentence(e.message)}`);
        return;
      }
      setStreamError(sentence(e.message));
    },
    onFinish: ({ isDisconnect }) => {
      // A stream the network (or the gateway, for a slow client) cut: its turn may still run, attach again.
      if (isDisconnect) attachedTurn.current = null;
      onActivity();
    },
  });
  // A turn started outside this chat (Retry in the header): reload the history, then attach to its stream.
  useEffect(() => {
    if (reattach === 0) return;
    void client.messages(id).then((page) => { setOlder(page.older); setMessages(asUi(page.messages)); void resumeStream(); }).catch(() => {});
  }, [reattach]); // eslint-disable-line react-hooks/exhaustive-deps
  const idle = status === 'ready' || status === 'error';
  const idleRef = useRef(idle);
  idleRef.current = idle;
  const shown = useRef(messages);
  shown.current = messages;
  // null: the first sync runs on mount too (the history the page loaded may predate the phase it shows).
  const syncedKey = useRef<string | null>(null);
  // A turn runs that this chat has no stream of (a queued steer that began after the last turn ended,
  // or a turn started by another client): take the history and attach to it. The turn a stream carries
  // is known from its message id, so a turn this page streamed to its end is not attached again when the
  // control plane still says it runs (an attach replays the turn from its start: it never duplicates,
  // but the page would show the turn rebuilding). The turn running when this chat mounted is the one
  // `resume: true` attaches to on mount. This effect runs before the sync below and its fetch counts as
  // that sync, so the sync cannot show the turn's stored part while the attach is on its way.
  const streamingTurn = status === 'streaming' ? turnOfLastAnswer(messages) : null;
  useEffect(() => {
    if (streamingTurn !== null) attachedTurn.current = streamingTurn;
  }, [streamingTurn]);
  useEffect(() => {
    if (runningTurn === null || !idle) return;
    if (attachedTurn.current === runningTurn) return;
    attachedTurn.current = runningTurn;
    syncedKey.current = syncKey;
    // The stored part of that turn is left out: the attach replays it from its start, and showing it first
    // would show it vanish and grow back.
    const answer = `${id}-t${runningTurn}`;
    void client.messages(id).then((page) => { setOlder(page.older); setMessages(asUi(page.messages).filter((x) => x.id !== answer)); void resumeStream(); }).catch(() => {});
  }, [runningTurn, status]); // eslint-disable-line react-hooks/exhaustive-deps
  // The control plane saw the session change (a turn ended or began elsewhere): once no stream is open,
  // take the stored history, so a turn that ended before this page could attach still shows, and a turn
  // that ended while it streamed shows as stored (the transcript is the record, the live view a preview).
  // A history that comes back after a stream began is dropped (the stream is newer), and a stored message
  // that holds less than the one shown keeps the shown one (the recorder stores a part up to 100 ms after
  // it streamed; the next sync brings the rest).
  useEffect(() => {
    if (!idle || syncedKey.current === syncKey) return;
    syncedKey.current = syncKey;
    let live = true;
    void client.messages(id).then((page) => {
      if (live && idleRef.current) { setOlder(page.older); setMessages(newest(asUi(page.messages), shown.current)); }
    }).catch(() => {});
    return () => { live = false; };
  }, [syncKey, idle]); // eslint-disable-line react-hooks/exhaustive-deps
  const busy = status === 'streaming' || status === 'submitted';
  useEffect(() => { if (status === 'streaming') sending.current = null; }, [status]);
  useEffect(() => onBusy(busy), [busy]); // eslint-disable-line react-hooks/exhaustive-deps
  const blocked = useMemo(() => (busy || runningTurn !== null ? blockedOn(messages as unknown as Message[], allowed) : null), [messages, allowed, busy, runningTurn]);
  useEffect(() => onBlocked(blocked), [blocked]); // eslint-disable-line react-hooks/exhaustive-deps
  const [text, setText] = useState('');
  const [mode, setMode] = useState<'queue' | 'interrupt'>('queue');
  const [error, setError] = useState<string | null>(null);
  const [notice, setNotice] = useState<string | null>(null);
  const above = earlierShown(earlier, older);
  const conversation = useMemo(() => (above ? [...above.messages, ...messages] : messages), [above, messages]);
  const before = nextOlder(earlier, older);
  const [loadingEarlier, setLoadingEarlier] = useState(false);
  const showEarlier = async () => {
    if (before === null || older === null) return;
    setLoadingEarlier(true);
    try {
      const page = await client.messages(id, before);
      setEarlier((e) => withEarlier(e, older, page));
    } catch (err) {
      setError(err instanceof ApiError ? `${err.code}: ${err.message}` : String(err));
    } finally { setLoadingEarlier(false); }
  };
  // A queued or interrupting prompt's notice goes once its turn runs.
  useEffect(() => { if (status === 'streaming') setNotice(null); }, [status]);
  useEffect(() => { setNotice(null); }, [runningTurn]);
  const allowHost = useCallback(async (host: string) => {
    try {
      const s = await client.session(id);
      await client.egress(id, [...new Set([...s.egress.allow, host])]);
      onActivity();
    } catch (e) { setError((e as ApiError).message); }
  }, [id, onActivity]);
  const raiseBudget = useCallback(async (tokens: number) => {
    try {
      await client.raiseBudget(id, tokens);
      onActivity();
    } catch (e) { setError((e as ApiError).message); }
  }, [id, onActivity]);
  // Stable while the allowlist's value is (the session is polled): every part view is memoized on it.
  const allowedKey = allowed.join('\n');
  // How each ended turn ended (a stopped one is marked, a failed one shows its failure), stable while
  // the turns' outcomes are.
  const endsKey = turns.filter((t) => t.status === 'stopped' || t.status === 'failed' || t.status === 'lost')
    .map((t) => `${t.n}\u0000${t.status}\u0000${t.failure?.code ?? ''}\u0000${t.failure?.reason ?? ''}`).join('\u0001');
  const ends = useMemo(() => {
    const out: Record<number, TurnEnd> = {};
    for (const t of turns) if (t.status === 'stopped' || t.status === 'failed' || t.status === 'lost') out[t.n] = { status: t.status, failure: t.failure };
    return out;
  }, [endsKey]); // eslint-disable-line react-hooks/exhaustive-deps
  const actions = useMemo(() => ({ allowHost, raiseBudget, allowed: allowedKey ? allowedKey.split('\n') : [], filesHref: `/sessions/${id}/files`, ends }), [allowHost, raiseBudget, allowedKey, id, ends]);
  const submit = async (e: FormEvent) => {
    e.preventDefault();
    const prompt = text.trim();
    if (!prompt) return;
    setText('');
    setError(null);
    setStreamError(null);
    try {
      if (mode === 'queue' && status !== 'streaming' && status !== 'submitted') {
        sending.current = prompt;
        await sendMessage({ text: prompt });
      } else if (mode === 'queue') {
        // It runs after the current turn; the chat attaches to it when it starts.
        await client.steer(id, prompt, mode);
        setNotice('Queued: it runs when the current turn ends.');
        onActivity();
      } else {
        // The running turn stops first; the chat attaches to the new turn when the session reports it
        // running (the effect on `runningTurn` above), so no stream opens on the turn that is stopping.
        const turn = await client.steer(id, prompt, mode);
        setNotice(`Interrupting: turn ${turn.n} starts when the current turn has stopped.`);
        onActivity();
      }
    } catch (err) {
      // Refused: the prompt is not lost.
      setText((t) => t || prompt);
      setError(err instanceof ApiError ? `Not sent: ${err.message}` : String(err));
    }
  };
  // Follow the stream while the reader is at the end; scrolling up stops it, "Jump to latest" resumes.
  const [following, setFollowing] = useState(true);
  // The last scroll position seen, the page's own scrolls included: a move up is the reader's.
  const lastY = useRef(0);
  useEffect(() => {
    const onScroll = () => {
      const y = window.scrollY;
      if (window.innerHeight + y >= document.documentElement.scrollHeight - 48) setFollowing(true);
      else if (y < lastY.current - 8) setFollowing(false);
      lastY.current = y;
    };
    addEventListener('scroll', onScroll, { passive: true });
    return () => removeEventListener('scroll', onScroll);
  }, []);
  const live = busy || runningTurn !== null;
  useLayoutEffect(() => {
    if (!live || !following || !visible) return;
    window.scrollTo(0, document.documentElement.scrollHeight);
    lastY.current = window.scrollY;
  }, [messages, live, following, visible]);
  const jump = () => {
    setFollowing(true);
    window.scrollTo(0, document.documentElement.scrollHeight);
    lastY.current = window.scrollY;
  };
  // Prompts waiting behind the running turn (one sent while the session rests starts at once and shows
  // as the conversation's newest prompt instead).
  const pending = runningTurn === null ? [] : turns.filter((t) => t.status === 'accepted' && t.n > runningTurn);
  const closed = session.phase === 'canceled' || session.phase === 'canceling' ? 'This session is canceled: it takes no more turns.'
    : session.archived ? 'This session is archived: unarchive it (sortie archive --undo) to steer it again.' : null;
  return (
    <>
      {streamError && <p className="note" role="status">Stream unavailable: {streamError}. The session's state above still updates.</p>}
      {before !== null && <button className="link more" onClick={() => void showEarlier()} disabled={loadingEarlier}>Show earlier turns</button>}
      <Conversation messages={conversation as unknown as Message[]} actions={actions} />
      {pending.length > 0 && (
        <ol className="pending" aria-label="queued prompts">
          {pending.map((t) => <li key={t.n}><span className="kind">queued · turn {t.n}</span> <span className="pending-prompt">{t.prompt.split('\n').find((l) => l.trim() && !l.startsWith('#!')) ?? t.prompt}</span></li>)}
        </ol>
      )}
      {live && <StatusLine messages={messages} turn={turns.find((t) => t.n === (runningTurn ?? turnOfLastAnswer(messages)))} />}
      {live && !following && visible && <button className="jump" onClick={jump}>Jump to latest ↓</button>}
      {closed ? <p className="note closed" role="status">{closed}</p> : <form className="steer" onSubmit={submit}>
        <label htmlFor="steer">Steer the agent</label>
        <textarea id="steer" rows={3} value={text} onChange={(e) => setText(e.target.value)}
          onKeyDown={(e) => { if (e.key === 'Enter' && (e.metaKey || e.ctrlKey)) (e.currentTarget.form as HTMLFormElement).requestSubmit(); }} />
        <div className="steer-row">
          <label><input type="radio" name="mode" checked={mode === 'queue'} onChange={() => setMode('queue')} /> Queue</label>
          <label><input type="radio" name="mode" checked={mode === 'interrupt'} onChange={() => setMode('interrupt')} /> Interrupt</label>
          <button type="submit" className="primary" disabled={!text.trim()}>Send</button> <small>Ctrl+Enter</small>
        </div>
        {error && <p className="field-error" role="alert">{error}</p>}
        {notice && <p className="note" role="status">{notice}</p>}
      </form>}
    </>
  );
}

export function SessionPage({ id, tab = 'conversation' }: { id: string; tab?: Tab }) {
  const [session, setSession] = useState<Session | null>(null);
  const [turns, setTurns] = useState<Turn[]>([]);
  const [history, setHistory] = useState<MessagesPage | null>(null);
  const [error, setError] = useState<string | null>(null);
  const [busy, setBusy] = useState(false);
  const [tick, setTick] = useState(0);
  const [reattach, setReattach] = useState(0);
  const [streaming, setStreaming] = useState(false);
  const [blocked, setBlocked] = useState<string | null>(null);
  const refresh = useCallback(() => setTick((t) => t + 1), []);
  useEffect(() => {
    client.messages(id).then(setHistory).catch((e: ApiError) => setError(`${e.code}: ${e.message}`));
  }, [id]);
  useEffect(() => {
    let live = true;
    let timer: ReturnType<typeof setTimeout> | undefined;
    // Reads may overlap (events come in bursts); only the newest one started may set the state.
    let latest = 0;
    const load = async () => {
      const mine = ++latest;
      try {
        const [s, t] = await Promise.all([client.session(id), client.turns(id)]);
        if (!live || mine !== latest) return;
        setSession(s);
        setTurns(t.turns);
        setError(null);
      } catch (e) {
        if (live && mine === latest) { setError(`${(e as ApiError).code}: ${(e as ApiError).message}`); clearTimeout(timer); timer = setTimeout(load, 5000); }
      }
    };
    void load();
    // The control plane says when the session or one of its turns changes: no polling.
    const off = subscribeEvents((event) => { if (!event || event.session === id) void load(); });
    return () => { live = false; clearTimeout(timer); off(); };
  }, [id, tick]);
  // The tab says the state, so a background tab shows when the agent is done or needs someone.
  useEffect(() => {
    if (!session) return;
    const o = outcome(session, blocked);
    const running = o.tone === 'run' || streaming;
    document.title = `${running && o.tone !== 'run' ? 'Running' : o.label} · ${session.title || session.id} — sortie`;
    return () => { document.title = 'sortie'; };
  }, [session, blocked, streaming]);
  const onAction = async (a: Action) => {
    if (a === 'cancel' && !confirm('Cancel this session? It takes no more turns.')) return;
    setBusy(true);
    try {
      if (a === 'retry') {
        // A failed session retries with a steer: the last prompt again.
        await client.steer(id, turns[turns.length - 1].prompt, 'queue');
        setReattach((n) => n + 1);
      } else {
        await client.action(id, a);
      }
      refresh();
    } catch (e) { setError(`${(e as ApiError).code}: ${(e as ApiError).message}`); } finally { setBusy(false); }
  };
  return (
    <main className="session">
      {error && <p className="error" role="alert">{error}</p>}
      {session ? <Header s={session} turns={turns} onAction={onAction} busy={busy} streaming={streaming} needsInput={blocked && `allow ${blocked}?`} tab={tab} /> : !error && <p className="empty">Loading…</p>}
      {session && tab === 'files' && <FilesChanged session={session} />}
      {/* The chat starts once the session is known too, so it knows which turn its resume on mount covers;
          it stays mounted (hidden) under Files changed, so its stream goes on. */}
      <div hidden={tab !== 'conversation'}>
        {history && session ? <Chat id={id} initial={history} onActivity={refresh} reattach={reattach} syncKey={`${session.turns}:${session.phase}`} runningTurn={session.phase === 'running' ? session.current_turn ?? null : null} allowed={session.egress.allow} session={session} turns={turns} onBusy={setStreaming} onBlocked={setBlocked} visible={tab === 'conversation'} /> : !error && <p className="empty">Loading the conversation…</p>}
      </div>
    </main>
  );
}
