// The conversation renderer over recorded streams: a real turn of the scripted agent through `sortie
// driver` (fixtures/scripted-turn.sse), a hand-written one with the parts the driver alone cannot
// produce (fixtures/extras.sse: terminal output, a priming note, egress denials, token and context
// usage) and one whose parts carry start and end timestamps (fixtures/timed.sse). Streams go through
// the real `ai` transport and Chat.
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { act, cleanup, fireEvent, render, screen } from '@testing-library/react';
import { afterEach, describe, expect, it, vi } from 'vitest';
import { Chat } from '@ai-sdk/react';
import { DefaultChatTransport, readUIMessageStream, type UIMessage, type UIMessageChunk } from 'ai';
import { Conversation, span, unifiedDiff, type Message, type Part } from '../src/conversation';

afterEach(cleanup);

const fixture = (name: string) => readFileSync(join(__dirname, 'fixtures', name), 'utf8');

/** The chunks of an SSE recording. */
function chunks(sse: string): UIMessageChunk[] {
  return sse.split('\n').filter((l) => l.startsWith('data: ') && l !== 'data: [DONE]').map((l) => JSON.parse(l.slice(6)));
}

/** Every intermediate message of a stream, as `readUIMessageStream` builds them. */
async function snapshots(list: UIMessageChunk[]): Promise<UIMessage[]> {
  const stream = new ReadableStream<UIMessageChunk>({
    start(c) { for (const chunk of list) c.enqueue(chunk); c.close(); },
  });
  const out: UIMessage[] = [];
  for await (const m of readUIMessageStream({ stream })) out.push(structuredClone(m));
  return out;
}

const asMessages = (m: UIMessage[]) => m as unknown as Message[];

