"""Upstream MCP test server (official Python SDK, FastMCP).
stdio:  python py_server.py
HTTP:   python py_server.py --http PORT [--json]   (endpoint http://127.0.0.1:PORT/mcp; PORT 0 takes a free
        one; prints "listening on PORT" once it listens; POST replies are SSE streams unless --json, which
        makes them plain application/json)
Env: LEDGER (send_email log), LATENCY_MS (default 1000), READS (count_emails log), FAILS (fail_once log)."""
import json, os, sys, uuid
from typing import Any, TypedDict

import anyio
from mcp.server.fastmcp import Context, FastMCP
from mcp.types import ToolAnnotations

mcp = FastMCP("py-upstream", log_level="WARNING")


def append(path: str | None, obj: dict) -> None:
    if not path:
        return
    with open(path, "a") as f:
        f.write(json.dumps(obj) + "\n")
        f.flush()
        os.fsync(f.fileno())


def lines(path: str | None) -> int:
    try:
        with open(path or "") as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


class Sent(TypedDict):
    message_id: str
    to: str


@mcp.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False))
async def send_email(to: str, subject: str, body: str) -> Sent:
    """Send an email (appends to $LEDGER)."""
    append(os.environ.get("LEDGER"), {"to": to, "subject": subject, "pid": os.getpid()})
    await anyio.sleep(int(os.environ.get("LATENCY_MS", "1000")) / 1000)
    return {"message_id": "msg-" + uuid.uuid4().hex, "to": to}


@mcp.tool(annotations=ToolAnnotations(readOnlyHint=True))
def count_emails() -> int:
    """Number of lines in $LEDGER (each run appends to $READS)."""
    append(os.environ.get("READS"), {"pid": os.getpid()})
    return lines(os.environ.get("LEDGER"))


_mem_tags: set[str] = set()  # used when FAILS is unset


@mcp.tool(annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False))
def fail_once(tag: str) -> dict[str, bool]:
    """First call per tag fails (isError); later calls return {"ok": true}. Tracked in $FAILS."""
    path = os.environ.get("FAILS")
    if path:
        try:
            with open(path) as f:
                seen = {json.loads(l)["tag"] for l in f if l.strip()}
        except FileNotFoundError:
            seen = set()
    else:
        seen = set(_mem_tags)
    _mem_tags.add(tag)
    append(path, {"tag": tag, "pid": os.getpid()})
    if tag not in seen:
        raise RuntimeError(f"transient failure for tag {tag}")
    return {"ok": True}


@mcp.tool(annotations=ToolAnnotations(readOnlyHint=True))
def echo_meta(ctx: Context) -> dict[str, Any]:
    """Debug: returns the request's params._meta as received by the server."""
    meta = ctx.request_context.meta
    return {"meta": meta.model_dump(exclude_none=True) if meta else None}


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--http":
        # Binds the port itself (0: any free one) and prints it once it listens: a port
        # the test picked and let go of could be taken by another test's proxy first.
        import socket
        import uvicorn

        mcp.settings.json_response = "--json" in sys.argv[3:]
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", int(sys.argv[2])))
        sock.listen(128)
        print(f"listening on {sock.getsockname()[1]}", flush=True)
        server = uvicorn.Server(uvicorn.Config(mcp.streamable_http_app(), log_level="warning"))
        anyio.run(server.serve, [sock])
    else:
        mcp.run()  # stdio
