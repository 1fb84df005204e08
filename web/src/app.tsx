import { useEffect, useState, type FormEvent } from 'react';
import { ApiError, auth, client, setUnauthorizedHandler } from './api';
import { Sessions } from './sessions';
import { Composer } from './composer';
import { SessionPage } from './session';

export function navigate(to: string) {
  history.pushState(null, '', to);
  dispatchEvent(new PopStateEvent('popstate'));
}

export function Link({ to, children, className }: { to: string; children: React.ReactNode; className?: string }) {
  return (
    <a href={to} className={className} onClick={(e) => {
      if (e.metaKey || e.ctrlKey || e.shiftKey || e.button !== 0) return;
      e.preventDefault();
      navigate(to);
    }}>{children}</a>
  );
}

function usePath() {
  const [path, setPath] = useState(location.pathname);
  useEffect(() => {
    const on = () => setPath(location.pathname);
    addEventListener('popstate', on);
    return () => removeEventListener('popstate', on);
  }, []);
  return path;
}

function SignIn() {
  const [error, setError] = useState<string | null>(null);
  const [token, setToken] = useState('');
  const [busy, setBusy] = useState(false);
  useEffect(() => {
    // The code travels in the fragment, so it never reaches a server log; it is dropped from the URL at once.
    const exchange = () => {
      const code = location.hash.slice(1);
      if (!code) return;
      history.replaceState(null, '', '/signin');
      setBusy(true);
      setError(null);
      client.exchange(code)
        .then(() => { auth.setToken(null); navigate('/'); })
        .catch((e: ApiError) => setError(`${e.code}: ${e.message}`))
        .finally(() => setBusy(false));
    };
    exchange();
    addEventListener('hashchange', exchange);
    return () => removeEventListener('hashchange', exchange);
  }, []);
  const submit = async (e: FormEvent) => {
    e.preventDefault();
    auth.setToken(token.trim());
    try {
      await client.sessions({});
      navigate('/');
    } catch (err) {
      auth.setToken(null);
      setError(err instanceof ApiError ? `${err.code}: ${err.message}` : String(err));
    }
  };
  return (
    <main className="signin">
      <h1>Sign in to sortie</h1>
      {busy && <p>Signing in…</p>}
      {error && <p className="error" role="alert">{error}</p>}
      <p>Open the sign-in link that <code>sortie serve</code> printed, or paste a token.</p>
      <form onSubmit={submit}>
        <label htmlFor="token">Token</label>
        <input id="token" type="password" autoComplete="off" value={token} onChange={(e) => setToken(e.target.value)} />
        <button type="submit" disabled={!token.trim()}>Sign in</button>
      </form>
    </main>
  );
}

export function App() {
  const path = usePath();
  useEffect(() => setUnauthorizedHandler(() => {
    if (location.pathname !== '/signin') navigate('/signin');
  }), []);
  if (path === '/signin') return <SignIn />;
  const session = /^\/sessions\/([^/]+)$/.exec(path);
  return (
    <div className="shell">
      <header className="top">
        <Link to="/" className="brand">sortie</Link>
        <nav>
          <Link to="/">Sessions</Link>
          <Link to="/new">New session</Link>
          <button className="link" onClick={async () => {
            auth.setToken(null);
            await client.signout().catch(() => {});
            navigate('/signin');
          }}>Sign out</button>
        </nav>
      </header>
      {path === '/new' ? <Composer /> : session ? <SessionPage key={session[1]} id={session[1]} /> : path === '/' ? <Sessions /> : <p className="empty">Nothing here. <Link to="/">Sessions</Link></p>}
    </div>
  );
}
