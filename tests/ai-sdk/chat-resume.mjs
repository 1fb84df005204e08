#!/usr/bin/env node
// Drives a running turn through `Chat` (@ai-sdk/react, the useChat state
// machine, no React rendering) via `chat.resumeStream()`, N times in a row
// into the same Chat instance, like a browser that reconnects.
//
//   node chat-resume.mjs --url STREAM_URL [--socket PATH]
//        [--header "Name: value"]... [--header-file FILE] [--chat-id ID]
//        [--resumes N] [--cut-after K] [--no-replay] [--timeout MS]
//
// --header-file is re-read before every request (one "Name: value" per line),
//   so a caller can rotate single-use tickets between resumes.
// --cut-after K: every resume but the last is cut after K blank-line-terminated
//   SSE blocks with a network TypeError, as if the connection dropped
//   (Chat keeps the partial message; the next resume must replace it).
// --no-replay: resumeStreamIsReplay=false (only to show what goes wrong).
//
// Prints {status, error, messages} as one JSON line on stdout. Exit 0 only if
// status is "ready", there is no error and exactly one assistant message;
// 1 otherwise; 64 bad command line.
import { parseArgs } from 'node:util';
import { Chat } from '@ai-sdk/react';
import { DefaultChatTransport } from 'ai';
import { UsageError, collectHeaders, die, makeFetch } from './lib/common.mjs';

const USAGE =
  'usage: node chat-resume.mjs --url STREAM_URL [--socket PATH] [--header "Name: value"]... ' +
  '[--header-file FILE] [--chat-id ID] [--resumes N] [--cut-after K] [--no-replay] [--timeout MS]';

function parseCli(argv) {
  let values;
  try {
    ({ values } = parseArgs({
      args: argv,
      options: {
        url: { type: 'string' },
        socket: { type: 'string' },
        header: { type: 'string', multiple: true, default: [] },
        'header-file': { type: 'string' },
        'chat-id': { type: 'string', default: 'sortie-conformance' },
        resumes: { type: 'string', default: '1' },
        'cut-after': { type: 'string' },
        'no-replay': { type: 'boolean', default: false },
        timeout: { type: 'string', default: '120000' },
        help: { type: 'boolean', short: 'h', default: false },
      },
      strict: true,
      allowPositionals: false,
    }));
  } catch (e) {
    throw new UsageError(e.message);
  }
  if (values.help) die(0, USAGE);
  if (!values.url) throw new UsageError('--url is required');
  const int = (name, v, min) => {
    const n = Number(v);
    if (!Number.isInteger(n) || n < min) throw new UsageError(`--${name} must be an integer >= ${min}`);
    return n;
  };
  return {
    ...values,
    resumes: int('resumes', values.resumes, 1),
    cutAfter: values['cut-after'] === undefined ? undefined : int('cut-after', values['cut-after'], 1),
    timeout: int('timeout', values.timeout, 1),
  };
}

/** Passes the body through until `blocks` SSE blocks ended, then fails like a dropped connection. */
function cutAfterBlocks(res, blocks) {
  const reader = res.body.getReader();
  const dec = new TextDecoder();
  const enc = new TextEncoder();
  let seen = 0;
  let lastNonCr = '';
  let cut = false;
  const body = new ReadableStream({
    async pull(controller) {
      if (cut) {
        // Error on the pull after the last delivered bytes, so they are consumed first.
        controller.error(new TypeError(`network error: simulated disconnect after ${blocks} SSE blocks`));
        return;
      }
      const { done, value } = await reader.read();
      if (done) {
        controller.close();
        return;
      }
      const text = dec.decode(value, { stream: true });
      for (let i = 0; i < text.length; i++) {
        const ch = text[i];
        if (ch === '\r') continue;
        if (ch === '\n' && lastNonCr === '\n' && ++seen === blocks) {
          controller.enqueue(enc.encode(text.slice(0, i + 1)));
          cut = true;
          reader.cancel().catch(() => {});
          return;
        }
        // A blank line ends a block; reset so "\n\n\n" counts once.
        lastNonCr = ch === '\n' && lastNonCr === '\n' ? '' : ch;
      }
      controller.enqueue(value);
    },
    cancel(reason) {
      return reader.cancel(reason);
    },
  });
  return new Response(body, { status: res.status, statusText: res.statusText, headers: res.headers });
}

/**
 * Parts that a full replay would duplicate if it were appended to the partial
 * message: two tool parts with one toolCallId, two data parts with one
 * type+id, two reasoning parts with one id, or two adjacent step-start parts.
 */
