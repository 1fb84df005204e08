import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { lastJsonLine, run, startServer } from './_support.mjs';

let srv;
before(async () => {
  srv = await startServer({ pauseMs: 150 });
});
after(() => srv.close());

const chatResume = (...args) => run('chat-resume.mjs', args);
const count = (path) => srv.requests.filter((r) => r.path === path).length;

/** slow.sse has every part of the turn; the final message must hold each exactly once. */
function assertSlowMessage(out) {
  assert.equal(out.status, 'ready');
  assert.equal(out.error, null);
  assert.equal(out.messages.length, 1);
  const [m] = out.messages;
  assert.equal(m.id, 'msg-slow-1');
  assert.equal(m.role, 'assistant');
  assert.deepEqual(
    m.parts.map((p) => p.type),
    ['step-start', 'reasoning', 'data-acp-plan', 'dynamic-tool', 'text'],
  );
  assert.equal(m.parts[1].text, 'Thinking.');
  assert.equal(m.parts[2].data.entries[0].status, 'completed');
  assert.equal(m.parts[3].state, 'output-available');
  assert.deepEqual(m.parts[3].output, { ok: true });
  assert.deepEqual(m.parts[4], { type: 'text', text: 'Hello world.', state: 'done' });
}

describe('chat-resume', () => {
  test('--resumes 2 over TCP: one assistant message, every part once', async () => {
    const before = count('/slow/slow.sse');
    const r = await chatResume('--url', `${srv.base}/slow/slow.sse`, '--chat-id', 'c1', '--resumes', '2');
    assert.equal(r.code, 0, r.stderr);
    assertSlowMessage(lastJsonLine(r.stdout));
    assert.equal(count('/slow/slow.sse') - before, 2, 'two GET requests');
    assert.equal(srv.requests.at(-1).method, 'GET');
  });

  test('--resumes 2 over the Unix socket', async () => {
    const r = await chatResume('--url', 'http://sortie.test/slow/slow.sse', '--socket', srv.socketPath, '--resumes', '2');
    assert.equal(r.code, 0, r.stderr);
    assertSlowMessage(lastJsonLine(r.stdout));
  });

  test('connections dropped mid-turn (--cut-after), replay replaces the partial message', async () => {
    // Block 11 is inside the text, after the pause: the partial message has open parts.
    const r = await chatResume('--url', 'http://sortie.test/slow/slow.sse', '--socket', srv.socketPath, '--resumes', '3', '--cut-after', '11');
    assert.equal(r.code, 0, r.stderr);
    assert.match(r.stderr, /resume 1\/3: .*status=error .*simulated disconnect/);
    assertSlowMessage(lastJsonLine(r.stdout));
  });

  test('control: without resumeStreamIsReplay the replay duplicates parts and fails', async () => {
    const r = await chatResume('--url', `${srv.base}/slow/slow.sse`, '--resumes', '3', '--cut-after', '11', '--no-replay');
    assert.equal(r.code, 1);
    assert.match(r.stderr, /duplicated parts/);
    const out = lastJsonLine(r.stdout);
    assert.equal(out.messages.length, 1);
    assert.ok(out.messages[0].parts.length > 5);
  });

  test('--header-file is re-read before each request (rotating single-use tickets)', async () => {
    const seqBefore = srv.ticketSeq;
    const r = await chatResume('--url', `${srv.base}/ticket/slow/slow.sse`, '--header-file', srv.ticketFile, '--resumes', '3');
    assert.equal(r.code, 0, r.stderr);
    assertSlowMessage(lastJsonLine(r.stdout));
    assert.equal(srv.ticketSeq - seqBefore, 3, 'three tickets used');
  });

  test('a fixed --header ticket is refused on the second resume', async () => {
    const r = await chatResume('--url', `${srv.base}/ticket/slow/slow.sse`, '--header', `x-sortie-ticket: ${srv.ticket}`, '--resumes', '2');
    assert.equal(r.code, 1);
    assert.match(r.stderr, /resume 2\/2: HTTP 401/);
    assert.equal(lastJsonLine(r.stdout).status, 'error');
  });

  test('204 (no active stream) fails: no assistant message', async () => {
    const r = await chatResume('--url', `${srv.base}/none`);
    assert.equal(r.code, 1);
    assert.match(r.stderr, /0 assistant messages, expected exactly 1 \(server answered 204/);
    assert.deepEqual(lastJsonLine(r.stdout), { status: 'ready', error: null, messages: [] });
  });

  test('an error chunk puts Chat in error', async () => {
    const r = await chatResume('--url', `${srv.base}/sse/error-chunk.sse`);
    assert.equal(r.code, 1);
    const out = lastJsonLine(r.stdout);
    assert.equal(out.status, 'error');
    assert.match(out.error, /agent crashed/);
  });

  test('a bad chunk puts Chat in error', async () => {
    const r = await chatResume('--url', `${srv.base}/sse/bad-unknown-type.sse`);
    assert.equal(r.code, 1);
    assert.match(lastJsonLine(r.stdout).error, /AI_TypeValidationError/);
  });

  test('bad command line exits 64', async () => {
    assert.equal((await chatResume()).code, 64);
    assert.equal((await chatResume('--url', 'http://x/', '--resumes', '0')).code, 64);
  });
});
