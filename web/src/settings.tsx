// Settings (admins): the workspace's model keys and forge connections (set, replace, remove; a secret is
// sent once and never shown again, only its fingerprint), its tokens (create with the secret shown
// once, revoke), and per-repository presets the composer fills in.
import { useCallback, useEffect, useState, type FormEvent, type ReactNode } from 'react';
import { ApiError, client, type AgentInfo, type ForgeConnection, type ForgeKind, type ModelApi, type ModelKey, type RepoPreset, type Role, type TokenInfo } from './api';
import { CopyButton } from './files';
import { age } from './util';

const MODEL_APIS: ModelApi[] = ['anthropic', 'openai', 'gemini'];
const ROLES: Role[] = ['viewer', 'operator', 'admin'];

const said = (e: unknown) => (e instanceof ApiError ? `${e.code}: ${e.message}` : String(e));

/** A section that loads its rows, shows a refusal where it happened, and reloads after a change. */
function useRows<T>(load: () => Promise<T>): [T | null, string | null, () => void, (e: unknown) => void] {
  const [rows, setRows] = useState<T | null>(null);
  const [error, setError] = useState<string | null>(null);
  const [tick, setTick] = useState(0);
  useEffect(() => {
    let live = true;
    load().then((r) => { if (live) { setRows(r); setError(null); } }).catch((e) => { if (live) setError(said(e)); });
    return () => { live = false; };
  }, [tick]); // eslint-disable-line react-hooks/exhaustive-deps
  return [rows, error, useCallback(() => setTick((t) => t + 1), []), (e: unknown) => setError(said(e))];
}

function Section({ title, hint, error, children }: { title: string; hint: ReactNode; error: string | null; children: ReactNode }) {
  const id = title.toLowerCase().replace(/\s+/g, '-');
  return (
    <section className="settings-section" aria-labelledby={id}>
      <h2 id={id}>{title}</h2>
      <p className="hint">{hint}</p>
      {error && <p className="field-error" role="alert">{error}</p>}
      {children}
    </section>
  );
}

function ModelKeys() {
  const [list, error, reload, fail] = useRows(client.modelKeys);
  const [apiName, setApi] = useState<ModelApi>('anthropic');
  const [key, setKey] = useState('');
  const [label, setLabel] = useState('');
  const submit = async (e: FormEvent) => {
    e.preventDefault();
    try {
      await client.setModelKey(apiName, { key: key.trim(), label: label.trim() || null });
      setKey(''); setLabel(''); reload();
    } catch (err) { fail(err); }
  };
  const keys: ModelKey[] = list?.keys ?? [];
  return (
    <Section title="Model keys" error={error} hint="The vendor keys the model proxy adds to agents' requests. A key is sealed at rest and never shown again: only its last characters.">
      <div className="table-scroll"><table className="settings-table">
        <thead><tr><th>API</th><th>Label</th><th>Key</th><th>Set</th><th /></tr></thead>
        <tbody>
          {keys.length === 0 && <tr><td colSpan={5} className="empty">No model keys yet.</td></tr>}
          {keys.map((k) => (
            <tr key={k.api}>
              <td>{k.api}</td><td>{k.label ?? ''}</td><td><code>{k.fingerprint ? `…${k.fingerprint}` : 'cannot be opened: set it again'}</code></td>
              <td title={k.created_at}>{age(k.created_at)} ago</td>
              <td><button onClick={() => { if (confirm(`Remove the ${k.api} key?`)) client.deleteModelKey(k.api).then(reload, fail); }}>Remove</button></td>
            </tr>
          ))}
        </tbody>
      </table></div>
      <form className="settings-form" onSubmit={submit} aria-label="set a model key">
        <label>API <select value={apiName} onChange={(e) => setApi(e.target.value as ModelApi)}>{MODEL_APIS.map((a) => <option key={a}>{a}</option>)}</select></label>
        <label>Key <input type="password" autoComplete="off" value={key} onChange={(e) => setKey(e.target.value)} required /></label>
        <label>Label <input value={label} onChange={(e) => setLabel(e.target.value)} placeholder="optional" /></label>
        <button type="submit" className="primary" disabled={!key.trim()}>{keys.some((k) => k.api === apiName) ? 'Replace key' : 'Set key'}</button>
      </form>
    </Section>
  );
}

