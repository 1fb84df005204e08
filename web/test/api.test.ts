import { afterEach, describe, expect, it, vi } from 'vitest';
import { api, auth, CSRF_HEADER, setUnauthorizedHandler } from '../src/api';

afterEach(() => { vi.unstubAllGlobals(); auth.setToken(null); });

describe('api', () => {
  it('sends the CSRF header always, the pasted token as Bearer, and goes to sign-in on a 401', async () => {
    const seen: Headers[] = [];
    vi.stubGlobal('fetch', vi.fn(async (_url: string, init: RequestInit) => {
      seen.push(new Headers(init.headers));
      return new Response(JSON.stringify({ error: { code: 'UNAUTHORIZED', message: 'nope', details: {} } }), { status: 401 });
    }));
    const onUnauthorized = vi.fn();
    setUnauthorizedHandler(onUnauthorized);
    await expect(api('GET', '/v1/sessions')).rejects.toMatchObject({ status: 401, code: 'UNAUTHORIZED' });
    expect(onUnauthorized).toHaveBeenCalledTimes(1);
    expect(seen[0].get(CSRF_HEADER)).toBe('1');
    expect(seen[0].get('authorization')).toBeNull();
    auth.setToken('sortie_abc');
    await api('GET', '/v1/sessions').catch(() => {});
    expect(seen[1].get('authorization')).toBe('Bearer sortie_abc');
  });
});
