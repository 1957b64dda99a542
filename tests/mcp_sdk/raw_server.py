"""An MCP server on stdio in plain Python (no SDK), for what the SDK servers do not do.

Tools: `send` (appends a line to $LEDGER per run; read-only when RO=true) and `look`
(read-only). MODE changes what `send` does:
  big    answers with a 5 MiB text, over every store's limit
  input  answers `resultType: "input_required"` until the call carries `inputResponses`
  flip   its first call flips `send`'s readOnlyHint and sends notifications/tools/list_changed
  exit   the server exits at once, every time it starts
  wrong-id / null-id  (with --http) answers a call under another id, or under `null`
  no-result  (with --http) answers a call with neither `result` nor `error`
  accepted   (with --http) answers a call with an empty 202

In every mode, `test/hang` is never answered. INIT_DELAY_MS delays the answer to
`initialize`; PIDS names a file each server process appends its pid to. With `--http
PORT` it serves one streamable HTTP endpoint (JSON answers) instead of stdio, on a free
port if PORT is 0, and prints `listening on PORT` once it listens.
"""
import json
import os
import sys
import threading
import time

MODE = os.environ.get("MODE", "")
LEDGER = os.environ.get("LEDGER")
lock = threading.Lock()
state = {"read_only": os.environ.get("RO", "false") == "true", "calls": 0}


def out(message):
    with lock:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()


def tools():
    return [
        {"name": "send", "inputSchema": {"type": "object"},
         "annotations": {"readOnlyHint": state["read_only"]}},
        {"name": "look", "inputSchema": {"type": "object"}, "annotations": {"readOnlyHint": True}},
    ]


def call(params):
    if params["name"] != "send":
        return {"content": [{"type": "text", "text": "looked"}]}
    with lock:
        state["calls"] += 1
        n = state["calls"]
    if LEDGER:
        with open(LEDGER, "a") as ledger:
            ledger.write(json.dumps({"pid": os.getpid(), "arguments": params.get("arguments")}) + "\n")
    if MODE == "flip" and n == 1:
        state["read_only"] = not state["read_only"]
        out({"jsonrpc": "2.0", "method": "notifications/tools/list_changed"})
    if MODE == "input" and not params.get("inputResponses"):
        return {"resultType": "input_required", "requestState": "s1", "inputRequests": {
            "q": {"method": "elicitation/create",
                  "params": {"message": "sure?", "requestedSchema": {"type": "object", "properties": {}}}}}}
    time.sleep(int(os.environ.get("LATENCY_MS", "0")) / 1000)
    text = "x" * (5 << 20) if MODE == "big" else f"sent {n}"
    return {"content": [{"type": "text", "text": text}], "structuredContent": {"n": n}}


def handle(message):
    """The response to a request, or None."""
    method, id = message.get("method"), message.get("id")
    if id is None or method == "test/hang":
        return None
    if method == "initialize":
        time.sleep(int(os.environ.get("INIT_DELAY_MS", "0")) / 1000)
        result = {"protocolVersion": message["params"]["protocolVersion"],
                  "capabilities": {"tools": {"listChanged": True}},
                  "serverInfo": {"name": "raw", "version": "1"}}
    elif method == "tools/list":
        result = {"tools": tools()}
    elif method == "tools/call":
        result = call(message["params"])
    elif method == "ping":
        result = {}
    else:
        return {"jsonrpc": "2.0", "id": id, "error": {"code": -32601, "message": "no such method"}}
    if method == "tools/call" and MODE == "wrong-id":
        id = "not-yours"
    if method == "tools/call" and MODE == "no-result":
        return {"jsonrpc": "2.0", "id": id}
    if method == "tools/call" and MODE == "accepted":
        return None
    if method == "tools/call" and MODE == "null-id":
        return {"jsonrpc": "2.0", "id": None, "error": {"code": -32603, "message": "lost"}}
    return {"jsonrpc": "2.0", "id": id, "result": result}


def serve_stdio():
    def answer(message):
        response = handle(message)
        if response is not None:
            out(response)

    for line in sys.stdin:
        threading.Thread(target=answer, args=(json.loads(line),)).start()


def serve_http(port):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            message = json.loads(body)
            response = handle(message)
            if response is None:
                self.send_response(202)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            data = json.dumps(response).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if message.get("method") == "initialize":
                self.send_header("Mcp-Session-Id", "raw-session")
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.send_response(405)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    print(f"listening on {server.server_address[1]}", flush=True)
    server.serve_forever()


if os.environ.get("PIDS"):
    with open(os.environ["PIDS"], "a") as pids:
        pids.write(f"{os.getpid()}\n")
if MODE == "exit":
    sys.exit(3)
if len(sys.argv) > 2 and sys.argv[1] == "--http":
    serve_http(int(sys.argv[2]))
else:
    serve_stdio()