function Forges() {
  const [list, error, reload, fail] = useRows(client.forges);
  const [host, setHost] = useState('');
  const [token, setToken] = useState('');
  const [kind, setKind] = useState<ForgeKind>('github');
  const [apiBase, setApiBase] = useState('');
  const submit = async (e: FormEvent) => {
    e.preventDefault();
    try {
      await client.setForge(host.trim(), { token: token.trim(), kind, api_base: apiBase.trim() || null });
      setHost(''); setToken(''); setApiBase(''); reload();
    } catch (err) { fail(err); }
  };
  const rows: ForgeConnection[] = list?.connections ?? [];
  return (
    <Section title="Forge connections" error={error} hint="Tokens for https:// repositories: the git proxy and pull requests use them; they never enter a sandbox.">
      <div className="table-scroll"><table className="settings-table">
        <thead><tr><th>Host</th><th>Kind</th><th>API</th><th>Token</th><th /></tr></thead>
        <tbody>
          {rows.length === 0 && <tr><td colSpan={5} className="empty">No forge connections yet.</td></tr>}
          {rows.map((c) => (
            <tr key={c.host}>
              <td><code>{c.host}</code></td><td>{c.kind}</td><td><code>{c.api_base}</code></td><td><code>{c.fingerprint ? `…${c.fingerprint}` : 'cannot be opened'}</code>{c.app_id && <> GitHub App {c.app_id}{c.webhook ? ', webhook' : ''}{c.triggers ? `, @sortie in ${c.triggers.repositories.join(' ')}` : ''}</>}</td>
              <td><button onClick={() => { if (confirm(`Remove the connection to ${c.host}?`)) client.deleteForge(c.host).then(reload, fail); }}>Remove</button></td>
            </tr>
          ))}
        </tbody>
      </table></div>
      <form className="settings-form" onSubmit={submit} aria-label="connect a forge">
        <label>Host <input value={host} onChange={(e) => setHost(e.target.value)} placeholder="github.com" required /></label>
        <label>Kind <select value={kind} onChange={(e) => setKind(e.target.value as ForgeKind)}><option>github</option><option>git</option></select></label>
        <label>Token <input type="password" autoComplete="off" value={token} onChange={(e) => setToken(e.target.value)} required /></label>
        <label>API base <input value={apiBase} onChange={(e) => setApiBase(e.target.value)} placeholder="the forge's default" /></label>
        <button type="submit" className="primary" disabled={!host.trim() || !token.trim()}>Connect</button>
      </form>
    </Section>
  );
}

function Tokens() {
  const [list, error, reload, fail] = useRows(client.tokens);
  const [role, setRole] = useState<Role>('operator');
  const [label, setLabel] = useState('');
  const [fresh, setFresh] = useState<{ token: string; info: TokenInfo } | null>(null);
  const submit = async (e: FormEvent) => {
    e.preventDefault();
    try {
      setFresh(await client.createToken({ role, label: label.trim() || null }));
      setLabel(''); reload();
    } catch (err) { fail(err); }
  };
  const rows: TokenInfo[] = list?.tokens ?? [];
  const tokenState = (t: TokenInfo) => {
    if (t.revoked_at) return `revoked ${age(t.revoked_at)} ago`;
    if (t.expires_at && Date.parse(t.expires_at) <= Date.now()) return 'expired';
    const mine = t.current ? 'yours' : 'live';
    return t.expires_at ? `${mine}, expires ${t.expires_at.slice(0, 10)}` : mine;
  };
  return (
    <Section title="Tokens" error={error} hint="Who may use this workspace: viewers read, operators run sessions, admins also manage settings. A token's secret is shown once, when it is made.">
      {fresh && (
        <div className="card fresh-token" role="status">
          <p><strong>New {fresh.info.role} token{fresh.info.label && ` “${fresh.info.label}”`}.</strong> Copy it now: it is not shown again.</p>
          <div className="checkout-row"><pre className="commands" aria-label="new token">{fresh.token}</pre><CopyButton text={fresh.token} /></div>
          <button className="link" onClick={() => setFresh(null)}>Done</button>
        </div>
      )}
      <div className="table-scroll"><table className="settings-table">
        <thead><tr><th>Id</th><th>Role</th><th>Label</th><th>Created</th><th>Last used</th><th>State</th><th /></tr></thead>
        <tbody>
          {rows.map((t) => (
            <tr key={t.id} className={t.revoked_at ? 'revoked' : undefined}>
              <td><code>{t.id}</code></td><td>{t.role}</td><td>{t.label ?? ''}</td>
              <td title={t.created_at}>{age(t.created_at)} ago</td>
              <td title={t.last_used_at ?? undefined}>{t.last_used_at ? `${age(t.last_used_at)} ago` : 'never'}</td>
              <td>{tokenState(t)}</td>
              <td>{!t.revoked_at && <button disabled={t.current} title={t.current ? 'the token you are signed in with' : undefined}
                onClick={() => { if (confirm(`Revoke ${t.id}? Everything using it stops working.`)) client.revokeToken(t.id).then(reload, fail); }}>Revoke</button>}</td>
            </tr>
          ))}
        </tbody>
      </table></div>
      <form className="settings-form" onSubmit={submit} aria-label="create a token">
        <label>Role <select value={role} onChange={(e) => setRole(e.target.value as Role)}>{ROLES.map((r) => <option key={r}>{r}</option>)}</select></label>
        <label>Label <input value={label} onChange={(e) => setLabel(e.target.value)} placeholder="who it is for" /></label>
        <button type="submit" className="primary">Create token</button>
      </form>
    </Section>
  );
}

