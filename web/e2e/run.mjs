// End to end in a real browser: Playwright (playwright-core) driving Debian's chromium against a real
// `sortie serve` (every role, real sandboxes) with the scripted agent. Saves screenshots of the list and
// of a session page (SORTIE_E2E_SCREENSHOTS, default ../docs) and prints the budgets' figures.
//
//   node e2e/run.mjs            # needs target/debug/sortie and sortie-scripted-agent built, and root
//
// Env: SORTIE_BIN (default ../target/debug/sortie), CHROMIUM (default /usr/bin/chromium), SORTIE_E2E_KEEP=1
// keeps the scratch dir (repository, data dir) for a look afterwards.
import { spawn, execFileSync } from 'node:child_process';
import { mkdtempSync, mkdirSync, writeFileSync, readFileSync, chmodSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve, dirname } from 'node:path';
import { fileURLToPath } from 'node:url';
import { createInterface } from 'node:readline';
import assert from 'node:assert/strict';
import { chromium } from 'playwright-core';

const here = dirname(fileURLToPath(import.meta.url));
const repoRoot = resolve(here, '../..');
const bin = process.env.SORTIE_BIN ?? join(repoRoot, 'target/debug/sortie');
const shots = resolve(process.env.SORTIE_E2E_SCREENSHOTS ?? join(repoRoot, 'docs'));
const step = (what) => console.log(`e2e: ${what}`);
mkdirSync(shots, { recursive: true });

const root = mkdtempSync(join(tmpdir(), 'sortie-e2e-'));
chmodSync(root, 0o755);
const env = { ...process.env, HOME: root, GIT_CONFIG_NOSYSTEM: '1', SORTIE_LOG: 'warn' };
const git = (cwd, ...args) => execFileSync('git', args, { cwd, env, stdio: 'pipe' });
const upstream = join(root, 'upstream.git');
git(root, 'init', '-q', '--bare', '--initial-branch=main', upstream);
const seed = join(root, 'seed');
git(root, 'init', '-q', '--initial-branch=main', seed);
writeFileSync(join(seed, 'README.md'), 'hello\n');
git(seed, 'add', '.');
git(seed, '-c', 'user.name=e2e', '-c', 'user.email=e2e@localhost', 'commit', '-q', '-m', 'first');
git(seed, 'push', '-q', upstream, 'HEAD:refs/heads/main');

const server = spawn(bin, ['serve', '--listen', '127.0.0.1:0', '--data-dir', join(root, 'data')], {
  env, stdio: ['ignore', 'pipe', 'inherit'],
});
let browser;
const cleanup = async () => {
  await browser?.close().catch(() => {});
  if (server.exitCode === null) {
    const exited = new Promise((ok) => server.once('exit', ok));
    server.kill('SIGTERM');
    await Promise.race([exited, new Promise((ok) => setTimeout(ok, 15000))]);
  }
  if (!process.env.SORTIE_E2E_KEEP) rmSync(root, { recursive: true, force: true });
};
process.on('exit', () => server.kill('SIGKILL'));

