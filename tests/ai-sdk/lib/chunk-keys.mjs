// Top-level keys each UI message chunk type defines in the pinned `ai` v7
// schema (src/ui-message-stream/ui-message-chunks.ts; see
// docs/design/ref/ui-message-stream.md §2). `type` is implied.
// `req` keys must be present (null is allowed only where the schema type is
// `unknown`, i.e. the `nullable` list); `opt` keys may be absent but never null.
// test/chunk-keys.test.mjs checks this table against the installed schema,
// so bumping `ai` fails loudly when a chunk type or key is added or removed.

const PM = 'providerMetadata';
const TOOL_OPT = ['dynamic', 'providerExecuted', 'title', PM, 'toolMetadata'];

export const CHUNK_KEYS = {
  start: { req: [], opt: ['messageId', 'messageMetadata'] },
  'start-step': { req: [], opt: [] },
  'finish-step': { req: [], opt: [] },
  'reset-step': { req: [], opt: [] },
  'text-start': { req: ['id'], opt: [PM] },
  'text-delta': { req: ['id', 'delta'], opt: [PM] },
  'text-end': { req: ['id'], opt: ['citations', PM] },
  'reasoning-start': { req: ['id'], opt: [PM] },
  'reasoning-delta': { req: ['id', 'delta'], opt: [PM] },
  'reasoning-end': { req: ['id'], opt: [PM] },
  'tool-input-start': { req: ['toolCallId', 'toolName'], opt: [...TOOL_OPT, 'inputEncoding'] },
  'tool-input-delta': { req: ['toolCallId', 'inputTextDelta'], opt: [] },
  'tool-input-available': { req: ['toolCallId', 'toolName', 'input'], opt: TOOL_OPT },
  'tool-input-error': { req: ['toolCallId', 'toolName', 'input', 'errorText'], opt: TOOL_OPT },
  'tool-output-available': {
    req: ['toolCallId', 'output'],
    opt: ['dynamic', 'providerExecuted', 'preliminary', PM, 'toolMetadata'],
  },
  'tool-output-error': {
    req: ['toolCallId', 'errorText'],
    opt: ['dynamic', 'providerExecuted', PM, 'toolMetadata'],
  },
  'tool-output-denied': { req: ['toolCallId'], opt: [] },
  'tool-approval-request': {
    req: ['approvalId', 'toolCallId'],
    opt: ['approvalDescriptor', 'inputSchemaInput', 'reason', 'isAutomatic', 'signature'],
  },
  'tool-approval-response': {
    req: ['approvalId', 'approved'],
    opt: ['reason', 'providerExecuted', PM],
  },
  'source-url': { req: ['sourceId', 'url'], opt: ['title', PM] },
  'source-document': { req: ['sourceId', 'mediaType', 'title'], opt: ['filename', PM] },
  file: { req: ['url', 'mediaType'], opt: [PM] },
  'reasoning-file': { req: ['url', 'mediaType'], opt: [PM] },
  custom: { req: ['kind'], opt: [PM] },
  'steering-message': { req: ['id', 'parts'], opt: [] },
  'message-metadata': { req: ['messageMetadata'], opt: [] },
  finish: { req: [], opt: ['finishReason', 'messageMetadata'] },
  error: { req: ['errorText'], opt: [] },
  abort: { req: [], opt: ['reason'] },
};

/** `data-<name>` chunks (any name). */
export const DATA_CHUNK_KEYS = { req: ['data'], opt: ['id', 'transient'] };

/** Required keys whose schema is `unknown`, so an explicit null is valid. */
export const NULLABLE_REQ = new Set(['input', 'output', 'data', 'messageMetadata']);

export function keysFor(type) {
  if (typeof type !== 'string') return undefined;
  if (type.startsWith('data-')) return DATA_CHUNK_KEYS;
  return Object.hasOwn(CHUNK_KEYS, type) ? CHUNK_KEYS[type] : undefined;
}

/** Returns a list of problems (strings) for one chunk object; [] when fine. */
export function checkChunkKeys(chunk) {
  if (chunk === null || typeof chunk !== 'object' || Array.isArray(chunk)) {
    return ['chunk is not a JSON object'];
  }
  const spec = keysFor(chunk.type);
  if (!spec) return [`unknown chunk type ${JSON.stringify(chunk.type)}`];
  const problems = [];
  for (const k of spec.req) {
    if (!Object.hasOwn(chunk, k)) problems.push(`missing required key "${k}"`);
    else if (chunk[k] === null && !NULLABLE_REQ.has(k)) problems.push(`required key "${k}" is null`);
  }
  for (const k of spec.opt) {
    if (Object.hasOwn(chunk, k) && chunk[k] === null) {
      problems.push(`optional key "${k}" is null (omit it instead)`);
    }
  }
  const allowed = new Set(['type', ...spec.req, ...spec.opt]);
  for (const k of Object.keys(chunk)) {
    if (!allowed.has(k)) {
      problems.push(`key "${k}" is not defined for chunk type "${chunk.type}" in the ai v7 schema`);
    }
  }
  return problems;
}