function Presets() {
  const [list, error, reload, fail] = useRows(client.presets);
  const [agents, setAgents] = useState<AgentInfo[]>([]);
  useEffect(() => { client.agents().then((r) => setAgents(r.agents)).catch(() => {}); }, []);
  const [repo, setRepo] = useState('');
  const [agent, setAgent] = useState('');
  const [allow, setAllow] = useState('');
  const [setup, setSetup] = useState('');
  const edit = (p: RepoPreset) => { setRepo(p.repo); setAgent(p.agent ?? ''); setAllow(p.egress_allow.join(', ')); setSetup(p.setup ?? ''); };
  const submit = async (e: FormEvent) => {
    e.preventDefault();
    try {
      await client.setPreset({ repo: repo.trim(), agent: agent || null, setup: setup.trim() ? setup : null, egress_allow: allow.split(/[\s,]+/).filter(Boolean) });
      setRepo(''); setAgent(''); setAllow(''); setSetup(''); reload();
    } catch (err) { fail(err); }
  };
  const rows: RepoPreset[] = list?.presets ?? [];
  return (
    <Section title="Repository presets" error={error} hint="What a new session on a repository starts with: the composer fills these in when you pick the repository.">
      <div className="table-scroll"><table className="settings-table">
        <thead><tr><th>Repository</th><th>Agent</th><th>Allowlist</th><th>Setup</th><th /></tr></thead>
        <tbody>
          {rows.length === 0 && <tr><td colSpan={5} className="empty">No presets yet.</td></tr>}
          {rows.map((p) => (
            <tr key={p.repo}>
              <td><code>{p.repo}</code></td><td>{p.agent ?? 'default'}</td><td>{p.egress_allow.join(', ') || 'none'}</td>
              <td>{p.setup ? <code>{p.setup.split('\n')[0]}</code> : 'none'}</td>
              <td className="row-actions"><button onClick={() => edit(p)}>Edit</button> <button onClick={() => { if (confirm(`Remove the preset of ${p.repo}?`)) client.deletePreset(p.repo).then(reload, fail); }}>Remove</button></td>
            </tr>
          ))}
        </tbody>
      </table></div>
      <form className="settings-form wide" onSubmit={submit} aria-label="set a preset">
        <label>Repository <input value={repo} onChange={(e) => setRepo(e.target.value)} placeholder="https://github.com/acme/app.git" required /></label>
        <label>Agent <select value={agent} onChange={(e) => setAgent(e.target.value)}>
          <option value="">the server's default</option>{agents.map((a) => <option key={a.id} value={a.id}>{a.id}</option>)}
        </select></label>
        <label>Egress allowlist <input value={allow} onChange={(e) => setAllow(e.target.value)} placeholder="registry.example.org, docs.example.com" /></label>
        <label>Setup script <textarea rows={2} value={setup} onChange={(e) => setSetup(e.target.value)} placeholder="npm ci" /></label>
        <button type="submit" className="primary" disabled={!repo.trim()}>Save preset</button>
      </form>
    </Section>
  );
}

export function Settings() {
  // Only admins manage settings: the model-key list answers 403 to anyone else.
  const [allowed, setAllowed] = useState<boolean | null>(null);
  useEffect(() => {
    client.modelKeys().then(() => setAllowed(true)).catch((e) => setAllowed(!(e instanceof ApiError && e.status === 403)));
  }, []);
  if (allowed === null) return <main><p className="empty">Loading…</p></main>;
  if (!allowed) return <main><h1>Settings</h1><p className="note">Settings are for the workspace's admins; your token is not an admin's.</p></main>;
  return (
    <main className="settings">
      <h1>Settings</h1>
      <ModelKeys />
      <Forges />
      <Tokens />
      <Presets />
    </main>
  );
}
