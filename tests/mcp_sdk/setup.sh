#!/usr/bin/env bash
# Usage: setup.sh DIR  -- creates DIR/venv (python mcp SDK) and DIR/node (TS SDK). Idempotent.
set -euo pipefail
DIR=${1:?usage: setup.sh DIR}
PY_MCP=1.30.0          # official Python SDK, last 1.x line (2.x renamed FastMCP -> MCPServer)
TS_MCP=1.32.2          # @modelcontextprotocol/sdk
ZOD=4.6.7              # peer dep of the TS SDK (^3.25 || ^4)
EVERYTHING=2026.8.31   # @modelcontextprotocol/server-everything, the reference server
STAMP="mcp==$PY_MCP @modelcontextprotocol/sdk@$TS_MCP zod@$ZOD server-everything@$EVERYTHING"
MARK="$DIR/.mcpfix-installed"
mkdir -p "$DIR"
if [ -f "$MARK" ] && [ "$(cat "$MARK")" = "$STAMP" ]; then exit 0; fi
[ -x "$DIR/venv/bin/python" ] || python3 -m venv "$DIR/venv"
"$DIR/venv/bin/pip" install -q --disable-pip-version-check "mcp==$PY_MCP" >/dev/null
mkdir -p "$DIR/node"
( cd "$DIR/node"
  [ -f package.json ] || echo '{"name":"mcpfix","private":true,"type":"module"}' > package.json
  npm install --silent --no-audit --no-fund --save-exact \
    "@modelcontextprotocol/sdk@$TS_MCP" "zod@$ZOD" \
    "@modelcontextprotocol/server-everything@$EVERYTHING" >/dev/null )
echo "$STAMP" > "$MARK"
