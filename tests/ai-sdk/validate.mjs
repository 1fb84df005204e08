#!/usr/bin/env node
// Validates one AI SDK "UI message stream" (SSE) with the real `ai` package.
//
//   node validate.mjs (--url URL | --file FILE.sse) [--socket PATH]
//        [--header "Name: value"]... [--header-file FILE] [--method GET|POST]
//        [--body JSON] [--timeout MS] [--print]
//
// Exit codes: 0 valid; 1 invalid (every problem is listed on stderr, naming the
// event number and the raw chunk) or the request failed; 2 valid but the
// stream carried an `error` chunk; 3 HTTP 204 ("no active stream");
// 64 bad command line. With --print, the final UIMessage is printed as one
// JSON line on stdout (exit 0 and 2).
import { readFile } from 'node:fs/promises';
import { parseArgs } from 'node:util';
import { parseJsonEventStream, readUIMessageStream, uiMessageChunkSchema } from 'ai';
import { checkChunkKeys } from './lib/chunk-keys.mjs';
import { UsageError, collectHeaders, die, makeFetch } from './lib/common.mjs';

const USAGE =
  'usage: node validate.mjs (--url URL | --file FILE.sse) [--socket PATH] ' +
  '[--header "Name: value"]... [--header-file FILE] [--method GET|POST] [--body JSON] ' +
  '[--timeout MS] [--print]';

const TERMINAL_TYPES = new Set(['finish', 'abort', 'error']);
const RAW_MAX = 400;

function parseCli(argv) {
  let values;
  try {
    ({ values } = parseArgs({
      args: argv,
      options: {
        url: { type: 'string' },
        file: { type: 'string' },
        socket: { type: 'string' },
        header: { type: 'string', multiple: true, default: [] },
        'header-file': { type: 'string' },
        method: { type: 'string' },
        body: { type: 'string' },
        timeout: { type: 'string', default: '120000' },
        print: { type: 'boolean', default: false },
        help: { type: 'boolean', short: 'h', default: false },
      },
      strict: true,
      allowPositionals: false,
    }));
  } catch (e) {
    throw new UsageError(e.message);
  }
  if (values.help) die(0, USAGE);
  if (!!values.url === !!values.file) throw new UsageError('give exactly one of --url or --file');
  if (values.file && (values.socket || values.method || values.body || values.header.length || values['header-file'])) {
    throw new UsageError('--socket/--header/--header-file/--method/--body only apply to --url');
  }
  const method = (values.method ?? (values.body !== undefined ? 'POST' : 'GET')).toUpperCase();
  if (method !== 'GET' && method !== 'POST') throw new UsageError('--method must be GET or POST');
  if (values.body !== undefined) {
    try {
      JSON.parse(values.body);
    } catch (e) {
      throw new UsageError(`--body is not valid JSON: ${e.message}`);
    }
  }
  const timeout = Number(values.timeout);
  if (!Number.isFinite(timeout) || timeout <= 0) throw new UsageError('--timeout must be a positive number of ms');
  return { ...values, method, timeout };
}

/**
 * A small SSE splitter (WHATWG rules) used for our own framing checks and
 * for naming events: returns the data string of each dispatched event and
 * whether the body ended in the middle of an event.
 */
export function splitSse(text) {
  const lines = text.split(/\r\n|\r|\n/);
  // The last element is what follows the final line terminator ('' if the text ends with one).
  const trailing = lines.pop();
  const events = [];
  let data = null;
  for (const line of lines) {
    if (line === '') {
      if (data !== null) events.push(data);
      data = null;
      continue;
    }
    if (line.startsWith(':')) continue;
    const i = line.indexOf(':');
    const field = i === -1 ? line : line.slice(0, i);
    let value = i === -1 ? '' : line.slice(i + 1);
    if (value.startsWith(' ')) value = value.slice(1);
    if (field === 'data') data = data === null ? value : `${data}\n${value}`;
  }
  const incomplete = data !== null || trailing !== '' ? (data ?? trailing) : null;
  return { events, incomplete };
}

function clip(s) {
  return s.length > RAW_MAX ? `${s.slice(0, RAW_MAX)}…(${s.length} chars)` : s;
}

function formatIssue(issue) {
  if (issue.code === 'invalid_union' && Array.isArray(issue.errors)) {
    // One branch per chunk type: keep the branch(es) whose `type` matched.
    const branches = issue.errors.filter((b) => !b.some((i) => i.path?.[0] === 'type'));
    if (branches.length === 0) return 'unknown chunk type (no schema in the union accepts its "type")';
    return branches.map((b) => b.map(formatIssue).join(', ')).join(' | ');
  }
  const where = issue.path?.length ? `${issue.path.join('.')}: ` : '';
  return where + issue.message;
}

