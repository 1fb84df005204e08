// Shared helpers for validate.mjs and chat-resume.mjs: header parsing and a
// fetch that can go over a Unix socket (undici Agent with connect.socketPath).
import { readFileSync } from 'node:fs';
import { Agent, fetch as undiciFetch } from 'undici';

export class UsageError extends Error {}

/** Parses one "Name: value" line into [name, value]. */
export function parseHeaderLine(line) {
  const i = line.indexOf(':');
  if (i <= 0) throw new UsageError(`bad header ${JSON.stringify(line)}: expected "Name: value"`);
  const name = line.slice(0, i).trim();
  const value = line.slice(i + 1).trim();
  if (!/^[!#$%&'*+.^_`|~0-9A-Za-z-]+$/.test(name)) {
    throw new UsageError(`bad header name ${JSON.stringify(name)}`);
  }
  return [name, value];
}

/**
 * Builds the request headers: every --header, then (re-read now) every
 * non-empty, non-# line of --header-file. Later entries win.
 */
export function collectHeaders({ header = [], headerFile } = {}) {
  const out = {};
  for (const h of header) {
    const [k, v] = parseHeaderLine(h);
    out[k.toLowerCase()] = v;
  }
  if (headerFile) {
    let text;
    try {
      text = readFileSync(headerFile, 'utf8');
    } catch (e) {
      throw new UsageError(`cannot read --header-file ${headerFile}: ${e.message}`);
    }
    for (const raw of text.split(/\r?\n/)) {
      const line = raw.trim();
      if (line === '' || line.startsWith('#')) continue;
      const [k, v] = parseHeaderLine(line);
      out[k.toLowerCase()] = v;
    }
  }
  return out;
}

/** A fetch(url, init) that goes over `socketPath` when given (URL host is then irrelevant). */
export function makeFetch({ socketPath } = {}) {
  const dispatcher = socketPath ? new Agent({ connect: { socketPath } }) : undefined;
  const f = (url, init = {}) =>
    undiciFetch(url, dispatcher ? { ...init, dispatcher } : init);
  f.close = () => dispatcher?.close();
  return f;
}

export function die(code, msg) {
  if (msg) process.stderr.write(msg.endsWith('\n') ? msg : msg + '\n');
  process.exit(code);
}
