import { useEffect, useState } from 'react';
import { ApiError, client, LIVE, PHASES, type Phase, type Session } from './api';
import { Link } from './link';
import { subscribeEvents } from './events';
import { outcome, type Outcome } from './status';
import { age } from './util';

export function PhaseBadge({ phase }: { phase: string }) {
  return <span className={`badge phase-${phase}`}>{phase}</span>;
}

/** The outcome that needs the user (Ready for review, PR open, Failed · CODE, Running · phase, …). */
export function OutcomeBadge({ outcome: o }: { outcome: Outcome }) {
  return <span className={`badge outcome tone-${o.tone}`}>{o.label}{o.detail && <span className="detail"> · {o.detail}</span>}</span>;
}

/** A repository as people name it: `host/owner/name` for a URL, the last two path segments for a local path. */
export function shortRepo(repo: string): string {
  const trimmed = repo.replace(/\.git\/?$/, '').replace(/\/+$/, '');
  const url = /^https?:\/\/(?:[^@/]+@)?([^/]+)\/(.+)$/.exec(trimmed);
  if (url) return `${url[1]}/${url[2]}`;
  return trimmed.split('/').filter(Boolean).slice(-2).join('/');
}

/** A failure's reason for a list row: its first line, cut at 160 characters (the page has all of it). */
export function brief(reason: string): string {
  // The output a reason quotes (the agent's last words, a setup script's output) is for the session page.
  const line = reason.split(/;? (?:the agent's|its) last (?:words|output):|\n/)[0];
  return line.length > 160 ? `${line.slice(0, 159)}…` : line;
}

export function Sessions() {
  const [phase, setPhase] = useState<Phase | ''>('');
  const [repo, setRepo] = useState('');
  const [archived, setArchived] = useState(false);
  const [sessions, setSessions] = useState<Session[] | null>(null);
  const [error, setError] = useState<string | null>(null);
  const [tick, setTick] = useState(0);
  // The repositories seen so far, offered by the repo filter (it matches a repository exactly).
  const [repos, setRepos] = useState<string[]>([]);
  useEffect(() => {
    let live = true;
    let timer: ReturnType<typeof setTimeout> | undefined;
    let latest = 0;
    const load = () => {
      const mine = ++latest;
      return client.sessions({ phase, repo, archived }).then((r) => {
        if (!live || mine !== latest) return;
        setSessions(r.sessions);
        setRepos((old) => (r.sessions.every((x) => old.includes(x.repo)) ? old : [...new Set([...old, ...r.sessions.map((x) => x.repo)])].sort()));
        setError(null);
      }).catch((e: ApiError) => { if (live && mine === latest) { setError(`${e.code}: ${e.message}`); clearTimeout(timer); timer = setTimeout(load, 5000); } });
    };
    void load();
    // Any change in the workspace may move a row: read the list again once a burst of events settles.
    let burst: ReturnType<typeof setTimeout> | undefined;
    const off = subscribeEvents(() => { clearTimeout(burst); burst = setTimeout(load, 100); });
    return () => { live = false; clearTimeout(timer); clearTimeout(burst); off(); };
  }, [phase, repo, archived, tick]);
  return (
    <main>
      <div className="toolbar">
        <div className="heading">
          <h1>Sessions</h1>
          {sessions && sessions.length > 0 && (
            <span className="count" aria-label="summary">
              {sessions.length} shown{sessions.some((x) => LIVE.includes(x.phase)) && ` · ${sessions.filter((x) => LIVE.includes(x.phase)).length} live`}
              {sessions.some((x) => x.phase === 'failed') && ` · ${sessions.filter((x) => x.phase === 'failed').length} failed`}
            </span>
          )}
        </div>
        <label>Phase <select value={phase} onChange={(e) => setPhase(e.target.value as Phase | '')}>
          <option value="">any</option>{PHASES.map((p) => <option key={p}>{p}</option>)}
        </select></label>
        <label>Repo <input value={repo} onChange={(e) => setRepo(e.target.value)} placeholder="any" list="repos" /></label>
        <datalist id="repos">{repos.map((r) => <option key={r} value={r} />)}</datalist>
        <label><input type="checkbox" checked={archived} onChange={(e) => setArchived(e.target.checked)} /> Archived</label>
        <button onClick={() => setTick(tick + 1)}>Refresh</button>
        <Link to="/new" className="button primary">New session</Link>
      </div>
      {error && <p className="error" role="alert">{error}</p>}
      {sessions == null ? <p className="empty">Loading…</p> : sessions.length === 0 ? <p className="empty">No sessions{phase || repo || archived ? ' match these filters' : ' yet'}.</p> : (
        <table className="sessions">
          <thead><tr><th>State</th><th>Session</th><th>Repository</th><th>Agent</th><th className="num">Turns</th><th className="num">Updated</th><th className="num">Created</th></tr></thead>
          <tbody>
            {sessions.map((s) => (
              <tr key={s.id}>
                <td className="state"><OutcomeBadge outcome={outcome(s)} /> <PhaseBadge phase={s.phase} /></td>
                <td>
                  <Link to={`/sessions/${s.id}`}>{s.title || s.id}</Link>
                  <div className="sub">
                    <code>{s.branch}</code>{s.head_sha && <> at <code>{s.head_sha.slice(0, 7)}</code></>}
                    {s.pr && <> · <a href={s.pr.url}>PR #{s.pr.number}</a></>}
                    {s.failure && <span className="error" title={s.failure.reason}> · {brief(s.failure.reason)}</span>}
                    {s.queued_reason && <> · waits: {s.queued_reason}</>}
                  </div>
                </td>
                <td title={s.repo} data-label="Repository"><code>{shortRepo(s.repo)}</code></td>
                <td data-label="Agent">{s.agent}{s.model && <div className="sub">{s.model}</div>}</td>
                <td className="num" data-label="Turns">{s.turns}</td>
                <td className="num" title={s.updated_at} data-label="Updated">{age(s.updated_at)} ago</td>
                <td className="num" title={s.created_at} data-label="Created">{age(s.created_at)} ago</td>
              </tr>
            ))}
          </tbody>
        </table>
      )}
    </main>
  );
}
