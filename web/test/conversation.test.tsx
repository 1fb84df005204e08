// The conversation renderer over recorded streams: a real turn of the scripted agent through `sortie
// driver` (fixtures/scripted-turn.sse) and a hand-written one with the parts the driver alone cannot
// produce (terminal output, an egress denial). Streams go through the real `ai` transport and Chat.
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { act, cleanup, fireEvent, render, screen } from '@testing-library/react';
import { afterEach, describe, expect, it, vi } from 'vitest';
import { Chat } from '@ai-sdk/react';
import { DefaultChatTransport, readUIMessageStream, type UIMessage, type UIMessageChunk } from 'ai';
import { Conversation, unifiedDiff, type Message } from '../src/conversation';

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
  it('renders every part kind of a real scripted turn', async () => {
    const all = await snapshots(chunks(fixture('scripted-turn.sse')));
    const final = all[all.length - 1];
    const user: UIMessage = { id: 'u1', role: 'user', parts: [{ type: 'text', text: 'Please write it' }] };
    const { container } = render(<Conversation messages={asMessages([user, final])} actions={{}} />);
    // user prompt, markdown text with a code block
    expect(screen.getByText('Please write it')).toBeTruthy();
    expect(container.querySelector('.msg.assistant')?.textContent).toContain('All done. The file hello.txt now says:');
    expect(container.querySelector('.md code')?.textContent).toBe('hello.txt');
    // reasoning, collapsed
    const reasoning = container.querySelector('details.reasoning') as HTMLDetailsElement;
    expect(reasoning.open).toBe(false);
    expect(reasoning.querySelector('summary')?.textContent).toMatch(/^Thought/);
    // tool calls: collapsible, with title and status
    const tools = [...container.querySelectorAll('details.tool')];
    expect(tools.map((t) => t.querySelector('summary')?.textContent?.replace(/\d+ ms$/, ''))).toEqual([
      'edit Write hello.txt done', 'execute cat hello.txt; echo done done', 'execute exit 3 failed',
    ]);
    // the three calls (with the edit's diff) are one collapsible group
    const groups = container.querySelectorAll('details.tools');
    expect(groups).toHaveLength(1);
    expect(groups[0].querySelector('summary')?.textContent).toBe('3 tool calls · 1 failed');
    expect(groups[0].querySelectorAll('details.tool')).toHaveLength(3);
    expect(groups[0].querySelector('.diff')).toBeTruthy();
    // the diff as a unified diff
    expect(container.querySelector('.diff pre')?.textContent).toBe('--- /dev/null+++ b/hello.txt@@ -1,0 +1,1 @@+hello');
    expect(container.querySelector('.diff pre .add')?.textContent).toBe('+hello');
    // the plan as a checklist
    const boxes = [...container.querySelectorAll('.plan input[type=checkbox]')] as HTMLInputElement[];
    expect(boxes.map((b) => b.checked)).toEqual([true, true]);
    // the delivery card with the branch
    expect(container.querySelector('.delivery')?.textContent).toContain('sortie/ses_01kfixture0000000000000000');
    expect(container.querySelector('.delivery')?.textContent).toContain('1 files');
  });

  it('renders terminal output, links and an egress denial whose button amends the allowlist', async () => {
    const all = await snapshots(chunks(fixture('extras.sse')));
    const allowHost = vi.fn();
    const { container } = render(<Conversation messages={asMessages([all[all.length - 1]])} actions={{ allowHost }} />);
    expect(container.querySelectorAll('.terminal')).toHaveLength(1);
    expect(container.querySelector('.terminal pre')?.textContent).toBe('running 3 tests\nok\n');
    expect(container.querySelector('.terminal .kind')?.textContent).toContain('exit 0');
    expect(screen.getByRole('link', { name: 'the docs' }).getAttribute('href')).toBe('https://example.com');
    expect(container.querySelector('.md strong')?.textContent).toBe('this');
    fireEvent.click(screen.getByRole('button', { name: 'Allow packages.example.net' }));
    expect(allowHost).toHaveBeenCalledWith('packages.example.net');
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

  it('renders 2,000 parts quickly', () => {
    const parts = Array.from({ length: 2000 }, (_, i) => (i % 4 === 0
      ? { type: 'dynamic-tool', toolCallId: `c${i}`, toolName: 'execute', title: `step ${i}`, state: 'output-available', input: { command: 'ls' }, output: 'ok' }
      : { type: 'text', text: `Paragraph ${i} with \`code\` and **bold**.`, state: 'done' }));
    const t0 = performance.now();
    const { container } = render(<Conversation messages={[{ id: 'a', role: 'assistant', parts } as Message]} actions={{}} />);
    const took = performance.now() - t0;
    expect(container.querySelectorAll('details.tool')).toHaveLength(500);
    console.log(`jsdom render of 2,000 parts: ${took.toFixed(0)} ms`);
  });
});

describe('unifiedDiff', () => {
  it('shows changed lines with context', () => {
    expect(unifiedDiff('a.txt', 'a\nb\nc\n', 'a\nB\nc\n')).toEqual([
      '--- a/a.txt', '+++ b/a.txt', '@@ -1,3 +1,3 @@', ' a', '-b', '+B', ' c',
    ]);
  });
});
