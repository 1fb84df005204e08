// One story through sortie's MCP server with the official MCP TypeScript SDK, over streamable HTTP or
// stdio; prints what happened as one JSON object (the Rust test asserts on it).
//
//   node session.mjs --http URL --token TOKEN --viewer VIEWER_TOKEN --repo PATH
//   node session.mjs --stdio SORTIE_BIN [ARGS…] -- --repo PATH
import { Client } from '@modelcontextprotocol/sdk/client/index.js';
import { StreamableHTTPClientTransport } from '@modelcontextprotocol/sdk/client/streamableHttp.js';
import { StdioClientTransport } from '@modelcontextprotocol/sdk/client/stdio.js';

const args = process.argv.slice(2);
const flag = (name) => { const i = args.indexOf(name); return i >= 0 ? args[i + 1] : undefined; };
const repo = flag('--repo');

function connectHttp(url, token) {
  return new StreamableHTTPClientTransport(new URL(url), { requestInit: { headers: { Authorization: `Bearer ${token}` } } });
}

async function open(transport) {
  const client = new Client({ name: 'sortie-mcp-kit', version: '0.0.0' });
  await client.connect(transport);
  return client;
}

/** A tool's answer: its text parsed as JSON when it is JSON, and whether it is an error. */
async function call(client, name, args) {
  const result = await client.callTool({ name, arguments: args }, undefined, { timeout: 120000 });
  const text = result.content.filter((c) => c.type === 'text').map((c) => c.text).join('\n');
  let json = null;
  try { json = JSON.parse(text); } catch { /* text */ }
  return { isError: Boolean(result.isError), text, json };
}

let transport;
let viewerTransport;
if (args[0] === '--stdio') {
  const end = args.indexOf('--');
  const [command, ...rest] = args.slice(1, end);
  transport = new StdioClientTransport({ command, args: rest, env: process.env, stderr: 'inherit' });
} else {
  transport = connectHttp(flag('--http'), flag('--token'));
  viewerTransport = connectHttp(flag('--http'), flag('--viewer'));
}

const out = {};
const client = await open(transport);
out.server = client.getServerVersion();
out.tools = (await client.listTools()).tools.map((t) => ({ name: t.name, description: t.description, schema: t.inputSchema }));

const created = await call(client, 'create_session', { repo, agent: 'scripted', task: '#!scripted\nsay: Hello from the first turn.' });
out.created = created;
const id = created.json?.id;
out.awaited = await call(client, 'await_session', { id, timeout_secs: 120 });
out.transcript = await call(client, 'get_transcript', { id });
out.steered = await call(client, 'steer_session', { id, prompt: '#!scripted\nsay: And the second.' });
out.awaitedAgain = await call(client, 'await_session', { id, timeout_secs: 120 });
out.transcriptAgain = await call(client, 'get_transcript', { id, last: 2 });
out.listed = await call(client, 'list_sessions', {});
out.allowed = await call(client, 'allow_egress', { id, hosts: ['example.com'] });
out.refusedAllow = await call(client, 'allow_egress', { id, hosts: ['10.0.0.1'] });
out.missing = await call(client, 'get_session', { id: 'ses_01jd8x3k4m5n6p7q8r9s0t1v2w' });
out.canceled = await call(client, 'cancel_session', { id });
await client.close();

if (viewerTransport) {
  const viewer = await open(viewerTransport);
  out.viewerCreate = await call(viewer, 'create_session', { repo, agent: 'scripted', task: 'no' });
  out.viewerGet = await call(viewer, 'get_session', { id });
  await viewer.close();
}
console.log(JSON.stringify(out));