describe('conversation renderer', () => {
  it('a budget card says what was spent, and while paused offers to add as much again', () => {
    const budget = (state: string) =>
      ({ id: 'a1', role: 'assistant', parts: [{ type: 'data-sortie-budget', id: 'budget', data: { state, kind: 'tokens', spent: 500, limit: 500, how: 'Raise the budget to let it go on.' } }] }) as unknown as Message;
    const raiseBudget = vi.fn();
    const { container, rerender } = render(<Conversation messages={[budget('paused')]} actions={{ raiseBudget }} />);
    const card = container.querySelector('.card.budget-paused');
    expect(card?.getAttribute('role')).toBe('alert');
    expect(card?.textContent).toContain('500 of 500 tokens. Raise the budget to let it go on.');
    fireEvent.click(screen.getByRole('button', { name: 'Add 500 tokens' }));
    expect(raiseBudget).toHaveBeenCalledWith(500);
    rerender(<Conversation messages={[budget('exceeded')]} actions={{ raiseBudget }} />);
    expect(container.querySelector('.card.budget-exceeded')).toBeTruthy();
    expect(screen.queryByRole('button', { name: /Add/ })).toBeNull();
  });

  it('says what a phase waits for, and nothing once the next phase replaced it', () => {
    const phase = (data: Record<string, unknown>) =>
      ({ id: 'a1', role: 'assistant', parts: [{ type: 'data-sortie-phase', id: 'phase', data }] }) as unknown as Message;
    const waiting = 'the gateway cannot be reached; the push is tried again for up to 120s';
    const { container, rerender } = render(<Conversation messages={[phase({ phase: 'delivering', note: waiting })]} actions={{}} />);
    expect(container.querySelector('.note.waiting')?.textContent).toBe(waiting);
    rerender(<Conversation messages={[phase({ phase: 'done', delivery_ms: 900 })]} actions={{}} />);
    expect(container.querySelector('.note.waiting')).toBeNull();
  });

  it('renders every part kind: a real scripted turn and the parts only the platform adds', async () => {
    const scripted = await snapshots(chunks(fixture('scripted-turn.sse')));
    const extras = await snapshots(chunks(fixture('extras.sse')));
    const user: UIMessage = { id: 'u1', role: 'user', parts: [{ type: 'text', text: 'Please write it' }] };
    const { container } = render(<Conversation messages={asMessages([user, scripted[scripted.length - 1], extras[extras.length - 1]])} actions={{}} />);
    const [turn1, turn2] = [...container.querySelectorAll('.msg.assistant')];
    // user prompt, markdown text with a code block
    expect(screen.getByText('Please write it')).toBeTruthy();
    expect(turn1.textContent).toContain('All done. The file hello.txt now says:');
    expect(turn1.querySelector('.md code')?.textContent).toBe('hello.txt');
    // reasoning, collapsed; this recording has no end timestamp, so no duration is made up
    const reasoning = turn1.querySelector('details.reasoning') as HTMLDetailsElement;
    expect(reasoning.open).toBe(false);
    expect(reasoning.querySelector('summary')?.textContent).toBe('Thought');
    // tool calls: collapsible, with title and status (and no duration without an end timestamp)
    const tools = [...turn1.querySelectorAll('details.tool')];
    expect(tools.map((t) => t.querySelector('summary')?.textContent)).toEqual([
      'edit Write hello.txt done', 'execute cat hello.txt; echo done done', 'execute exit 3 failed',
    ]);
    expect(turn1.querySelectorAll('.took')).toHaveLength(0);
    // the three calls (with the edit's diff) are one collapsible group
    const groups = turn1.querySelectorAll('details.tools');
    expect(groups).toHaveLength(1);
    expect(groups[0].querySelector('summary')?.textContent).toBe('3 tool calls · 1 failed');
    expect(groups[0].querySelectorAll('details.tool')).toHaveLength(3);
    expect(groups[0].querySelector('.diff')).toBeTruthy();
    // the diff as a unified diff
    expect(turn1.querySelector('.diff pre')?.textContent).toBe('--- /dev/null+++ b/hello.txt@@ -1,0 +1,1 @@+hello');
    expect(turn1.querySelector('.diff pre .add')?.textContent).toBe('+hello');
    // the plan as a checklist
    const boxes = [...turn1.querySelectorAll('.plan input[type=checkbox]')] as HTMLInputElement[];
    expect(boxes.map((b) => b.checked)).toEqual([true, true]);
    // the delivery card with the branch
    expect(turn1.querySelector('.delivery')?.textContent).toContain('sortie/ses_01kfixture0000000000000000');
    expect(turn1.querySelector('.delivery')?.textContent).toContain('1 file +1 −0');
    // how the agent was primed (data-sortie-priming)
    const priming = turn2.querySelector('.priming') as HTMLElement;
    expect(priming.dataset.rung).toBe('transcript');
    expect(priming.textContent).toBe('The agent was given the conversation so far (a fresh agent process).');
    // terminal output with its exit status
    // (in the card of the tool call it belongs to, not as a card of its own)
    expect(turn2.querySelectorAll('.card.terminal')).toHaveLength(0);
    const owner = turn2.querySelector('details.tool-cmd') as HTMLElement;
    expect(owner.querySelector('.term-out')?.textContent).toBe('running 3 tests\nok');
    expect(owner.querySelector('.exit')?.textContent).toBe('exit 0');
    // a command's output as a terminal block, failed or not, with no raw JSON shown
    const commands = [...turn1.querySelectorAll('details.tool-cmd')] as HTMLDetailsElement[];
    expect(commands.map((c) => [c.open, c.querySelector('.term-cmd')?.textContent, c.querySelector('.exit')?.textContent, c.querySelector('.term-out')?.textContent ?? null]))
      .toEqual([[true, '$ cat hello.txt; echo done', 'exit 0', 'hello\ndone'], [true, '$ exit 3', 'exit 3', null]]);
    expect(turn1.textContent).not.toMatch(/exitCode|"raw"/);
    // an egress denial the agent ran into twice: one card, with the count
    const denials = turn2.querySelectorAll('.egress');
    expect(denials).toHaveLength(1);
    expect(denials[0].textContent).toContain('Blocked connection to packages.example.net:443 (not in the allowlist) ×2');
    // the turn's usage (data-sortie-usage: the proxy's cumulative tokens, updated in place; data-acp-usage: the context window) as one line
    expect(container.querySelectorAll('[aria-label="turn usage"]')).toHaveLength(1);
    expect(turn2.querySelector('.usage-line')?.textContent).toBe('3,456 in · 789 out tokens (claude-sonnet-4-5) · context 45,000 / 200,000 (23%)');
    // nothing falls through to the unknown-part note
    expect([...container.querySelectorAll('.note')].filter((n) => /^(data-|tool-)/.test(n.textContent ?? ''))).toEqual([]);
  });

  it('shows a finished part\'s duration from its own start and end timestamps', async () => {
    const all = await snapshots(chunks(fixture('timed.sse')));
    const { container } = render(<Conversation messages={asMessages([all[all.length - 1]])} actions={{}} />);
    expect(container.querySelector('details.reasoning summary')?.textContent).toBe('Thought for 4s');
    const tools = [...container.querySelectorAll('details.tool')];
    expect(tools.map((t) => t.querySelector('summary')?.textContent)).toEqual([
      'execute cargo test done1.3 s', 'execute exit 3 failed80 ms', 'execute sleep 60 running',
    ]);
    // while reasoning streams it says so, with no duration yet
    const thinking = all.find((m) => m.parts.some((p) => p.type === 'reasoning' && p.state === 'streaming'))!;
    const { container: live } = render(<Conversation messages={asMessages([thinking])} actions={{}} />);
    expect(live.querySelector('details.reasoning summary')?.textContent).toBe('Thinking…');
  });

  it('reads the timestamps where the live client and the stored history each keep them', () => {
    const at = '2026-12-02T18:56:31.500Z', endedAt = '2026-12-02T18:56:32.750Z';
    const live: Part = { type: 'dynamic-tool', callProviderMetadata: { sortie: { at } }, resultProviderMetadata: { sortie: { at, endedAt } } };
    const stored: Part = { type: 'dynamic-tool', providerMetadata: { sortie: { at, endedAt } } };
    const started: Part = { type: 'reasoning', providerMetadata: { sortie: { at } } };
    const garbled: Part = { type: 'reasoning', providerMetadata: { sortie: { at: 'yesterday', endedAt: 3 } } };
    expect(span(live)).toEqual({ start: Date.parse(at), end: Date.parse(endedAt) });
    expect(span(stored)).toEqual({ start: Date.parse(at), end: Date.parse(endedAt) });
    expect(span(started)).toEqual({ start: Date.parse(at), end: undefined });
    expect(span(garbled)).toEqual({ start: undefined, end: undefined });
  });

  it('an egress denial\'s button amends the allowlist, and an allowed host says so', async () => {
    const all = await snapshots(chunks(fixture('extras.sse')));
    const allowHost = vi.fn();
    const { container, rerender } = render(<Conversation messages={asMessages([all[all.length - 1]])} actions={{ allowHost, allowed: [] }} />);
    expect(screen.getByRole('link', { name: 'the docs' }).getAttribute('href')).toBe('https://example.com');
    expect(container.querySelector('.md strong')?.textContent).toBe('this');
    fireEvent.click(screen.getByRole('button', { name: 'Allow packages.example.net' }));
    expect(allowHost).toHaveBeenCalledWith('packages.example.net');
    rerender(<Conversation messages={asMessages([all[all.length - 1]])} actions={{ allowHost, allowed: ['packages.example.net'] }} />);
    expect(screen.queryByRole('button', { name: 'Allow packages.example.net' })).toBeNull();
    expect(container.querySelector('.egress')?.textContent).toContain('allowed: the next connection goes through');
  });

  it('updates data parts with the same id in place', async () => {
    const all = await snapshots(chunks(fixture('scripted-turn.sse')));
    const firstPlan = all.findIndex((m) => m.parts.some((p) => p.type === 'data-acp-plan'));
    const { container, rerender } = render(<Conversation messages={asMessages([all[firstPlan]])} actions={{}} />);
    const checked = () => ([...container.querySelectorAll('.plan input')] as HTMLInputElement[]).map((b) => b.checked);
    expect(checked()).toEqual([false, false]);
    const planNode = container.querySelector('.plan');
    for (const m of all.slice(firstPlan + 1)) rerender(<Conversation messages={asMessages([m])} actions={{}} />);
    expect(container.querySelectorAll('.plan')).toHaveLength(1);
    expect(container.querySelector('.plan')).toBe(planNode); // the same element, updated
    expect(checked()).toEqual([true, true]);
  });

  it('does not duplicate a running turn that is replayed on resume', async () => {
    const sse = fixture('scripted-turn.sse');
    const events = sse.split('\n\n');
    const cut = events.slice(0, 40).join('\n\n') + '\n\n'; // the stream breaks mid-turn
    const partial = await snapshots(chunks(cut));
    const history: UIMessage[] = [
      { id: 'u1', role: 'user', parts: [{ type: 'text', text: 'go' }] },
      partial[partial.length - 1],
    ];
    const fetch = vi.fn(async () => new Response(sse, {
      status: 200, headers: { 'content-type': 'text/event-stream', 'x-vercel-ai-ui-message-stream': 'v1' },
    }));
    const chat = new Chat({
      id: 'ses_x', messages: history,
      transport: new DefaultChatTransport({ api: '/v1/sessions/ses_x/stream', fetch, resumeStreamIsReplay: true }),
    });
    await act(async () => { await chat.resumeStream(); });
    expect(fetch).toHaveBeenCalledTimes(1);
    expect(chat.messages.map((m) => m.id)).toEqual(['u1', 'ses_local-t1']);
    const { container } = render(<Conversation messages={asMessages(chat.messages)} actions={{}} />);
    expect(container.querySelectorAll('.msg.assistant')).toHaveLength(1);
    expect(container.querySelectorAll('details.tool')).toHaveLength(3);
    expect(container.querySelectorAll('.plan')).toHaveLength(1);
    expect(container.querySelectorAll('details.reasoning')).toHaveLength(1);
  });
});

