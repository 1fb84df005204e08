// Keeps lib/chunk-keys.mjs in step with the installed `ai` schema, so a
// version bump that adds/removes a chunk type or key fails here first.
import assert from 'node:assert/strict';
import { readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { test } from 'node:test';
import { uiMessageChunkSchema } from 'ai';
import { CHUNK_KEYS, DATA_CHUNK_KEYS, checkChunkKeys } from '../lib/chunk-keys.mjs';
import { KIT } from './_support.mjs';

const sorted = (xs) => [...xs].sort();
const table = { ...CHUNK_KEYS, 'data-*': DATA_CHUNK_KEYS };

test('chunk types and required keys match the runtime uiMessageChunkSchema', async () => {
  // Validating {} makes every union branch report its `type` and its missing required keys.
  const r = await uiMessageChunkSchema().validate({});
  assert.equal(r.success, false);
  const union = r.error.issues[0];
  assert.equal(union.code, 'invalid_union');
  const fromSchema = {};
  for (const branch of union.errors) {
    const t = branch.find((i) => i.path[0] === 'type');
    const type = t.code === 'invalid_value' ? t.values[0] : 'data-*';
    fromSchema[type] = sorted(branch.filter((i) => i.path[0] !== 'type').map((i) => i.path[0]));
  }
  assert.deepEqual(sorted(Object.keys(table)), sorted(Object.keys(fromSchema)), 'chunk types');
  for (const [type, spec] of Object.entries(table)) {
    assert.deepEqual(sorted(spec.req), fromSchema[type], `required keys of ${type}`);
  }
});

test('optional keys match the schema source of the installed ai package', async () => {
  const src = await readFile(join(KIT, 'node_modules/ai/src/ui-message-stream/ui-message-chunks.ts'), 'utf8');
  const start = src.indexOf('export const uiMessageChunkSchema');
  const end = src.indexOf('export type', start);
  assert.ok(start >= 0 && end > start, 'uiMessageChunkSchema not found in ai source; update this test');
  const block = src.slice(start, end);
  const fromSource = {};
  for (const [, body] of block.matchAll(/^ {6}z\.looseObject\(\{\n([\s\S]*?)^ {6}\}\),?$/gm)) {
    const lit = body.match(/^ {8}type: z\.literal\('([^']+)'\)/m);
    const type = lit ? lit[1] : /^ {8}type: z\.custom/m.test(body) ? 'data-*' : undefined;
    assert.ok(type, `cannot read the type of a schema branch:\n${body}`);
    const req = [];
    const opt = [];
    for (const [, key, value] of body.matchAll(/^ {8}(\w+): ([^\n]*)$/gm)) {
      if (key === 'type') continue;
      (value.startsWith('z.optional(') ? opt : req).push(key);
    }
    fromSource[type] = { req: sorted(req), opt: sorted(opt) };
  }
  assert.deepEqual(sorted(Object.keys(fromSource)), sorted(Object.keys(table)), 'chunk types (source)');
  for (const [type, spec] of Object.entries(table)) {
    assert.deepEqual({ req: sorted(spec.req), opt: sorted(spec.opt) }, fromSource[type], `keys of ${type}`);
  }
});

test('checkChunkKeys', () => {
  assert.deepEqual(checkChunkKeys({ type: 'start', messageId: 'm' }), []);
  assert.deepEqual(checkChunkKeys({ type: 'data-x', id: 'a', data: null, transient: true }), []);
  assert.deepEqual(checkChunkKeys({ type: 'tool-input-available', toolCallId: 'c', toolName: 't', input: null }), []);
  assert.match(checkChunkKeys({ type: 'text-delta', id: 't', delta: 'x', at: 'now' })[0], /key "at" is not defined/);
  assert.match(checkChunkKeys({ type: 'data-x', data: 1, at: 'now' })[0], /key "at" is not defined/);
  assert.match(checkChunkKeys({ type: 'tool-input-start', toolCallId: 'c', toolName: 't', title: null })[0], /"title" is null/);
  assert.match(checkChunkKeys({ type: 'data-x' })[0], /missing required key "data"/);
  assert.match(checkChunkKeys({ type: 'text-start', id: null })[0], /required key "id" is null/);
  assert.match(checkChunkKeys({ type: 'agent-thought' })[0], /unknown chunk type/);
});
