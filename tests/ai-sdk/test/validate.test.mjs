import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { fixture, lastJsonLine, run, startServer } from './_support.mjs';

let srv;
before(async () => {
  srv = await startServer();
});
after(() => srv.close());

const validate = (...args) => run('validate.mjs', args);

function assertGoodMessage(m) {
  assert.equal(m.id, 'msg-sortie-1');
  assert.equal(m.role, 'assistant');
  assert.deepEqual(m.metadata, { sessionId: 'sess-1', agent: 'claude-code' });
  assert.deepEqual(
    m.parts.map((p) => p.type),
    [
      'data-sortie-priming',
      'step-start',
      'reasoning',
      'data-acp-plan',
      'dynamic-tool',
      'data-acp-diff',
      'dynamic-tool',
      'data-acp-terminal',
      'data-acp-usage',
      'data-acp-mode',
      'step-start',
      'text',
    ],
  );
  const byType = (t) => m.parts.filter((p) => p.type === t);
  assert.deepEqual(byType('reasoning')[0], { type: 'reasoning', id: 'r1', text: 'Need to fix the greeting.', state: 'done' });
  // The second data-acp-plan (same id) replaced the first in place.
  const [plan] = byType('data-acp-plan');
  assert.deepEqual(plan.data.entries.map((e) => e.status), ['completed', 'completed']);
  const [edit, bash] = byType('dynamic-tool');
  assert.deepEqual(
    { ...edit },
    {
      type: 'dynamic-tool',
      toolName: 'edit',
      toolCallId: 'call-1',
      state: 'output-available',
      input: { path: 'src/main.rs' },
      output: { status: 'completed' },
      title: 'Edit src/main.rs',
    },
  );
  assert.equal(bash.state, 'output-error');
  assert.equal(bash.errorText, 'exit status 101');
  assert.equal(bash.title, 'cargo test');
  assert.deepEqual(byType('data-acp-diff')[0].data, {
    toolCallId: 'call-1',
    path: 'src/main.rs',
    oldText: 'println!("hi");',
    newText: 'println!("hello");',
  });
  assert.equal(byType('data-acp-terminal')[0].data.exitStatus.exitCode, 101);
  assert.deepEqual(byType('data-acp-usage')[0].data, { used: 1234, size: 200000 });
  assert.deepEqual(byType('data-acp-mode')[0].data, { currentModeId: 'code' });
  assert.equal(byType('data-acp-commands').length, 0, 'transient data must not become a part');
  assert.deepEqual(byType('text')[0], {
    type: 'text',
    text: 'Fixed the greeting.',
    providerMetadata: { sortie: { at: '2026-12-02T00:00:00.000Z' } },
    state: 'done',
  });
}

describe('good stream', () => {
  test('from a file', async () => {
    const r = await validate('--file', fixture('good.sse'), '--print');
    assert.equal(r.code, 0, r.stderr);
    assert.equal(r.stdout.trim().split('\n').length, 1, 'one JSON line on stdout');
    assertGoodMessage(lastJsonLine(r.stdout));
  });

  test('over TCP, GET with headers', async () => {
    const r = await validate('--url', `${srv.base}/sse/good.sse`, '--header', 'Authorization: Bearer t0k', '--print');
    assert.equal(r.code, 0, r.stderr);
    assertGoodMessage(lastJsonLine(r.stdout));
    const req = srv.requests.at(-1);
    assert.equal(req.method, 'GET');
    assert.equal(req.headers.authorization, 'Bearer t0k');
  });

  test('over TCP, POST with --body', async () => {
    const r = await validate('--url', `${srv.base}/sse/good.sse`, '--body', '{"id":"c1","messages":[]}', '--print');
    assert.equal(r.code, 0, r.stderr);
    const req = srv.requests.at(-1);
    assert.equal(req.method, 'POST');
    assert.equal(req.headers['content-type'], 'application/json');
    assert.deepEqual(JSON.parse(req.body), { id: 'c1', messages: [] });
  });

  test('over the Unix socket', async () => {
    const r = await validate('--url', 'http://sortie.test/sse/good.sse', '--socket', srv.socketPath, '--print');
    assert.equal(r.code, 0, r.stderr);
    assertGoodMessage(lastJsonLine(r.stdout));
  });

  test('slow (paused) stream over the Unix socket', async () => {
    const r = await validate('--url', 'http://sortie.test/slow/slow.sse', '--socket', srv.socketPath);
    assert.equal(r.code, 0, r.stderr);
  });
});

