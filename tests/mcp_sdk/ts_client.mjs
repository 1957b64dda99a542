// MCP test client (official TS SDK). Prints ONE JSON line describing what it observed.
// usage: node ts_client.mjs SCENARIO [ARGS...] (stdio -- CMD [ARGS...] | http URL)
// scenarios: retry RUN | concurrent RUN N | norun | readonly RUN | failonce RUN TAG | list | meta RUN
//            | survey (tools, resources, prompts, calls with progress: for the "everything" server)
//            | ask RUN (the "everything" server's own requests to the client: sampling, elicitation, roots)
// Env: MCPFIX_NODE = dir holding node_modules (default ./node next to this file).
import path from 'node:path';
import { pathToFileURL, fileURLToPath } from 'node:url';

const NODE = process.env.MCPFIX_NODE || path.join(path.dirname(fileURLToPath(import.meta.url)), 'node');
const load = (p) => import(pathToFileURL(path.join(NODE, 'node_modules', '@modelcontextprotocol/sdk/dist/esm', p)).href);
const { Client } = await load('client/index.js');
const { StdioClientTransport } = await load('client/stdio.js');
const { StreamableHTTPClientTransport } = await load('client/streamableHttp.js');
const { McpError, ErrorCode, CreateMessageRequestSchema, ElicitRequestSchema, ListRootsRequestSchema } = await load('types.js');

const ARITY = { retry: 1, concurrent: 2, norun: 0, readonly: 1, failonce: 2, list: 0, meta: 1, survey: 0, ask: 1 };
const EMAIL = { to: 'ada@example.com', subject: 'hi', body: 'b' };
const [name, ...rest] = process.argv.slice(2);
const args = rest.slice(0, ARITY[name]);
const spec = rest.slice(ARITY[name]);

const pick = (r) => ({ isError: r.isError ?? false, structuredContent: r.structuredContent ?? null, content: r.content, _meta: r._meta ?? null });
async function call(client, tool, toolArgs, run, timeout = 10000) {
  const params = { name: tool, arguments: toolArgs };
  if (run !== undefined) params._meta = { 'idem/run': run };
  try {
    return pick(await client.callTool(params, undefined, { timeout }));
  } catch (e) {
    // McpError.message is "MCP error <code>: <msg>"; strip the prefix to get the wire message.
    if (e instanceof McpError) return { jsonrpc_error: { code: e.code, message: e.message.replace(/^MCP error -?\d+: /, ''), data: e.data ?? null } };
    throw e;
  }
}

async function scenario(c) {
  switch (name) {
    case 'retry': {
      let first = await call(c, 'send_email', EMAIL, args[0], 300);
      if (first.jsonrpc_error?.code === ErrorCode.RequestTimeout) first = 'timeout'; // -32001, SDK-local
      const second = await call(c, 'send_email', EMAIL, args[0]);
      return { first, second: second.structuredContent ?? null, second_meta: second._meta ?? null, second_raw: second };
    }
    case 'concurrent': {
      const rs = await Promise.all(Array.from({ length: Number(args[1]) }, () => call(c, 'send_email', EMAIL, args[0])));
      return { message_ids: rs.map((r) => r.structuredContent?.message_id ?? null), metas: rs.map((r) => r._meta ?? null), results: rs };
    }
    case 'norun': {
      const r = await call(c, 'send_email', EMAIL);
      return { isError: Boolean(r.isError || r.jsonrpc_error), result: r };
    }
    case 'readonly':
      return { results: [await call(c, 'count_emails', {}, args[0]), await call(c, 'count_emails', {}, args[0])] };
    case 'failonce':
      return { results: [await call(c, 'fail_once', { tag: args[1] }, args[0]), await call(c, 'fail_once', { tag: args[1] }, args[0])] };
    case 'list':
      return { tools: (await c.listTools()).tools.map((t) => ({ name: t.name, annotations: t.annotations ?? null })) };
    case 'meta':
      return { echo: await call(c, 'echo_meta', {}, args[0]) };
    case 'survey': {
      // Everything a client sees of a server, to compare with and without the proxy.
      const tools = (await c.listTools()).tools;
      const resources = (await c.listResources()).resources;
      const read = await c.readResource({ uri: resources[0].uri });
      const templates = (await c.listResourceTemplates()).resourceTemplates;
      const prompts = (await c.listPrompts()).prompts;
      const prompt = await c.getPrompt({ name: prompts.find((p) => !(p.arguments ?? []).some((a) => a.required)).name });
      const echo = await call(c, 'echo', { message: 'hello' });
      const sum = await call(c, 'get-sum', { a: 2, b: 3 });
      let progress = 0;
      const long = await c.callTool({ name: 'trigger-long-running-operation', arguments: { duration: 1, steps: 3 } }, undefined,
        { onprogress: () => { progress += 1; }, timeout: 10000 });
      return { server: c.getServerVersion(), capabilities: c.getServerCapabilities(), tools, resources: resources.length, read, templates, prompts, prompt, echo, sum, long: pick(long), progress };
    }
    case 'ask': {
      // Tools that send the client requests of their own while they run.
      const sampling = await call(c, 'trigger-sampling-request', { prompt: 'hello', maxTokens: 10 }, args[0]);
      const elicitation = await call(c, 'trigger-elicitation-request', {}, args[0]);
      const roots = await call(c, 'get-roots-list', {});
      return { sampling, elicitation, roots, asked };
    }
    default:
      throw new Error(`unknown scenario ${name}`);
  }
}

let transport;
if (spec[0] === 'stdio') {
  const cmd = spec[1] === '--' ? spec.slice(2) : spec.slice(1);
  // env: without it the SDK passes only a minimal default env (no LEDGER etc.).
  transport = new StdioClientTransport({ command: cmd[0], args: cmd.slice(1), env: process.env, stderr: 'inherit' });
} else if (spec[0] === 'http') {
  transport = new StreamableHTTPClientTransport(new URL(spec[1]));
} else {
  console.error("transport must be 'stdio -- CMD...' or 'http URL'");
  process.exit(2);
}
// `ask` answers the server's requests, and counts them.
const asked = { sampling: 0, elicitation: 0, roots: 0 };
const capabilities = name === 'ask' ? { sampling: {}, elicitation: {}, roots: { listChanged: true } } : {};
const client = new Client({ name: 'ts-client', version: '0.0.1' }, { capabilities });
if (name === 'ask') {
  client.setRequestHandler(CreateMessageRequestSchema, async () => {
    asked.sampling += 1;
    return { model: 'test-model', role: 'assistant', content: { type: 'text', text: 'sampled by the client' } };
  });
  client.setRequestHandler(ElicitRequestSchema, async () => { asked.elicitation += 1; return { action: 'decline' }; });
  client.setRequestHandler(ListRootsRequestSchema, async () => {
    asked.roots += 1;
    return { roots: [{ uri: 'file:///srv/project', name: 'project' }] };
  });
}
await client.connect(transport);
const out = await scenario(client);
await client.close();
process.stdout.write(JSON.stringify(out) + '\n', () => process.exit(0));