describe('user prompts', () => {
  it('shows a long prompt\'s first lines until expanded', () => {
    const text = Array.from({ length: 20 }, (_, i) => `line ${i + 1}`).join('\n');
    const { container } = render(<Conversation messages={[{ id: 'u', role: 'user', parts: [{ type: 'text', text }] }]} actions={{}} />);
    const prompt = () => container.querySelector('.prompt')?.textContent;
    expect(prompt()).toBe('line 1\nline 2\nline 3\nline 4\nline 5\nline 6');
    fireEvent.click(screen.getByRole('button', { name: 'Show all 20 lines' }));
    expect(prompt()).toBe(text);
    fireEvent.click(screen.getByRole('button', { name: 'Show less' }));
    expect(prompt()?.split('\n')).toHaveLength(6);
  });

  it('shows a short prompt whole, without a button', () => {
    const text = 'Fix the flaky parser test.\nIt fails one run in ten.';
    const { container } = render(<Conversation messages={[{ id: 'u', role: 'user', parts: [{ type: 'text', text }] }]} actions={{}} />);
    expect(container.querySelector('.prompt')?.textContent).toBe(text);
    expect(screen.queryByRole('button')).toBeNull();
  });
});

describe('unifiedDiff', () => {
  it('shows changed lines with context', () => {
    expect(unifiedDiff('a.txt', 'a\nb\nc\n', 'a\nB\nc\n')).toEqual([
      '--- a/a.txt', '+++ b/a.txt', '@@ -1,3 +1,3 @@', ' a', '-b', '+B', ' c',
    ]);
  });
});