function describeParseError(err) {
  const issues = err?.cause?.issues ?? err?.issues;
  if (Array.isArray(issues)) return `${err.name ?? 'TypeValidationError'}: ${issues.map(formatIssue).join('; ')}`;
  return `${err?.name ?? 'Error'}: ${err?.message ?? String(err)}`;
}

/** Runs readUIMessageStream over `chunks`; returns the last snapshot and every onError/throw. */
async function readMessage(chunks) {
  const errors = [];
  const onError = (e) => errors.push(`${e?.name ?? 'Error'}: ${e?.message ?? String(e)}`);
  let message;
  try {
    for await (const m of readUIMessageStream({ stream: streamOf(chunks), onError })) message = m;
  } catch (e) {
    onError(e);
  }
  return { message, errors };
}

function streamOf(items) {
  return new ReadableStream({
    start(controller) {
      for (const x of items) controller.enqueue(x);
      controller.close();
    },
  });
}

async function getBody(opts, problems) {
  if (opts.file) {
    try {
      return await readFile(opts.file);
    } catch (e) {
      die(1, `FAIL: cannot read ${opts.file}: ${e.message}`);
    }
  }
  const headers = collectHeaders({ header: opts.header, headerFile: opts['header-file'] });
  if (opts.body !== undefined && !Object.hasOwn(headers, 'content-type')) {
    headers['content-type'] = 'application/json';
  }
  const fetch = makeFetch({ socketPath: opts.socket });
  const signal = AbortSignal.timeout(opts.timeout);
  let res;
  try {
    res = await fetch(opts.url, { method: opts.method, headers, body: opts.body, signal });
  } catch (e) {
    die(1, `FAIL: request to ${opts.url}${opts.socket ? ` via ${opts.socket}` : ''} failed: ${e.cause?.message ?? e.message}`);
  }
  if (res.status === 204) {
    await res.body?.cancel().catch(() => {});
    die(3, 'no active stream (HTTP 204)');
  }
  if (res.status !== 200) {
    const text = await res.text().catch(() => '');
    die(1, `FAIL: HTTP status ${res.status} (expected 200)${text ? `; body: ${clip(text)}` : ''}`);
  }
  const ct = res.headers.get('content-type');
  if ((ct ?? '').split(';')[0].trim().toLowerCase() !== 'text/event-stream') {
    problems.push(`content-type is ${JSON.stringify(ct)}, expected text/event-stream`);
  }
  const marker = res.headers.get('x-vercel-ai-ui-message-stream');
  if (marker !== 'v1') {
    problems.push(
      marker === null
        ? 'missing header x-vercel-ai-ui-message-stream: v1'
        : `header x-vercel-ai-ui-message-stream is ${JSON.stringify(marker)}, expected "v1"`,
    );
  }
  try {
    return Buffer.from(await res.arrayBuffer());
  } catch (e) {
    die(1, `FAIL: reading the response body failed: ${e.name === 'TimeoutError' ? `timed out after ${opts.timeout} ms` : e.message}`);
  } finally {
    fetch.close();
  }
}

