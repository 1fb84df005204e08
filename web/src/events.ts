// The control plane's change feed (`GET /v1/events`): one connection per tab, shared by every view that
// subscribes, resumed with Last-Event-ID after a drop. Views refresh what an event names instead of
// polling. A listener called with `null` may have missed events (first connect, or the server no longer
// keeps the ones after our last) and should read afresh.
import { createParser } from 'eventsource-parser';
import type { components } from './openapi';
import { headers } from './api';

export type ControlEvent = components['schemas']['Event'];
type Listener = (event: ControlEvent | null) => void;

const listeners = new Set<Listener>();
let running = false;
let lastId: string | null = null;
let abort: AbortController | null = null;

/** Calls `listener` with every change of the workspace until the returned function is called. */
export function subscribeEvents(listener: Listener): () => void {
  listeners.add(listener);
  if (!running) void run();
  return () => {
    listeners.delete(listener);
    if (listeners.size === 0) abort?.abort();
  };
}

function emit(event: ControlEvent | null) {
  for (const listener of [...listeners]) listener(event);
}

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

async function run() {
  running = true;
  let backoff = 500;
  while (listeners.size > 0) {
    abort = new AbortController();
    try {
      const res = await fetch('/v1/events', {
        headers: headers(lastId === null ? {} : { 'Last-Event-ID': lastId }),
        credentials: 'same-origin',
        signal: abort.signal,
      });
      if (res.status === 410) {
        // The server forgot what we missed: start from now and have everyone read afresh.
        lastId = null;
        continue;
      }
      if (!res.ok || !res.body) throw new Error(`events: HTTP ${res.status}`);
      if (lastId === null) emit(null);
      backoff = 500;
      const parser = createParser({
        onEvent(message) {
          if (message.id) lastId = message.id;
          try { emit(JSON.parse(message.data) as ControlEvent); } catch { /* not an event of ours */ }
        },
      });
      const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
      for (;;) {
        const { done, value } = await reader.read();
        if (done) break;
        parser.feed(value);
      }
    } catch { /* dropped, refused or aborted: try again below while anyone listens */ }
    if (listeners.size === 0) break;
    await sleep(backoff);
    backoff = Math.min(backoff * 2, 10_000);
  }
  running = false;
}
