import { useEffect, useState, type FormEvent } from 'react';
import { ApiError, client, type AgentInfo, type ErrorCode, type RepoPreset } from './api';
import { navigate } from './app';

type Field = 'repo' | 'agent' | 'title' | 'model' | 'task' | 'base' | 'allow' | 'setup' | 'form';

/** The field each refusal of `POST /v1/sessions` is about (codes from the API's own ErrorCode enum). */
export const FIELD_OF: Partial<Record<ErrorCode, Field>> = {
  REPO_INVALID: 'repo',
  REPO_NOT_ALLOWED: 'repo',
  AGENT_UNKNOWN: 'agent',
  TITLE_TOO_LONG: 'title',
  MODEL_INVALID: 'model',
  PROMPT_TOO_LARGE: 'task',
  SESSION_PROMPTS_TOO_LARGE: 'task',
  BASE_INVALID: 'base',
  EGRESS_ALLOWLIST_INVALID: 'allow',
  SETUP_TOO_LARGE: 'setup',
};

/** The message of a refusal, with the offending allowlist entries when the API names them. */
function describe(e: ApiError): string {
  const entries = (e.details?.entries as { entry: string; reason: string }[] | undefined) ?? [];
  const why = entries.map((x) => `${x.entry}: ${x.reason}`).join('; ');
  return `${e.code}: ${e.message}${why ? ` (${why})` : ''}`;
}