async function main() {
  let opts;
  try {
    opts = parseCli(process.argv.slice(2));
    collectHeaders({ header: opts.header, headerFile: opts['header-file'] }); // fail early on bad headers
  } catch (e) {
    if (e instanceof UsageError) die(64, `${e.message}\n${USAGE}`);
    throw e;
  }

  const problems = [];
  const warnings = [];
  const bytes = await getBody(opts, problems);
  const text = new TextDecoder().decode(bytes);

  // 1. Framing: the last event must be `data: [DONE]`, terminated by a blank line.
  const { events, incomplete } = splitSse(text);
  const doneAt = events.flatMap((d, i) => (d === '[DONE]' ? [i] : []));
  if (incomplete !== null) {
    problems.push(`stream ends in the middle of an event (no blank line after it): ${clip(JSON.stringify(incomplete))}`);
  }
  if (doneAt.length === 0) {
    problems.push('missing final "data: [DONE]"');
  } else {
    if (doneAt.length > 1) problems.push(`"data: [DONE]" appears ${doneAt.length} times (events #${doneAt.map((i) => i + 1).join(', #')})`);
    if (doneAt[0] !== events.length - 1) {
      problems.push(`event #${doneAt[0] + 1} is "data: [DONE]" but ${events.length - 1 - doneAt[0]} event(s) follow it`);
    }
  }

  // Event numbers (1-based, over all `data:` events incl. [DONE]) of the JSON chunks.
  const jsonEventIdx = events.flatMap((d, i) => (d === '[DONE]' ? [] : [i]));

  // 2. Schema: the SDK's own parser and chunk schema.
  const results = [];
  for await (const r of parseJsonEventStream({ stream: streamOf([bytes]), schema: uiMessageChunkSchema })) {
    results.push(r);
  }
  const aligned = results.length === jsonEventIdx.length;
  if (!aligned) {
    warnings.push(`our SSE splitter saw ${jsonEventIdx.length} JSON events, the SDK parser ${results.length}; numbering chunks by the SDK parser`);
  }
  const label = (k) => (aligned ? `event #${jsonEventIdx[k] + 1}` : `chunk #${k + 1}`);
  const raw = (k) => clip(aligned ? events[jsonEventIdx[k]] : JSON.stringify(results[k].rawValue));

  const chunks = [];
  results.forEach((r, k) => {
    if (!r.success) {
      problems.push(`${label(k)} rejected by uiMessageChunkSchema: ${describeParseError(r.error)}\n    raw: ${raw(k)}`);
      return;
    }
    // 3. Our stricter table: only keys the v7 schema defines, no null optionals.
    const keyProblems = checkChunkKeys(r.rawValue);
    if (keyProblems.length) problems.push(`${label(k)}: ${keyProblems.join('; ')}\n    raw: ${raw(k)}`);
    chunks.push({ k, chunk: r.value });
  });

  // 4. Shape of the whole stream.
  if (results.length === 0) {
    problems.push('stream carries no chunks');
  } else {
    const first = results[0].rawValue;
    if (first?.type !== 'start') problems.push(`first chunk is not "start" (${label(0)}): ${raw(0)}`);
    else if (first.messageId === undefined) warnings.push('"start" has no messageId (resumed streams need a stable one)');
    const lastK = results.length - 1;
    const last = results[lastK].rawValue;
    if (!TERMINAL_TYPES.has(last?.type)) {
      problems.push(`last chunk is not "finish", "abort" or "error" (${label(lastK)}): ${raw(lastK)}`);
    }
  }

  // 5. Client processing rules: what useChat would build from the valid chunks.
  const errorChunks = chunks.filter(({ chunk }) => chunk.type === 'error');
  const fed = chunks.filter(({ chunk }) => chunk.type !== 'error');
  const { message: finalMessage, errors: readErrors } = await readMessage(fed.map(({ chunk }) => chunk));
  if (readErrors.length) {
    // Find the chunk that triggers the first error: the shortest failing prefix.
    let lo = 1;
    let hi = fed.length;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if ((await readMessage(fed.slice(0, mid).map(({ chunk }) => chunk))).errors.length) hi = mid;
      else lo = mid + 1;
    }
    const k = fed[lo - 1]?.k;
    const at = k === undefined ? '' : `${label(k)}: `;
    problems.push(`${at}readUIMessageStream: ${readErrors[0]}${k === undefined ? '' : `\n    raw: ${raw(k)}`}`);
    for (const e of readErrors.slice(1)) problems.push(`readUIMessageStream: ${e}`);
  }
  const lastType = results.at(-1)?.rawValue?.type;
  if (finalMessage) {
    const open = finalMessage.parts
      .map((p, i) => ({ p, i }))
      .filter(({ p }) => p.state === 'streaming' || p.state === 'input-streaming')
      .map(({ p, i }) => `parts[${i}] (${p.type}${p.toolCallId ? ` ${p.toolCallId}` : p.id ? ` ${p.id}` : ''}) is still "${p.state}"`);
    if (open.length) {
      // A stream cut short by abort/error may legitimately leave parts open.
      if (lastType === 'finish' || !TERMINAL_TYPES.has(lastType)) problems.push(...open);
      else warnings.push(...open.map((s) => `${s} (stream ended with "${lastType}")`));
    }
  } else if (problems.length === 0) {
    problems.push('readUIMessageStream produced no message');
  }

  for (const w of warnings) process.stderr.write(`warning: ${w}\n`);
  if (problems.length) {
    const src = opts.file ?? opts.url;
    die(1, `FAIL: ${src}: ${problems.length} problem(s)\n${problems.map((p) => `  - ${p}`).join('\n')}`);
  }
  if (opts.print) await new Promise((r) => process.stdout.write(`${JSON.stringify(finalMessage)}\n`, r));
  if (errorChunks.length) {
    const list = errorChunks.map(({ k, chunk }) => `${label(k)}: ${JSON.stringify(chunk.errorText)}`).join('; ');
    die(2, `stream carried ${errorChunks.length} error chunk(s): ${list}`);
  }
  process.stderr.write(`OK: ${results.length} chunks, ${finalMessage.parts.length} parts, message ${finalMessage.id}\n`);
  process.exit(0);
}

await main();
