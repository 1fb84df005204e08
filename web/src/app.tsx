import { useEffect, useState, type FormEvent } from 'react';
import { ApiError, auth, client, setUnauthorizedHandler } from './api';
import { Sessions } from './sessions';
import { Composer } from './composer';
import { SessionPage } from './session';
import { Settings } from './settings';
import { Link, navigate } from './link';

export { Link, navigate };

function usePath() {
  const [path, setPath] = useState(location.pathname);
  useEffect(() => {
    const on = () => setPath(location.pathname);
    addEventListener('popstate', on);
    return () => removeEventListener('popstate', on);
  }, []);
  return path;
}

const NEXT_KEY = 'sortie.next';
/** Where to go after signing in: the page the user was sent away from (same origin paths only). */
function takeNext(): string {
  const next = sessionStorage.getItem(NEXT_KEY);
  sessionStorage.removeItem(NEXT_KEY);
  return next && next.startsWith('/') && !next.startsWith('//') && !next.startsWith('/signin') ? next : '/';
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
        .then(() => { auth.setToken(null); navigate(takeNext()); })
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
      navigate(takeNext());
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
      <p>Open the sign-in link that <code>sortie serve</code> printed (<code>sortie signin-link</code> prints a fresh one), or paste a token.</p>
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
    if (location.pathname === '/signin') return;
    // The page is kept, so signing in brings the user back to it.
    sessionStorage.setItem(NEXT_KEY, location.pathname + location.search);
    navigate('/signin');
  }), []);
  if (path === '/signin') return <SignIn />;
  const session = /^\/sessions\/([^/]+)(\/files)?$/.exec(path);
  return (
    <div className="shell">
      <header className="top">
        <Link to="/" className="brand">sortie</Link>
        <nav>
          <Link to="/">Sessions</Link>
          <Link to="/new">New session</Link>
          <Link to="/settings">Settings</Link>
          <button className="link" onClick={async () => {
            auth.setToken(null);
            await client.signout().catch(() => {});
            navigate('/signin');
          }}>Sign out</button>
        </nav>
      </header>
      {path === '/new' ? <Composer /> : path === '/settings' ? <Settings /> : session ? <SessionPage key={session[1]} id={session[1]} tab={session[2] ? 'files' : 'conversation'} /> : path === '/' ? <Sessions /> : <p className="empty">Nothing here. <Link to="/">Sessions</Link></p>}
    </div>
  );
}
