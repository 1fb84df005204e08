// The session page's bookkeeping between its stream and the stored history: which turn a streamed
// answer belongs to, and which of a stored message and the shown one holds more.
import { describe, expect, it } from 'vitest';
import type { UIMessage } from 'ai';
import { earlierShown, newest, nextOlder, turnOfLastAnswer, withEarlier, type Earlier } from '../src/session';

const user = (id: string): UIMessage => ({ id, role: 'user', parts: [{ type: 'text', text: 'do it' }] });
const answer = (id: string, parts: number): UIMessage => ({
  id,
  role: 'assistant',
  parts: Array.from({ length: parts }, (_, i) => ({ type: 'text' as const, text: `part ${i}` })),
});

describe('turnOfLastAnswer', () => {
  it('reads the turn from the last assistant message id', () => {
    expect(turnOfLastAnswer([user('u1'), answer('ses_a-t1', 2), user('u2'), answer('ses_a-t12', 1)])).toBe(12);
    expect(turnOfLastAnswer([user('u1'), answer('ses_a-t3', 2), user('u2')])).toBe(3);
  });
  it('knows no turn without an answer or with an id it did not name', () => {
    expect(turnOfLastAnswer([])).toBeNull();
    expect(turnOfLastAnswer([user('u1')])).toBeNull();
    expect(turnOfLastAnswer([answer('msg-x', 1)])).toBeNull();
  });
});

describe('newest', () => {
  const shown = [user('u1'), answer('ses_a-t1', 5)];
  it('keeps a shown message that holds more than its stored copy', () => {
    const stored = [user('u1'), answer('ses_a-t1', 4)];
    expect(newest(stored, shown)[1]).toBe(shown[1]);
    const running = { ...answer('ses_a-t1', 5), parts: [{ type: 'dynamic-tool', toolCallId: 'c', toolName: 'execute', state: 'input-available', input: {} }] } as UIMessage;
    const done = { ...running, parts: [{ ...running.parts[0], state: 'output-available', output: 'reached' }] } as UIMessage;
    expect(newest([user('u1'), running], [user('u1'), done])[1]).toBe(done);
  });
  it('takes the stored message when it holds as much or more, and stored messages the page lacks', () => {
    const stored = [user('ses_a-u1'), answer('ses_a-t1', 5), user('ses_a-u2')];
    const merged = newest(stored, shown);
    expect(merged).toHaveLength(3);
    expect(merged[0]).toBe(stored[0]);
    expect(merged[1]).toBe(stored[1]);
    expect(merged[2]).toBe(stored[2]);
    expect(newest([], shown)).toEqual([]);
  });
});

describe('earlier turns', () => {
  const page = (turns: number[], older: number | null) => ({ messages: turns.map((n) => user(`ses_a-u${n}`)), older });
  const ids = (e: Earlier | null) => e?.messages.map((m) => m.id);
  it('loads older pages before the newest one until the first turn', () => {
    // The newest page starts at turn 21: the first click loads before it, the next before what that brought.
    expect(nextOlder(null, 21)).toBe(21);
    const first = withEarlier(null, 21, page([11, 12], 11));
    expect(ids(earlierShown(first, 21))).toEqual(['ses_a-u11', 'ses_a-u12']);
    expect(nextOlder(first, 21)).toBe(11);
    const second = withEarlier(first, 21, page([1, 2], null));
    expect(ids(earlierShown(second, 21))).toEqual(['ses_a-u1', 'ses_a-u2', 'ses_a-u11', 'ses_a-u12']);
    expect(nextOlder(second, 21)).toBeNull();
  });
  it('shows nothing earlier, and offers nothing, when the newest page holds the first turn', () => {
    expect(nextOlder(null, null)).toBeNull();
    expect(earlierShown(null, null)).toBeNull();
  });
  it('drops turns loaded under a newest page that has moved on, and loads from the new one', () => {
    const loaded = withEarlier(null, 21, page([1, 2], null));
    // A turn was added: the newest page now starts at turn 22, and turn 21 is in neither.
    expect(earlierShown(loaded, 22)).toBeNull();
    expect(nextOlder(loaded, 22)).toBe(22);
    const again = withEarlier(loaded, 22, page([21], 21));
    expect(ids(earlierShown(again, 22))).toEqual(['ses_a-u21']);
  });
});
