// The session page's bookkeeping between its stream and the stored history: which turn a streamed
// answer belongs to, and when a stored history is behind what the page already shows.
import { describe, expect, it } from 'vitest';
import type { UIMessage } from 'ai';
import { isBehind, turnOfLastAnswer } from '../src/session';

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

describe('isBehind', () => {
  const shown = [user('u1'), answer('ses_a-t1', 5)];
  it('is behind when a message has fewer parts or a message is missing', () => {
    expect(isBehind([user('u1'), answer('ses_a-t1', 4)], shown)).toBe(true);
    expect(isBehind([user('u1')], shown)).toBe(true);
  });
  it('is not behind when it is the same, has more, or is a different conversation', () => {
    expect(isBehind([user('u1'), answer('ses_a-t1', 5)], shown)).toBe(false);
    expect(isBehind([user('u1'), answer('ses_a-t1', 6)], shown)).toBe(false);
    expect(isBehind([...shown, user('u2')], shown)).toBe(false);
    expect(isBehind([user('u9'), answer('ses_a-t1', 1)], shown)).toBe(false);
    expect(isBehind([], [])).toBe(false);
  });
});
