import { afterEach, describe, expect, it, vi } from 'vitest';
import { api, auth, client, CSRF_HEADER, cursor, setUnauthorizedHandler } from '../src/api';

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

describe('messages', () => {
  it('asks for the page before a cursor and reads the next cursor from the answer', async () => {
    const urls: string[] = [];
    const answers = [
      new Response('[]', { status: 200, headers: { 'Sortie-Older-Cursor': '21' } }),
      new Response('[]', { status: 200 }),
    ];
    vi.stubGlobal('fetch', vi.fn(async (url: string) => { urls.push(url); return answers.shift(); }));
    expect(await client.messages('ses_a')).toEqual({ messages: [], older: 21 });
    expect(await client.messages('ses_a', 21)).toEqual({ messages: [], older: null });
    expect(urls).toEqual(['/v1/sessions/ses_a/messages', '/v1/sessions/ses_a/messages?before=21']);
  });
  it('takes only a turn number for a cursor', () => {
    expect(cursor('7')).toBe(7);
    for (const bad of [null, '', '0', '-1', '1.5', 'x']) expect(cursor(bad)).toBeNull();
  });
});
