//! The proxy's own cost on a call: round trips of JSON-RPC lines to an MCP server on
//! stdio, directly and through `idem proxy` (stdio in front of stdio, loopback pipes),
//! measured in one run, one after another, so the ratios hold on a noisy machine.
//!
//! ```text
//! cargo bench -p idem-cli --bench proxy [-- --calls 2000]
//! ```
//!
//! The server is this program itself, started again as an MCP server that answers at
//! once, so what is measured is the proxy: its relay, its key derivation and its
//! store (the default SQLite file, in a temporary directory).
//!
//! - `relay`: `ping`, which the proxy passes through unchanged.
//! - `tools/call, miss`: a new run id each call: claimed, forwarded, recorded.
//! - `tools/call, hit`: the same call again: answered from the store, the server
//!   not asked.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Instant;

use serde_json::{json, Value};

const UPSTREAM: &str = "IDEM_PROXY_BENCH_UPSTREAM";

fn main() {
    if std::env::var_os(UPSTREAM).is_some() {
        return upstream();
    }
    let calls = std::env::args()
        .skip_while(|a| a != "--calls")
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or(2000usize);
    let scratch = tempfile::tempdir().expect("a temp dir");
    let me = std::env::current_exe().expect("this program");

    let mut direct = Peer::start(Command::new(&me));
    let mut proxied = {
        let mut command = Command::new(env!("CARGO_BIN_EXE_idem"));
        command
            .args(["proxy", "--"])
            .arg(&me)
            .env("IDEM_DIR", scratch.path())
            .env_remove("IDEM_STORE")
            .env("RUST_LOG", "warn");
        Peer::start(command)
    };

    println!("idem proxy, stdio in front of a stdio MCP server that answers at once");
    println!("{calls} calls per row, after {WARMUP} to warm up; medians and p99 in µs\n");
    println!(
        "| {:<18} | {:>13} | {:>12} | {:>12} | {:>10} | {:>11} |",
        "call", "direct median", "proxy median", "overhead", "direct p99", "proxy p99"
    );
    println!(
        "|{:-<20}|{:->15}|{:->14}|{:->14}|{:->12}|{:->13}|",
        "", "", "", "", "", ""
    );
    let rows: [(&str, Request); 3] = [
        (
            "relay (ping)",
            |id, _| json!({"jsonrpc": "2.0", "id": id, "method": "ping"}),
        ),
        ("tools/call, miss", |id, i| {
            send_email(id, &format!("bench-miss-{i}"))
        }),
        ("tools/call, hit", |id, _| send_email(id, "bench-hit")),
    ];
    for (name, request) in rows {
        let direct = direct.time(calls, request);
        let proxied = proxied.time(calls, request);
        let (dm, pm) = (median(&direct), median(&proxied));
        println!(
            "| {:<18} | {:>13.1} | {:>12.1} | {:>12.1} | {:>10.1} | {:>11.1} |",
            name,
            dm,
            pm,
            pm - dm,
            p99(&direct),
            p99(&proxied)
        );
    }
    println!("\noverhead = proxy median - direct median (the proxy's own cost per call)");
}

const WARMUP: usize = 200;

/// The `i`th request of a row, with JSON-RPC id `id`.
type Request = fn(u64, usize) -> Value;

fn send_email(id: u64, run: &str) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {
        "name": "send_email",
        "arguments": {"to": "ada@example.com", "subject": "Invoice", "body": "Attached."},
        "_meta": {"idem/run": run}
    }})
}

fn median(samples: &[f64]) -> f64 {
    samples[samples.len() / 2]
}

fn p99(samples: &[f64]) -> f64 {
    samples[samples.len() * 99 / 100]
}

/// A client of an MCP server on stdio, one request at a time.
struct Peer {
    _child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    next_id: u64,
}

impl Peer {
    fn start(mut command: Command) -> Peer {
        command
            .env(UPSTREAM, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = command.spawn().expect("the server starts");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut peer = Peer {
            _child: child,
            stdin,
            stdout,
            next_id: 0,
        };
        let init = json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": {"name": "bench", "version": "1"}}});
        peer.round_trip(&init);
        peer.send(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
        peer
    }

    fn send(&mut self, message: &Value) {
        writeln!(self.stdin, "{message}").expect("the server reads");
        self.stdin.flush().expect("the server reads");
    }

    fn round_trip(&mut self, request: &Value) -> Value {
        self.send(request);
        let mut line = String::new();
        loop {
            line.clear();
            let read = self
                .stdout
                .read_line(&mut line)
                .expect("the server answers");
            assert!(read > 0, "the server exited");
            let message: Value = serde_json::from_str(&line).expect("JSON");
            if message.get("id") == request.get("id") {
                assert!(message.get("result").is_some(), "{message}");
                return message;
            }
        }
    }

    /// Round-trip times of `calls` requests, sorted, in µs.
    fn time(&mut self, calls: usize, request: Request) -> Vec<f64> {
        let mut samples = Vec::with_capacity(calls);
        for i in 0..WARMUP + calls {
            self.next_id += 1;
            let request = request(self.next_id, i);
            let started = Instant::now();
            self.round_trip(&request);
            if i >= WARMUP {
                samples.push(started.elapsed().as_secs_f64() * 1e6);
            }
        }
        samples.sort_by(f64::total_cmp);
        samples
    }
}

/// The MCP server the bench talks to: answers every request at once.
fn upstream() {
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout().lock();
    let mut sent = 0u64;
    for line in stdin.lock().lines().map_while(Result::ok) {
        let Ok(request) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        let Some(id) = request.get("id") else {
            continue;
        };
        let result = match request["method"].as_str() {
            Some("initialize") => json!({"protocolVersion": "2025-11-25",
                "capabilities": {"tools": {}}, "serverInfo": {"name": "bench", "version": "1"}}),
            Some("tools/list") => json!({"tools": [{"name": "send_email",
                "inputSchema": {"type": "object"}, "annotations": {"readOnlyHint": false}}]}),
            Some("tools/call") => {
                sent += 1;
                let message = format!("msg-{sent}");
                json!({"content": [{"type": "text", "text": message}],
                       "structuredContent": {"message_id": message}})
            }
            _ => json!({}),
        };
        let response = json!({"jsonrpc": "2.0", "id": id, "result": result});
        if writeln!(stdout, "{response}")
            .and_then(|()| stdout.flush())
            .is_err()
        {
            return;
        }
    }
}