export function duplicateParts(message) {
  const seen = new Set();
  const dups = [];
  message.parts.forEach((p, i) => {
    if (p.type === 'step-start') {
      if (message.parts[i - 1]?.type === 'step-start') dups.push(`parts[${i}] step-start (adjacent)`);
      return;
    }
    let key;
    if (p.type === 'dynamic-tool' || p.type.startsWith('tool-')) key = `tool ${p.toolCallId}`;
    else if (p.type.startsWith('data-') && p.id !== undefined) key = `${p.type} ${p.id}`;
    else if (p.type === 'reasoning' && p.id !== undefined) key = `reasoning ${p.id}`;
    if (key === undefined) return;
    if (seen.has(key)) dups.push(`parts[${i}] ${key}`);
    seen.add(key);
  });
  return dups;
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
  setTimeout(() => die(1, `FAIL: timed out after ${opts.timeout} ms`), opts.timeout).unref();

  const baseFetch = makeFetch({ socketPath: opts.socket });
  let attempt = 0; // 1-based index of the current resume
  const responses = []; // HTTP status per request, for the report
  const fetch = async (url, init) => {
    let res;
    try {
      res = await baseFetch(url, init);
    } catch (e) {
      if (e?.name === 'AbortError') throw e;
      // Keep it a TypeError mentioning "fetch" (Chat's disconnect detection), but say why.
      throw new TypeError(`fetch failed: ${e?.cause?.message ?? e?.message}`, { cause: e });
    }
    responses.push(res.status);
    if (opts.cutAfter !== undefined && attempt < opts.resumes && res.status === 200 && res.body) {
      return cutAfterBlocks(res, opts.cutAfter);
    }
    return res;
  };

  const transport = new DefaultChatTransport({
    api: opts.url,
    // Our server replays the whole turn from `start` on every reconnect. In
    // ai 7.0.173 this defaults to true already; set it so a pin bump or a
    // default change cannot silently turn replays into duplicated parts.
    resumeStreamIsReplay: !opts['no-replay'],
    // Re-read the headers (e.g. a rotating single-use ticket) before every request.
    prepareReconnectToStreamRequest: () => ({
      api: opts.url,
      headers: collectHeaders({ header: opts.header, headerFile: opts['header-file'] }),
    }),
    fetch,
  });

  const errors = [];
  const chat = new Chat({
    id: opts['chat-id'],
    transport,
    onError: (e) => errors.push(`resume ${attempt}: ${e?.name ?? 'Error'}: ${e?.message ?? String(e)}`),
  });

  const assistants = () => chat.messages.filter((m) => m.role === 'assistant');
  for (attempt = 1; attempt <= opts.resumes; attempt++) {
    await chat.resumeStream();
    const a = assistants();
    process.stderr.write(
      `resume ${attempt}/${opts.resumes}: HTTP ${responses.at(-1) ?? '-'}, status=${chat.status}` +
        `${chat.error ? ` error=${JSON.stringify(chat.error.message)}` : ''}, assistant messages=${a.length}` +
        `${a.length ? `, parts=${a.map((m) => m.parts.length).join('+')}` : ''}\n`,
    );
    const expectedCut = opts.cutAfter !== undefined && attempt < opts.resumes;
    if (chat.status === 'error' && !expectedCut) break;
  }

  const result = {
    status: chat.status,
    error: chat.error ? `${chat.error.name ?? 'Error'}: ${chat.error.message}` : null,
    messages: chat.messages,
  };
  await new Promise((r) => process.stdout.write(`${JSON.stringify(result)}\n`, r));

  const n = assistants().length;
  const why = [];
  for (const m of assistants()) {
    const dups = duplicateParts(m);
    if (dups.length) why.push(`message ${m.id} has duplicated parts (a replay was appended, not replaced): ${dups.join(', ')}`);
  }
  if (result.status !== 'ready') why.push(`status is "${result.status}", expected "ready"`);
  if (result.error) why.push(`error: ${result.error}`);
  if (n !== 1) {
    why.push(
      `${n} assistant messages, expected exactly 1` +
        (n === 0 && responses.includes(204) ? ' (server answered 204: no active stream)' : ''),
    );
  }
  if (why.length) {
    die(1, `FAIL: ${why.join('; ')}${errors.length ? `\n  onError: ${errors.join('\n  onError: ')}` : ''}`);
  }
  process.exit(0);
}

await main();
