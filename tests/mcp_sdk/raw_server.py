"""An MCP server on stdio in plain Python (no SDK), for what the SDK servers do not do.

Tools: `send` (appends a line to $LEDGER per run; read-only when RO=true) and `look`
(read-only). MODE changes what `send` does:
  big    answers with a 5 MiB text, over every store's limit
  input  answers `resultType: "input_required"` until the call carries `inputResponses`
  flip   its first call flips `send`'s readOnlyHint and sends notifications/tools/list_changed
  exit   the server exits at once, every time it starts
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
    method, id = message.get("method"), message.get("id")
    if id is None:
        return
    if method == "initialize":
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
        out({"jsonrpc": "2.0", "id": id, "error": {"code": -32601, "message": "no such method"}})
        return
    out({"jsonrpc": "2.0", "id": id, "result": result})


if MODE == "exit":
    sys.exit(3)
for line in sys.stdin:
    threading.Thread(target=handle, args=(json.loads(line),)).start()
