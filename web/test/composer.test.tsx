// The composer against a stubbed control plane: the agents come from GET /v1/agents (installed ones
// offered, the others shown disabled with what they need), and each refusal of POST /v1/sessions lands
// next to the field it is about.
import { cleanup, fireEvent, render, screen, waitFor } from '@testing-library/react';
import { afterEach, describe, expect, it, vi } from 'vitest';
import type { ErrorCode } from '../src/api';
import { Composer, FIELD_OF } from '../src/composer';

afterEach(() => { cleanup(); vi.unstubAllGlobals(); });

const json = (status: number, body: unknown) => new Response(JSON.stringify(body), { status, headers: { 'content-type': 'application/json' } });
const AGENTS = {
  agents: [
    { id: 'claude-code', installed: false, needs: 'sortie agents install claude-code' },
    { id: 'codex', installed: false, needs: 'sortie agents install codex' },
    { id: 'scripted', installed: true, needs: null },
  ],
  default: 'claude-code',
};

/** Stubs fetch: `/v1/agents` answers `agents`, `POST /v1/sessions` answers `create`; records the requests. */
function stub(agents: () => Response, create: () => Response = () => json(202, { id: 'ses_x' })) {
  const requests: { url: string; init: RequestInit }[] = [];
  vi.stubGlobal('fetch', vi.fn(async (url: string, init: RequestInit) => {
    requests.push({ url, init });
    if (url === '/v1/agents') return agents();
    if (url === '/v1/sessions' && init.method === 'POST') return create();
    return json(404, { error: { code: 'NOT_FOUND', message: url, details: {} } });
  }));
  return requests;
}

describe('composer presets', () => {
  it('offers presets and recent repositories, and fills a preset\'s allowlist, setup and agent in', async () => {
    const preset = { repo: 'https://github.com/acme/app.git', agent: 'scripted', setup: 'npm ci', egress_allow: ['registry.example.org'], updated_at: '2026-12-05T00:00:00Z' };
    vi.stubGlobal('fetch', vi.fn(async (url: string) => {
      if (url === '/v1/agents') return json(200, { ...AGENTS, default: 'scripted' });
      if (url === '/v1/presets') return json(200, { presets: [preset] });
      if (url.startsWith('/v1/sessions?')) return json(200, { sessions: [{ repo: '/srv/git/old.git' }, { repo: preset.repo }], next_cursor: null });
      return json(404, { error: { code: 'NOT_FOUND', message: url, details: {} } });
    }));
    const { container } = render(<Composer />);
    await waitFor(() => expect(container.querySelectorAll('#repo-options option')).toHaveLength(2));
    expect([...container.querySelectorAll('#repo-options option')].map((o) => [(o as HTMLOptionElement).value, o.textContent]))
      .toEqual([[preset.repo, 'preset'], ['/srv/git/old.git', 'recent']]);
    fireEvent.change(screen.getByLabelText('Repository'), { target: { value: preset.repo } });
    expect((screen.getByLabelText('Egress allowlist') as HTMLInputElement).value).toBe('registry.example.org');
    expect((screen.getByLabelText('Setup script') as HTMLTextAreaElement).value).toBe('npm ci');
    expect(screen.getByRole('status').textContent).toMatch(/preset/);
  });
});

describe('composer', () => {
  it('offers the installed agents from /v1/agents and shows the others disabled with what they need', async () => {
    stub(() => json(200, AGENTS));
    render(<Composer />);
    const select = screen.getByLabelText('Agent') as HTMLSelectElement;
    // The server's default (claude-code) is not installed here: the first installed agent is chosen.
    await waitFor(() => expect(select.value).toBe('scripted'));
    const options = [...select.options].map((o) => [o.value, o.disabled, o.textContent]);
    expect(options).toEqual([
      ['claude-code', true, 'claude-code — not installed'],
      ['codex', true, 'codex — not installed'],
      ['scripted', false, 'scripted'],
    ]);
    expect(screen.getByText(/Not installed on this server/).textContent).toBe(
      'Not installed on this server: claude-code (sortie agents install claude-code); codex (sortie agents install codex).',
    );
  });

  it('says so next to the field when the agents cannot be listed, and leaves the choice to the server', async () => {
    const requests = stub(() => json(503, { error: { code: 'STORE_UNAVAILABLE', message: 'the store did not answer', details: {} } }));
    render(<Composer />);
    await screen.findByText(/Cannot list the agents/);
    expect(screen.getByRole('alert').id).toBe('agent-error');
    const select = screen.getByLabelText('Agent') as HTMLSelectElement;
    expect([...select.options].map((o) => o.textContent)).toEqual(["the server's default"]);
    fireEvent.change(screen.getByLabelText('Repository'), { target: { value: '/srv/git/app.git' } });
    fireEvent.change(screen.getByLabelText('Task'), { target: { value: 'Fix the parser' } });
    fireEvent.submit(select.form!);
    await waitFor(() => expect(requests.some((r) => r.init.method === 'POST')).toBe(true));
    const body = JSON.parse(String(requests.find((r) => r.init.method === 'POST')!.init.body));
    expect(body).toEqual({ repo: '/srv/git/app.git', task: 'Fix the parser' });
  });

  const cases: [ErrorCode | 'INTERNAL', string][] = [
    ...Object.entries(FIELD_OF).map(([code, field]) => [code as ErrorCode, field] as [ErrorCode, string]),
    ['INTERNAL', 'form'],
  ];
  it.each(cases)('shows %s next to the %s field', async (code, field) => {
    const details = code === 'EGRESS_ALLOWLIST_INVALID' ? { entries: [{ entry: 'bad_host!', reason: 'not a DNS name' }] } : {};
    stub(() => json(200, AGENTS), () => json(400, { error: { code, message: `the ${field} is wrong`, details } }));
    render(<Composer />);
    await waitFor(() => expect((screen.getByLabelText('Agent') as HTMLSelectElement).value).toBe('scripted'));
    fireEvent.change(screen.getByLabelText('Repository'), { target: { value: '/srv/git/app.git' } });
    fireEvent.change(screen.getByLabelText('Task'), { target: { value: 'Fix the parser' } });
    fireEvent.submit(screen.getByLabelText('Task').closest('form')!);
    const error = await screen.findByRole('alert');
    expect(error.id).toBe(`${field}-error`);
    expect(error.textContent).toBe(`${code}: the ${field} is wrong${code === 'EGRESS_ALLOWLIST_INVALID' ? ' (bad_host!: not a DNS name)' : ''}`);
    if (field !== 'form') {
      const input = document.getElementById(field === 'allow' ? 'allow' : field)!;
      expect(input.getAttribute('aria-invalid')).toBe('true');
      expect(input.getAttribute('aria-describedby')).toBe(`${field}-error`);
    }
  });

  it('routes the refusals the issue names to their fields', () => {
    expect(FIELD_OF.BASE_INVALID).toBe('base');
    expect(FIELD_OF.TITLE_TOO_LONG).toBe('title');
    expect(FIELD_OF.PROMPT_TOO_LARGE).toBe('task');
    expect(FIELD_OF.EGRESS_ALLOWLIST_INVALID).toBe('allow');
  });
});
