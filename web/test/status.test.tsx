// What the page says needs the user: outcomes, a blocked host, what the agent does now, turn endings.
import { cleanup, render } from '@testing-library/react';
import { afterEach, describe, expect, it } from 'vitest';
import { Conversation, FailureReason, type Message } from '../src/conversation';
import { activity, allows, blockedOn, clock, outcome } from '../src/status';

afterEach(cleanup);

const base = { failure: null, pr: null, head_sha: null, queued_reason: null } as const;

describe('outcome', () => {
  it('names what needs the user, from the phase and what was delivered', () => {
    expect(outcome({ ...base, phase: 'idle', head_sha: 'abc' })).toEqual({ label: 'Ready for review', tone: 'ok' });
    expect(outcome({ ...base, phase: 'hibernated', head_sha: 'abc', pr: { url: 'u', number: 7 } })).toEqual({ label: 'PR open', tone: 'ok', detail: '#7' });
    expect(outcome({ ...base, phase: 'idle' }).label).toBe('No changes');
    expect(outcome({ ...base, phase: 'failed', failure: { code: 'AGENT_CRASHED', reason: 'x' } })).toEqual({ label: 'Failed', tone: 'fail', detail: 'AGENT_CRASHED' });
    expect(outcome({ ...base, phase: 'running' })).toEqual({ label: 'Running', tone: 'run', detail: undefined });
    expect(outcome({ ...base, phase: 'provisioning' })).toEqual({ label: 'Running', tone: 'run', detail: 'provisioning' });
    expect(outcome({ ...base, phase: 'running' }, 'allow x.dev?').label).toBe('Needs input');
    expect(outcome({ ...base, phase: 'canceled' }).label).toBe('Canceled');
    // Held at its token budget, a session needs someone to raise it, on the list too (no parts there).
    const paused = { tokens: 500, compute_seconds: null, paused_at: '2026-12-06T12:00:00.000Z' };
    expect(outcome({ ...base, phase: 'running', budget: paused })).toEqual({ label: 'Needs input', tone: 'attention', detail: 'budget reached' });
    expect(outcome({ ...base, phase: 'running', budget: { ...paused, paused_at: null } }).label).toBe('Running');
  });

  it('an allowlist admits the names it lists, exactly, as the gateway does', () => {
    expect(allows(['docs.rs'], 'Docs.rs.')).toBe(true);
    expect(allows(['example.com'], 'a.example.com')).toBe(false);
    expect(allows([], 'docs.rs')).toBe(false);
  });
});

const denial = (host: string) => ({ type: 'data-sortie-egress-denied', data: { host, port: 443, reason: 'not in the allowlist' } });
const answer = (...parts: Record<string, unknown>[]): Message[] => [{ id: 'ses_x-t1', role: 'assistant', parts: parts as never }];

describe('the running agent', () => {
  it('is blocked on a host only while its newest act is a denial the allowlist still refuses', () => {
    expect(blockedOn(answer({ type: 'text', text: 'hi' }, denial('x.dev')), [])).toBe('x.dev');
    expect(blockedOn(answer(denial('x.dev')), ['x.dev'])).toBeNull();
    expect(blockedOn(answer(denial('x.dev'), { type: 'text', text: 'moving on' }), [])).toBeNull();
  });

  it('says what it does now: the running tool with its start, thinking, writing', () => {
    const at = '2026-12-05T10:00:00.000Z';
    expect(activity(answer({ type: 'dynamic-tool', toolName: 'execute', title: 'npm test', state: 'input-available', callProviderMetadata: { sortie: { at } } })))
      .toEqual({ what: 'Running npm test', since: Date.parse(at), command: true });
    expect(activity(answer({ type: 'reasoning', text: '…', state: 'streaming' }))?.what).toBe('Thinking');
    expect(activity(answer({ type: 'text', text: '…', state: 'streaming' }))?.what).toBe('Writing');
    expect(clock(65_000)).toBe('1m05s');
  });
});

describe('turn endings', () => {
  it('a failed turn ends with its code and reason, the output tail as a terminal; a stopped one is marked', () => {
    const messages: Message[] = [
      { id: 'ses_x-t1', role: 'assistant', parts: [{ type: 'text', text: 'Trying.' }, { type: 'data-sortie-delivery', data: { branch: 'sortie/ses_x', pushed: false, changed: false, diffStat: { files: 0, insertions: 0, deletions: 0 } } }] },
      { id: 'ses_x-t2', role: 'assistant', parts: [{ type: 'text', text: 'Again.' }] },
    ];
    const ends = { 1: { status: 'failed', failure: { code: 'AGENT_CRASHED', reason: "the agent exited with status 1; the agent's last words: TypeError: x is undefined\n    at main.js:3" } }, 2: { status: 'stopped' } };
    const { container } = render(<Conversation messages={messages} actions={{ ends }} />);
    const failure = container.querySelector('[aria-label="turn failure"]');
    expect(failure?.textContent).toContain('AGENT_CRASHED: the agent exited with status 1 — its last output:');
    expect(failure?.querySelector('.term-out')?.textContent).toBe('TypeError: x is undefined\n    at main.js:3');
    expect(container.querySelector('.delivery'), 'no green card for a turn that delivered nothing').toBeNull();
    expect(container.querySelector('.delivery-none')?.textContent).toContain('no changes');
    expect(container.querySelectorAll('.interrupted')).toHaveLength(1);
  });

  it('a setup script\'s failure shows its output as a terminal', () => {
    const { container } = render(<FailureReason text={'the setup script exited with status 2; its last output:\nnpm ERR! missing script: ci'} />);
    expect(container.querySelector('.term-out')?.textContent).toBe('npm ERR! missing script: ci');
    expect(container.textContent).toMatch(/^the setup script exited with status 2 — its last output:/);
  });

  it('a permission request says how sortie answered it', () => {
    const messages: Message[] = [{ id: 'ses_x-t1', role: 'assistant', parts: [
      { type: 'data-acp-permission', id: 'permission:b1', data: { toolCallId: 'b1', answer: 'allow_once', option: 'Allow' } },
    ] }];
    const { container } = render(<Conversation messages={messages} actions={{}} />);
    expect(container.querySelector('.permission')?.textContent).toBe('Permission asked: allowed once (“Allow”), answered by sortie');
  });
});
