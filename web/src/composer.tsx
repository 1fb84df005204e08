import { useEffect, useState, type FormEvent } from 'react';
import { ApiError, client } from './api';
import { navigate } from './app';

const BUILT_IN = ['claude-code', 'codex', 'gemini', 'opencode', 'scripted'];

export function Composer() {
  const [repo, setRepo] = useState('');
  const [agents, setAgents] = useState<string[]>(BUILT_IN);
  const [agent, setAgent] = useState('claude-code');
  const [task, setTask] = useState('');
  const [title, setTitle] = useState('');
  const [base, setBase] = useState('');
  const [model, setModel] = useState('');
  const [allow, setAllow] = useState('');
  const [setup, setSetup] = useState('');
  const [errors, setErrors] = useState<Record<string, string>>({});
  const [busy, setBusy] = useState(false);
  useEffect(() => {
    // The agents this server accepts; the built-in list if it cannot say.
    client.agents().then((r) => {
      if (!r.agents?.length) return;
      setAgents(r.agents.map((a) => a.id));
      setAgent(r.default);
    }).catch(() => {});
  }, []);
  const submit = async (e: FormEvent) => {
    e.preventDefault();
    setBusy(true);
    setErrors({});
    const list = allow.split(/[\s,]+/).filter(Boolean);
    try {
      const s = await client.create({
        repo: repo.trim(), task, agent, title: title.trim() || undefined, base: base.trim() || undefined, model: model.trim() || undefined, setup: setup.trim() ? setup : undefined,
        egress: list.length ? { allow: list } : undefined,
      });
      navigate(`/sessions/${s.id}`);
    } catch (err) {
      const e = err as ApiError;
      const field = e.code?.startsWith('EGRESS') ? 'allow' : e.code?.startsWith('AGENT') ? 'agent' : e.code?.startsWith('REPO') ? 'repo' : e.code?.startsWith('SETUP') ? 'setup' : e.code?.startsWith('MODEL') ? 'model' : 'form';
      const entries = (e.details?.entries as { entry: string; reason: string }[] | undefined) ?? [];
      const why = entries.map((x) => `${x.entry}: ${x.reason}`).join('; ');
      setErrors({ [field]: `${e.code}: ${e.message}${why ? ` (${why})` : ''}` });
    } finally {
      setBusy(false);
    }
  };
  const err = (f: string) => errors[f] && <p className="field-error" id={`${f}-error`} role="alert">{errors[f]}</p>;
  return (
    <main>
      <h1>New session</h1>
      <form className="composer" onSubmit={submit}>
        <label htmlFor="repo">Repository</label>
        <input id="repo" required value={repo} onChange={(e) => setRepo(e.target.value)} placeholder="/srv/git/app.git" aria-describedby="repo-error" />
        {err('repo')}
        <label htmlFor="agent">Agent</label>
        <select id="agent" value={agent} onChange={(e) => setAgent(e.target.value)} aria-describedby="agent-error">
          {agents.map((a) => <option key={a}>{a}</option>)}
        </select>
        {err('agent')}
        <label htmlFor="title">Title</label>
        <input id="title" value={title} onChange={(e) => setTitle(e.target.value)} placeholder="from the task's first line" />
        <label htmlFor="model">Model</label>
        <input id="model" value={model} onChange={(e) => setModel(e.target.value)} placeholder="the agent's default" aria-describedby="model-error" />
        {err('model')}
        <label htmlFor="task">Task</label>
        <textarea id="task" required rows={6} value={task} onChange={(e) => setTask(e.target.value)}
          onKeyDown={(e) => { if (e.key === 'Enter' && (e.metaKey || e.ctrlKey)) (e.currentTarget.form as HTMLFormElement).requestSubmit(); }} />
        <label htmlFor="base">Base branch</label>
        <input id="base" value={base} onChange={(e) => setBase(e.target.value)} placeholder="the default branch" />
        <label htmlFor="allow">Egress allowlist</label>
        <input id="allow" value={allow} onChange={(e) => setAllow(e.target.value)} placeholder="github.com, docs.example.com" aria-describedby="allow-error" aria-invalid={!!errors.allow} />
        {err('allow')}
        <label htmlFor="setup">Setup script</label>
        <textarea id="setup" rows={3} value={setup} onChange={(e) => setSetup(e.target.value)} placeholder="npm ci" aria-describedby="setup-error" />
        {err('setup')}
        {err('form')}
        <div><button type="submit" className="primary" disabled={busy}>{busy ? 'Starting…' : 'Start session'}</button> <small>Ctrl+Enter</small></div>
      </form>
    </main>
  );
}
