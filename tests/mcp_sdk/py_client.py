"""MCP test client (official Python SDK). Prints ONE JSON line describing what it observed.
usage: py_client.py SCENARIO [ARGS...] (stdio -- CMD [ARGS...] | http URL)
scenarios: retry RUN | concurrent RUN N | norun | readonly RUN | failonce RUN TAG | list | meta RUN"""
import json, os, sys
from datetime import timedelta

import anyio
from mcp import ClientSession, McpError, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client

ARITY = {"retry": 1, "concurrent": 2, "norun": 0, "readonly": 1, "failonce": 2, "list": 0, "meta": 1}
EMAIL = {"to": "ada@example.com", "subject": "hi", "body": "b"}
NORMAL = timedelta(seconds=10)


def res(r):  # CallToolResult -> plain dict (keeps "_meta" wire name)
    d = r.model_dump(mode="json", by_alias=True, exclude_none=True)
    return {k: d.get(k) for k in ("isError", "structuredContent", "content", "_meta")}


def err(e: McpError):
    return {"jsonrpc_error": {"code": e.error.code, "message": e.error.message, "data": e.error.data}}


async def call(s, name, args, run=None, timeout=NORMAL):
    try:
        return res(await s.call_tool(name, args, read_timeout_seconds=timeout,
                                     meta=None if run is None else {"idem/run": run}))
    except McpError as e:
        return err(e)


async def scenario(s: ClientSession, name, a):
    if name == "retry":
        first = await call(s, "send_email", EMAIL, a[0], timeout=timedelta(milliseconds=300))
        if first.get("jsonrpc_error", {}).get("code") == 408:  # SDK's client-side timeout (REQUEST_TIMEOUT)
            first = "timeout"
        second = await call(s, "send_email", EMAIL, a[0])
        return {"first": first, "second": second.get("structuredContent"),
                "second_meta": second.get("_meta"), "second_raw": second}
    if name == "concurrent":
        out = [None] * int(a[1])

        async def one(i):
            out[i] = await call(s, "send_email", EMAIL, a[0])

        async with anyio.create_task_group() as tg:
            for i in range(len(out)):
                tg.start_soon(one, i)
        return {"message_ids": [(r.get("structuredContent") or {}).get("message_id") for r in out],
                "metas": [r.get("_meta") for r in out], "results": out}
    if name == "norun":
        r = await call(s, "send_email", EMAIL)
        return {"isError": bool(r.get("isError")) or "jsonrpc_error" in r, "result": r}
    if name == "readonly":
        return {"results": [await call(s, "count_emails", {}, a[0]) for _ in range(2)]}
    if name == "failonce":
        return {"results": [await call(s, "fail_once", {"tag": a[1]}, a[0]) for _ in range(2)]}
    if name == "list":
        tools = (await s.list_tools()).tools
        return {"tools": [{"name": t.name, "annotations": t.annotations and t.annotations.model_dump(
            mode="json", exclude_none=True)} for t in tools]}
    if name == "meta":
        return {"echo": await call(s, "echo_meta", {}, a[0])}
    raise SystemExit(f"unknown scenario {name}")


async def main():
    name = sys.argv[1]
    args, spec = sys.argv[2:2 + ARITY[name]], sys.argv[2 + ARITY[name]:]
    if spec[0] == "stdio":
        cmd = spec[2:] if spec[1] == "--" else spec[1:]
        # env=None would pass only a minimal default env (no LEDGER etc.), so pass ours through.
        transport = stdio_client(StdioServerParameters(command=cmd[0], args=cmd[1:], env=dict(os.environ)))
    elif spec[0] == "http":
        transport = streamable_http_client(spec[1])
    else:
        raise SystemExit("transport must be 'stdio -- CMD...' or 'http URL'")
    async with transport as streams:
        async with ClientSession(streams[0], streams[1]) as s:
            await s.initialize()
            out = await scenario(s, name, args)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    anyio.run(main)