describe('bad streams exit 1', { concurrency: true }, () => {
  const cases = [
    ['bad-missing-done.sse', /missing final "data: \[DONE\]"/],
    ['bad-data-after-done.sse', /event #5 is "data: \[DONE\]" but 1 event\(s\) follow it/],
    ['bad-extra-key-at.sse', /event #3: key "at" is not defined for chunk type "text-delta"[\s\S]*raw: \{"type":"text-delta"/],
    ['bad-title-null.sse', /event #2 rejected by uiMessageChunkSchema: .*title: .*received null[\s\S]*raw: .*"title":null/],
    ['bad-messageid-null.sse', /event #1 rejected by uiMessageChunkSchema: .*messageId: .*received null/],
    ['bad-unknown-type.sse', /event #2 rejected by uiMessageChunkSchema: .*unknown chunk type[\s\S]*raw: \{"type":"agent-thought"/],
    ['bad-delta-without-start.sse', /event #2: readUIMessageStream: AI_UIMessageStreamError: Received text-delta for missing text part[\s\S]*raw: \{"type":"text-delta"/],
    ['bad-data-without-data.sse', /event #2 rejected by uiMessageChunkSchema: .*data: [\s\S]*raw: \{"type":"data-acp-plan","id":"plan"\}/],
    ['bad-first-not-start.sse', /first chunk is not "start" \(event #1\)/],
    ['bad-last-not-finish.sse', /last chunk is not "finish", "abort" or "error" \(event #4\)/],
    ['bad-open-part.sse', /parts\[0\] \(text\) is still "streaming"/],
  ];
  for (const [name, re] of cases) {
    test(name, async () => {
      const r = await validate('--file', fixture(name), '--print');
      assert.equal(r.code, 1, `${r.stdout}\n${r.stderr}`);
      assert.match(r.stderr, re);
      assert.equal(r.stdout, '', 'nothing on stdout when invalid');
    });
  }

  test('same over HTTP (missing [DONE])', async () => {
    const r = await validate('--url', `${srv.base}/sse/bad-missing-done.sse`);
    assert.equal(r.code, 1);
    assert.match(r.stderr, /missing final "data: \[DONE\]"/);
  });

  test('missing x-vercel-ai-ui-message-stream header', async () => {
    const r = await validate('--url', `${srv.base}/plain/good.sse`);
    assert.equal(r.code, 1);
    assert.match(r.stderr, /missing header x-vercel-ai-ui-message-stream: v1/);
  });

  test('wrong content-type', async () => {
    const r = await validate('--url', `${srv.base}/html/good.sse`);
    assert.equal(r.code, 1);
    assert.match(r.stderr, /content-type is "text\/html", expected text\/event-stream/);
  });

  test('non-200 status', async () => {
    const r = await validate('--url', `${srv.base}/status/500`);
    assert.equal(r.code, 1);
    assert.match(r.stderr, /HTTP status 500/);
  });

  test('connection refused', async () => {
    const r = await validate('--url', 'http://127.0.0.1:1/x');
    assert.equal(r.code, 1);
    assert.match(r.stderr, /request to .* failed/);
  });
});

describe('other exit codes', () => {
  test('an error chunk exits 2 and still prints the message', async () => {
    const r = await validate('--url', `${srv.base}/sse/error-chunk.sse`, '--print');
    assert.equal(r.code, 2, r.stderr);
    assert.match(r.stderr, /error chunk\(s\): event #5: "agent crashed"/);
    assert.deepEqual(lastJsonLine(r.stdout).parts, [{ type: 'text', text: 'hi', state: 'done' }]);
  });

  test('204 exits 3 (TCP and Unix socket)', async () => {
    for (const args of [['--url', `${srv.base}/none`], ['--url', 'http://x/none', '--socket', srv.socketPath]]) {
      const r = await validate(...args);
      assert.equal(r.code, 3, r.stderr);
      assert.match(r.stderr, /no active stream/);
    }
  });

  test('bad command line exits 64', async () => {
    assert.equal((await validate()).code, 64);
    assert.equal((await validate('--file', 'a', '--url', 'b')).code, 64);
    assert.equal((await validate('--url', 'http://x/', '--header', 'no-colon')).code, 64);
  });
});