const { url, link } = await new Promise((ok, fail) => {
  const found = {};
  const timer = setTimeout(() => fail(new Error(`sortie serve printed no sign-in link: ${JSON.stringify(found)}`)), 60000);
  createInterface({ input: server.stdout }).on('line', (line) => {
    const listening = /^sortie listening on (\S+)/.exec(line);
    if (listening) found.url = listening[1];
    const signin = /(http:\/\/\S+\/signin#\S+)/.exec(line);
    if (signin) found.link = signin[1];
    if (found.url && found.link) { clearTimeout(timer); ok(found); }
  });
  server.on('exit', (code) => fail(new Error(`sortie serve exited ${code}`)));
});
const token = readFileSync(join(root, 'data/admin-token'), 'utf8').trim();
const rest = async (method, path, body) => {
  const res = await fetch(url + path, {
    method, headers: { authorization: `Bearer ${token}`, ...(body ? { 'content-type': 'application/json' } : {}) },
    body: body ? JSON.stringify(body) : undefined,
  });
  return res.status === 204 ? null : res.json();
};
step(`serving ${url}`);

// The dashboard's API types are generated from web/openapi.json (src/openapi.ts); the binary under test
// serves exactly that document (crates/sortie-server/tests/openapi.rs keeps the copy current).
{
  const served = await (await fetch(`${url}/v1/openapi.json`)).json();
  const snapshot = JSON.parse(readFileSync(join(here, '../openapi.json'), 'utf8'));
  assert.deepEqual(served, snapshot, 'web/openapi.json is the served /v1/openapi.json');
  step('/v1/openapi.json is the snapshot the app\'s types are generated from');
}

try {
  browser = await chromium.launch({
    executablePath: process.env.CHROMIUM ?? '/usr/bin/chromium',
    args: ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
      '--disable-component-update', '--disable-sync'],
  });
  const context = await browser.newContext({ viewport: { width: 1280, height: 860 }, colorScheme: 'light' });
  const page = await context.newPage();
  const consoleErrors = [];
  page.on('pageerror', (e) => consoleErrors.push(String(e)));
  const scriptResponses = [];
  page.on('response', (r) => { if (r.request().resourceType() === 'script') scriptResponses.push(r); });

  // Sign in with the link: the cookie is set and the app lands on the list.
  await page.goto(link);
  await page.getByRole('heading', { name: 'Sessions' }).waitFor();
  const cookies = await context.cookies();
  const cookie = cookies.find((c) => c.name === 'sortie_session');
  assert.ok(cookie?.httpOnly && cookie.sameSite === 'Strict', JSON.stringify(cookies));
  step('signed in with the link');

  // The composer: a bad allowlist entry shows the API's message next to the field.
  await page.getByRole('link', { name: 'New session' }).first().click();
  await page.getByLabel('Repository').fill(upstream);
  await page.getByLabel('Agent').selectOption('scripted');
  const script = [
    '#!scripted', 'plan: Write the file | Say hello', 'think: The file comes first.', 'write: hello.txt', 'hello', '>>>',
    'done: 1', 'sleep: 1500', 'say: Wrote **hello.txt**.', 'done: 2',
  ].join('\n');
  await page.getByLabel('Title').fill('Add a greeting file');
  await page.getByLabel('Task').fill(script);
  await page.getByLabel('Egress allowlist').fill('github.com, bad_host!');
  await page.getByRole('button', { name: 'Start session' }).click();
  const allowError = page.locator('#allow-error');
  await allowError.waitFor();
  assert.match(await allowError.textContent(), /EGRESS_ALLOWLIST_INVALID/);
  step(`bad allowlist: ${await allowError.textContent()}`);
  await page.getByLabel('Egress allowlist').fill('');
  await page.getByRole('button', { name: 'Start session' }).click();
  await page.waitForURL(/\/sessions\/ses_/);
  const sessionUrl = page.url();
  const id = sessionUrl.split('/').pop();
  step(`created ${id}`);

  // Parts appear live, then the delivery card shows the branch.
  await page.locator('.plan').waitFor();
  await page.locator('details.tool').first().waitFor();
  await page.locator('.diff').waitFor();
  const delivery = page.locator('.delivery');
  await delivery.waitFor({ timeout: 60000 });
  assert.match(await delivery.textContent(), new RegExp(`sortie/${id}`));
  await page.locator('.badge.phase-idle').waitFor({ timeout: 30000 });
  assert.match(await page.getByLabel('diff stat').textContent(), /1 files \+1 −0/);
  step('first turn streamed and delivered');

  // Steer: the second turn streams.
  const steer = ['#!scripted', 'say: Second turn starts.', 'sleep: 4000', 'say: Second turn ends.'].join('\n');
  await page.getByLabel('Steer the agent').fill(steer);
  await page.getByRole('button', { name: 'Send' }).click();
  await page.getByText('Second turn starts.', { exact: true }).waitFor({ timeout: 30000 });
  step('steered; the second turn streams');

  // Reload mid-turn: the conversation resumes without duplicates.
  await page.reload();
  await page.getByText('Second turn ends.', { exact: true }).waitFor({ timeout: 30000 });
  assert.equal(await page.getByText('Second turn starts.', { exact: true }).count(), 1, 'the replayed turn is not duplicated');
  assert.equal(await page.locator('.msg.assistant').count(), 2);
  assert.equal(await page.locator('.plan').count(), 1);
  await page.locator('.badge.phase-idle').waitFor({ timeout: 30000 });
  step('reloaded mid-turn; resumed without duplicates');
  await page.screenshot({ path: join(shots, 'dashboard-session.png'), fullPage: false });

  // Queue a steer while a turn runs: it streams live once it starts, after the running one.
  await page.getByLabel('Steer the agent').fill(['#!scripted', 'say: Third turn starts.', 'sleep: 3000', 'say: Third turn ends.'].join('\n'));
  await page.getByRole('button', { name: 'Send' }).click();
  await page.getByText('Third turn starts.', { exact: true }).waitFor({ timeout: 30000 });
  await page.getByLabel('Steer the agent').fill(['#!scripted', 'say: Queued turn streams.', 'sleep: 2000', 'say: Queued turn goes on.', 'sleep: 3000', 'say: Queued turn ends.'].join('\n'));
  await page.getByRole('button', { name: 'Send' }).click();
  // Live, its middle shows before its end (a history reloaded on phase changes shows both at once).
  await page.getByText('Queued turn goes on.', { exact: true }).waitFor({ timeout: 30000 });
  assert.equal(await page.getByText('Queued turn ends.', { exact: true }).count(), 0, 'the queued turn streams while it runs');
  await page.getByText('Queued turn ends.', { exact: true }).waitFor({ timeout: 30000 });
  assert.equal(await page.getByText('Third turn ends.', { exact: true }).count(), 1);
  assert.equal(await page.getByText('Queued turn streams.', { exact: true }).count(), 1, 'the queued turn is not duplicated');
  await page.locator('.badge.phase-idle').waitFor({ timeout: 30000 });
  step('a steer queued mid-turn streams after it');

  // The list, with the session in it beside a failed and a running one.
  const failing = await rest('POST', '/v1/sessions', { repo: upstream, agent: 'scripted', title: 'Fix the flaky parser test', task: '#!scripted\nsay: looking\nfail: the parser test still fails' });
  await rest('POST', '/v1/sessions', { repo: upstream, agent: 'scripted', title: 'Bump the dependencies', task: '#!scripted\nplan: Bump | Test\nsleep: 120000' });
  await page.waitForTimeout(4000);
  await page.getByRole('link', { name: 'Sessions' }).click();
  await page.locator('table.sessions').waitFor();
  assert.equal(await page.locator(`a[href="/sessions/${id}"]`).count(), 1);
  await page.screenshot({ path: join(shots, 'dashboard-sessions.png') });

  // A failed session: its failure shows, and Retry runs the last prompt again as a new turn.
  await page.goto(`${url}/sessions/${failing.id}`);
  await page.locator('.badge.phase-failed').waitFor({ timeout: 30000 });
  await page.getByRole('button', { name: 'Retry' }).click();
  await page.waitForFunction(() => document.querySelectorAll('.msg.assistant').length === 2, null, { timeout: 30000 });
  await page.locator('.badge.phase-failed').waitFor({ timeout: 30000 });
  assert.equal((await rest('GET', `/v1/sessions/${failing.id}`)).turns, 2);
  step('a failed session retried');
  await page.goto(sessionUrl);

  // Stop a running turn, then archive.
  await page.getByLabel('Steer the agent').fill(['#!scripted', 'say: Long work.', 'sleep: 60000', 'say: never'].join('\n'));
  await page.getByRole('button', { name: 'Send' }).click();
  await page.getByText('Long work.', { exact: true }).waitFor({ timeout: 30000 });
  // Interrupt: the running turn stops and the new prompt runs at once.
  await page.getByLabel('Interrupt').check();
  await page.getByLabel('Steer the agent').fill(['#!scripted', 'say: Redirected.', 'sleep: 60000'].join('\n'));
  await page.getByRole('button', { name: 'Send' }).click();
  await page.getByText('Redirected.', { exact: true }).waitFor({ timeout: 30000 });
  assert.equal(await page.getByText('Redirected.', { exact: true }).count(), 1);
  step('interrupted with a new prompt');
  await page.getByRole('button', { name: 'Stop' }).click();
  await page.locator('.badge.phase-idle').waitFor({ timeout: 30000 });
  step('stopped');
  await page.getByRole('button', { name: 'Archive' }).click();
  await page.getByRole('button', { name: 'Archived' }).waitFor();
  const archived = await rest('GET', `/v1/sessions/${id}`);
  assert.equal(archived.archived, true);
  step('archived');

  // First render of a 2,000-part session.
  const lines = ['#!scripted'];
  for (let i = 0; i < 1000; i++) lines.push(`think: step ${i}`, `say: Part ${i} with \`code\` and **bold**.`);
  const big = await rest('POST', '/v1/sessions', { repo: upstream, agent: 'scripted', task: lines.join('\n'), title: '2,000 parts' });
  for (let i = 0; i < 120; i++) {
    const s = await rest('GET', `/v1/sessions/${big.id}`);
    if (s.phase === 'idle' || s.phase === 'failed') break;
    await new Promise((r) => setTimeout(r, 500));
  }
  const messages = await rest('GET', `/v1/sessions/${big.id}/messages`);
  const parts = messages.filter((m) => m.role === 'assistant').reduce((n, m) => n + m.parts.length, 0);
  await page.goto(`${url}/sessions/${big.id}`);
  await page.waitForFunction(() => document.querySelectorAll('.msg.assistant .md, .msg.assistant details').length >= 2000, null, { timeout: 30000 });
  const firstRender = await page.evaluate(() => performance.now());
  step(`first render of a ${parts}-part session: ${firstRender.toFixed(0)} ms after navigation start`);
  assert.ok(parts >= 2000, `the big session has ${parts} parts`);
  assert.ok(firstRender < 1000, 'the budget is 1 s');

  // A 401 sends the app to sign-in.
  await context.clearCookies();
  await page.goto(url + '/');
  await page.waitForURL(/\/signin$/);
  await page.getByRole('heading', { name: 'Sign in to sortie' }).waitFor();
  step('a 401 sends the app to sign-in');
  // The link worked once.
  await page.goto(link);
  await page.getByRole('alert').waitFor();
  assert.match(await page.getByRole('alert').textContent(), /UNAUTHORIZED/);
  step('the used link is refused');

  assert.deepEqual(consoleErrors, []);
  // The JS the browser received over the wire (sortie serves the build's gzip twins).
  let gz = 0;
  const seen = new Set();
  for (const r of scriptResponses) {
    if (seen.has(r.url())) continue;
    seen.add(r.url());
    assert.equal(r.headers()['content-encoding'], 'gzip', r.url());
    gz += (await r.request().sizes()).responseBodySize;
  }
  assert.ok(seen.size > 0, 'the page loaded scripts');
  step(`JS shipped, gzipped: ${(gz / 1024).toFixed(1)} KB (${seen.size} file(s))`);
  assert.ok(gz < 300 * 1024, 'the JS budget is 300 KB gzipped');
  console.log('e2e: ok');
} catch (error) {
  console.error(error);
  process.exitCode = 1;
} finally {
  await cleanup();
}