export function Composer() {
  const [repo, setRepo] = useState('');
  // The agents of `GET /v1/agents`: null while loading; an installed one is offered, the others shown disabled.
  const [agents, setAgents] = useState<AgentInfo[] | null>(null);
  const [agent, setAgent] = useState('');
  const [task, setTask] = useState('');
  const [title, setTitle] = useState('');
  const [base, setBase] = useState('');
  const [model, setModel] = useState('');
  const [allow, setAllow] = useState('');
  const [setup, setSetup] = useState('');
  const [errors, setErrors] = useState<Partial<Record<Field, string>>>({});
  const [busy, setBusy] = useState(false);
  // The repository picker: the workspace's presets first, then repositories of recent sessions.
  const [presets, setPresets] = useState<RepoPreset[]>([]);
  const [recent, setRecent] = useState<string[]>([]);
  const [applied, setApplied] = useState<string | null>(null);
  useEffect(() => {
    let live = true;
    client.presets().then((r) => { if (live) setPresets(r.presets); }).catch(() => {});
    client.sessions({}).then((r) => { if (live) setRecent([...new Set(r.sessions.map((x) => x.repo))].slice(0, 20)); }).catch(() => {});
    return () => { live = false; };
  }, []);
  const chooseRepo = (value: string) => {
    setRepo(value);
    const preset = presets.find((p) => p.repo === value.trim());
    if (!preset || applied === preset.repo) return;
    // The preset fills the session's settings; each can still be changed before starting.
    setAllow(preset.egress_allow.join(', '));
    setSetup(preset.setup ?? '');
    if (preset.agent && (agents ?? []).some((a) => a.id === preset.agent && a.installed)) setAgent(preset.agent);
    setApplied(preset.repo);
  };
  useEffect(() => {
    let live = true;
    client.agents().then((r) => {
      if (!live) return;
      setAgents(r.agents);
      const usable = r.agents.filter((a) => a.installed);
      setAgent(usable.some((a) => a.id === r.default) ? r.default : usable[0]?.id ?? '');
    }).catch((e: ApiError) => {
      if (!live) return;
      // The session is still created with the server's default agent (the select says so).
      setAgents([]);
      setErrors((old) => ({ ...old, agent: `Cannot list the agents (${e.code}: ${e.message}); the server's default is used.` }));
    });
    return () => { live = false; };
  }, []);
  const submit = async (e: FormEvent) => {
    e.preventDefault();
    setBusy(true);
    setErrors({});
    const list = allow.split(/[\s,]+/).filter(Boolean);
    try {
      const s = await client.create({
        repo: repo.trim(), task, agent: agent || undefined, title: title.trim() || undefined, base: base.trim() || undefined,
        model: model.trim() || undefined, setup: setup.trim() ? setup : undefined, egress: list.length ? { allow: list } : undefined,
      });
      navigate(`/sessions/${s.id}`);
    } catch (err) {
      if (!(err instanceof ApiError)) { setErrors({ form: String(err) }); return; }
      setErrors({ [FIELD_OF[err.code as ErrorCode] ?? 'form']: describe(err) });
    } finally {
      setBusy(false);
    }
  };
  const err = (f: Field) => errors[f] && <p className="field-error" id={`${f}-error`} role="alert">{errors[f]}</p>;
  const field = (f: Field) => ({ 'aria-describedby': errors[f] ? `${f}-error` : undefined, 'aria-invalid': errors[f] ? true : undefined });
  const missing = (agents ?? []).filter((a) => !a.installed);
  return (
    <main>
      <h1>New session</h1>
      <form className="composer" onSubmit={submit}>
        <label htmlFor="repo">Repository</label>
        <input id="repo" required value={repo} onChange={(e) => chooseRepo(e.target.value)} placeholder="https://github.com/acme/app.git or /srv/git/app.git" list="repo-options" autoComplete="off" {...field('repo')} />
        <datalist id="repo-options">
          {presets.map((p) => <option key={`p:${p.repo}`} value={p.repo}>preset</option>)}
          {recent.filter((r) => !presets.some((p) => p.repo === r)).map((r) => <option key={`r:${r}`} value={r}>recent</option>)}
        </datalist>
        {applied && applied === repo.trim() && <p className="hint" role="status">Filled in from this repository's preset: allowlist, setup script and agent.</p>}
        {err('repo')}
        <label htmlFor="agent">Agent</label>
        <select id="agent" value={agent} onChange={(e) => setAgent(e.target.value)} disabled={agents === null} {...field('agent')}>
          {agents === null && <option value="">Loading agents…</option>}
          {agents !== null && !agents.some((a) => a.installed) && <option value="">the server's default</option>}
          {(agents ?? []).map((a) => (
            <option key={a.id} value={a.id} disabled={!a.installed}>{a.installed ? a.id : `${a.id} — not installed`}</option>
          ))}
        </select>
        {missing.length > 0 && (
          <p className="hint" id="agent-hint">
            Not installed on this server: {missing.map((a, i) => <span key={a.id}>{i > 0 && '; '}<strong>{a.id}</strong> ({a.needs ?? 'not installed'})</span>)}.
          </p>
        )}
        {err('agent')}
        <label htmlFor="task">Task</label>
        <textarea id="task" required rows={6} value={task} onChange={(e) => setTask(e.target.value)} {...field('task')}
          onKeyDown={(e) => { if (e.key === 'Enter' && (e.metaKey || e.ctrlKey)) (e.currentTarget.form as HTMLFormElement).requestSubmit(); }} />
        {err('task')}
        <label htmlFor="title">Title</label>
        <input id="title" value={title} onChange={(e) => setTitle(e.target.value)} placeholder="from the task's first line" {...field('title')} />
        {err('title')}
        <div className="row">
          <div>
            <label htmlFor="base">Base branch</label>
            <input id="base" value={base} onChange={(e) => setBase(e.target.value)} placeholder="the default branch" {...field('base')} />
            {err('base')}
          </div>
          <div>
            <label htmlFor="model">Model</label>
            <input id="model" value={model} onChange={(e) => setModel(e.target.value)} placeholder="the agent's default" {...field('model')} />
            {err('model')}
          </div>
        </div>
        <label htmlFor="allow">Egress allowlist</label>
        <input id="allow" value={allow} onChange={(e) => setAllow(e.target.value)} placeholder="github.com, docs.example.com" {...field('allow')} />
        {err('allow')}
        <label htmlFor="setup">Setup script</label>
        <textarea id="setup" rows={3} value={setup} onChange={(e) => setSetup(e.target.value)} placeholder="npm ci" {...field('setup')} />
        {err('setup')}
        {err('form')}
        <div><button type="submit" className="primary" disabled={busy}>{busy ? 'Starting…' : 'Start session'}</button> <small>Ctrl+Enter</small></div>
      </form>
    </main>
  );
}
