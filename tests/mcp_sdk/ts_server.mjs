// Upstream MCP test server (official TS SDK, McpServer over stdio).  node ts_server.mjs
// Env: MCPFIX_NODE (dir holding node_modules, default ./node next to this file),
//      LEDGER, LATENCY_MS (default 1000), READS, FAILS — see py_server.py.
import fs from 'node:fs';
import path from 'node:path';
import crypto from 'node:crypto';
import { pathToFileURL, fileURLToPath } from 'node:url';

const NODE = process.env.MCPFIX_NODE || path.join(path.dirname(fileURLToPath(import.meta.url)), 'node');
const load = (p) => import(pathToFileURL(path.join(NODE, 'node_modules', p)).href);
const { McpServer } = await load('@modelcontextprotocol/sdk/dist/esm/server/mcp.js');
const { StdioServerTransport } = await load('@modelcontextprotocol/sdk/dist/esm/server/stdio.js');
const { z } = await load('zod/index.js');

const env = process.env;
const append = (file, obj) => {
  if (!file) return;
  const fd = fs.openSync(file, 'a');
  try { fs.writeSync(fd, JSON.stringify(obj) + '\n'); fs.fsyncSync(fd); } finally { fs.closeSync(fd); }
};
const readLines = (file) => {
  try { return fs.readFileSync(file, 'utf8').split('\n').filter((l) => l.trim()); } catch { return []; }
};
const ok = (obj) => ({ content: [{ type: 'text', text: JSON.stringify(obj) }], structuredContent: obj });

const server = new McpServer({ name: 'ts-upstream', version: '0.0.1' });

server.registerTool('send_email', {
  description: 'Send an email (appends to $LEDGER).',
  inputSchema: { to: z.string(), subject: z.string(), body: z.string() },
  outputSchema: { message_id: z.string(), to: z.string() },
  annotations: { readOnlyHint: false, destructiveHint: false },
}, async ({ to, subject }) => {
  append(env.LEDGER, { to, subject, pid: process.pid });
  await new Promise((r) => setTimeout(r, Number(env.LATENCY_MS ?? 1000)));
  return ok({ message_id: 'msg-' + crypto.randomUUID().replaceAll('-', ''), to });
});

server.registerTool('count_emails', {
  description: 'Number of lines in $LEDGER (each run appends to $READS).',
  outputSchema: { result: z.number().int() },
  annotations: { readOnlyHint: true },
}, async () => {
  append(env.READS, { pid: process.pid });
  return ok({ result: env.LEDGER ? readLines(env.LEDGER).length : 0 });
});

const memTags = new Set(); // used when FAILS is unset
server.registerTool('fail_once', {
  description: 'First call per tag fails (isError); later calls return {"ok": true}. Tracked in $FAILS.',
  inputSchema: { tag: z.string() },
  outputSchema: { ok: z.boolean() },
  annotations: { readOnlyHint: false, destructiveHint: false },
}, async ({ tag }) => {
  const seen = env.FAILS ? new Set(readLines(env.FAILS).map((l) => JSON.parse(l).tag)) : new Set(memTags);
  memTags.add(tag);
  append(env.FAILS, { tag, pid: process.pid });
  if (!seen.has(tag)) return { content: [{ type: 'text', text: `transient failure for tag ${tag}` }], isError: true };
  return ok({ ok: true });
});

server.registerTool('echo_meta', {
  description: "Debug: returns the request's params._meta as received by the server.",
  annotations: { readOnlyHint: true },
}, async (extra) => ok({ meta: extra._meta ?? null }));

await server.connect(new StdioServerTransport());
