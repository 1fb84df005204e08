// Test support (not a test file): a fixture server on 127.0.0.1:0 and on a
// Unix socket, and a runner for the CLIs.
import { execFile } from 'node:child_process';
import { mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { createServer } from 'node:http';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

export const KIT = join(dirname(fileURLToPath(import.meta.url)), '..');
export const FIXTURES = join(KIT, 'test', 'fixtures');
export const fixture = (name) => join(FIXTURES, name);

export const SSE_HEADERS = {
  'content-type': 'text/event-stream',
  'cache-control': 'no-cache',
  connection: 'keep-alive',
  'x-vercel-ai-ui-message-stream': 'v1',
  'x-accel-buffering': 'no',
};

const PAUSE = ': sortie-test-pause\n\n';
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/**
 * Routes:
 *   GET|POST /sse/<fixture>    the fixture with the UI-stream headers
 *   GET /plain/<fixture>       ... without x-vercel-ai-ui-message-stream
 *   GET /html/<fixture>        ... with content-type text/html
 *   GET /none                  204 (no active stream)
 *   GET /status/<code>         that status
 *   GET /slow/<fixture>        replays the fixture from `start`, pausing
 *                              `pauseMs` at each ": sortie-test-pause" line
 *   GET /ticket/slow/<fixture> same, but only with header x-sortie-ticket equal
 *                              to the current single-use ticket (else 401); on
 *                              success the ticket rotates and the new one is
 *                              written to `ticketFile` as "x-sortie-ticket: …"
 */
export async function startServer({ pauseMs = 150 } = {}) {
  const dir = await mkdtemp(join(tmpdir(), 'sortie-ai-sdk-'));
  const state = {
    requests: [],
    ticket: 'ticket-1',
    ticketSeq: 1,
    ticketFile: join(dir, 'headers.txt'),
    socketPath: join(dir, 'fixture.sock'),
  };
  await writeFile(state.ticketFile, `x-sortie-ticket: ${state.ticket}\n`);

  const handler = async (req, res) => {
    const body = await new Promise((resolve) => {
      let b = '';
      req.setEncoding('utf8');
      req.on('data', (d) => (b += d));
      req.on('end', () => resolve(b));
    });
    const url = new URL(req.url, 'http://fixture');
    state.requests.push({ method: req.method, path: url.pathname, headers: req.headers, body });
    const parts = url.pathname.split('/').filter(Boolean);
    try {
      if (parts[0] === 'none') return void res.writeHead(204).end();
      if (parts[0] === 'status') return void res.writeHead(Number(parts[1]), { 'content-type': 'text/plain' }).end('nope');
      let slow = false;
      if (parts[0] === 'ticket') {
        if (req.headers['x-sortie-ticket'] !== state.ticket) {
          return void res.writeHead(401, { 'content-type': 'text/plain' }).end('bad ticket');
        }
        state.ticket = `ticket-${++state.ticketSeq}`;
        await writeFile(state.ticketFile, `# rotated\nx-sortie-ticket: ${state.ticket}\n`);
        parts.shift();
      }
      const [mode, name] = parts;
      const text = await readFile(fixture(name), 'utf8');
      const headers = { ...SSE_HEADERS };
      if (mode === 'plain') delete headers['x-vercel-ai-ui-message-stream'];
      else if (mode === 'html') headers['content-type'] = 'text/html';
      else if (mode === 'slow') slow = true;
      else if (mode !== 'sse') return void res.writeHead(404).end();
      res.writeHead(200, headers);
      if (!slow) return void res.end(text);
      const pieces = text.split(PAUSE);
      for (let i = 0; i < pieces.length; i++) {
        if (i > 0) {
          res.write(PAUSE);
          await sleep(pauseMs);
        }
        res.write(pieces[i]);
      }
      res.end();
    } catch (e) {
      if (!res.headersSent) res.writeHead(500, { 'content-type': 'text/plain' });
      res.end(String(e));
    }
  };

  const tcp = createServer(handler);
  const unix = createServer(handler);
  await new Promise((r) => tcp.listen(0, '127.0.0.1', r));
  await new Promise((r) => unix.listen(state.socketPath, r));
  state.base = `http://127.0.0.1:${tcp.address().port}`;
  state.close = async () => {
    for (const s of [tcp, unix]) {
      s.closeAllConnections();
      await new Promise((r) => s.close(r));
    }
    await rm(dir, { recursive: true, force: true });
  };
  return state;
}

/** Runs `node <script> ...args` asynchronously (the server lives in this process). */
export function run(script, args, { timeout = 60_000 } = {}) {
  return new Promise((resolve) => {
    execFile(process.execPath, [join(KIT, script), ...args], { cwd: KIT, timeout }, (err, stdout, stderr) => {
      const code = err ? (typeof err.code === 'number' ? err.code : -1) : 0;
      resolve({ code, stdout, stderr });
    });
  });
}

export const lastJsonLine = (stdout) => JSON.parse(stdout.trim().split('\n').at(-1));
