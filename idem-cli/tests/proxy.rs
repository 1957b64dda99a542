//! `idem proxy` in front of MCP servers written with the official Python SDK (FastMCP)
//! and TypeScript SDK, and the published reference server ("everything"), driven by
//! the official Python and TypeScript SDK clients over stdio and streamable HTTP.
//!
//! The figure that matters is the ledger: each `send_email` the upstream really runs
//! appends a line to it. The SDKs come from the registries: `tests/mcp_sdk/setup.sh
//! DIR` installs them, and these tests find them in `$IDEM_MCP_SDK` (`.ci/run` sets
//! it). Without it they say so and skip.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const IDEM: &str = env!("CARGO_BIN_EXE_idem");

/// The installed SDKs and the test servers and clients.
struct Sdk {
    python: PathBuf,
    node_modules: PathBuf,
    fixtures: PathBuf,
}

impl Sdk {
    fn find(test: &str) -> Option<Sdk> {
        let Some(dir) = std::env::var_os("IDEM_MCP_SDK") else {
            eprintln!(
                "SKIPPED {test}: set IDEM_MCP_SDK to a directory prepared by \
                 `tests/mcp_sdk/setup.sh DIR` (the official MCP SDKs; .ci/run does this)"
            );
            return None;
        };
        let dir = PathBuf::from(dir);
        Some(Sdk {
            python: dir.join("venv/bin/python"),
            node_modules: dir.join("node"),
            fixtures: Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/mcp_sdk"),
        })
    }

    fn fixture(&self, name: &str) -> String {
        self.fixtures.join(name).display().to_string()
    }

    /// The command that starts an upstream server: `py` or `ts`.
    fn server(&self, which: &str) -> Vec<String> {
        match which {
            "py" => vec![
                self.python.display().to_string(),
                self.fixture("py_server.py"),
            ],
            "ts" => vec!["node".into(), self.fixture("ts_server.mjs")],
            "everything" => vec![
                "node".into(),
                self.node_modules
                    .join("node_modules/@modelcontextprotocol/server-everything/dist/index.js")
                    .display()
                    .to_string(),
                "stdio".into(),
            ],
            other => panic!("no server {other}"),
        }
    }

    /// The command that runs a client: `py` or `ts`.
    fn client(&self, which: &str) -> Vec<String> {
        match which {
            "py" => vec![
                self.python.display().to_string(),
                self.fixture("py_client.py"),
            ],
            "ts" => vec!["node".into(), self.fixture("ts_client.mjs")],
            other => panic!("no client {other}"),
        }
    }
}

/// One test's files: the ledgers the servers write, and the proxies' store.
struct Scratch {
    dir: tempfile::TempDir,
}

impl Scratch {
    fn new() -> Self {
        Scratch {
            dir: tempfile::tempdir().expect("a temp dir"),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// How many lines a ledger has.
    fn lines(&self, name: &str) -> usize {
        std::fs::read_to_string(self.path(name))
            .map(|text| text.lines().filter(|l| !l.trim().is_empty()).count())
            .unwrap_or(0)
    }

    /// The environment of the servers, clients and proxies of this test.
    fn env(&self, sdk: &Sdk, command: &mut Command, latency_ms: u64) {
        command
            .env("LEDGER", self.path("ledger"))
            .env("READS", self.path("reads"))
            .env("FAILS", self.path("fails"))
            .env("LATENCY_MS", latency_ms.to_string())
            .env("MCPFIX_NODE", &sdk.node_modules)
            .env("IDEM_DIR", self.dir.path())
            .env_remove("IDEM_STORE");
    }
}

/// Runs a client scenario against `transport` (`["stdio", "--", cmd..]` or
/// `["http", url]`); its one line of JSON.
fn scenario(
    sdk: &Sdk,
    scratch: &Scratch,
    client: &str,
    args: &[&str],
    transport: &[String],
) -> Value {
    let mut argv = sdk.client(client);
    argv.extend(args.iter().map(|a| a.to_string()));
    argv.extend(transport.iter().cloned());
    let mut command = Command::new(&argv[0]);
    command.args(&argv[1..]);
    scratch.env(sdk, &mut command, 1000);
    let output = run_with_timeout(command, Duration::from_secs(120));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(line).unwrap_or_else(|e| {
        panic!(
            "{client} {args:?} over {transport:?}: no JSON ({e}); stdout: {stdout}; stderr: {}",
            String::from_utf8_lossy(&output.stderr)
        )
    })
}

fn run_with_timeout(mut command: Command, limit: Duration) -> Output {
    let child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .expect("the client starts");
    let id = child.id();
    let (done, waited) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(child.wait_with_output());
    });
    match waited.recv_timeout(limit) {
        Ok(output) => output.expect("the client ran"),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &id.to_string()]).status();
            panic!("{command:?} did not finish in {limit:?}")
        }
    }
}

/// `idem proxy` in front of `server` (a command, or `["--upstream", url]`), as a stdio
/// command line for a client.
fn via_stdio_proxy(extra: &[&str], server: Vec<String>) -> Vec<String> {
    let mut argv = vec![
        "stdio".to_owned(),
        "--".to_owned(),
        IDEM.to_owned(),
        "proxy".to_owned(),
    ];
    argv.extend(extra.iter().map(|a| a.to_string()));
    if server.first().is_none_or(|a| a != "--upstream") {
        argv.push("--".into());
    }
    argv.extend(server);
    argv
}

/// The Python server serving streamable HTTP on 127.0.0.1 (answers as server-sent
/// events); killed on drop.
struct HttpServer {
    child: Child,
    port: u16,
    url: String,
}

impl HttpServer {
    /// On a port the server picks: it binds port 0 and says which port it got, so two
    /// tests never race for one port (a port picked here and bound later may be taken
    /// by another test's proxy in between, and its calls would go there).
    fn start(sdk: &Sdk, scratch: &Scratch) -> Self {
        HttpServer::start_on(sdk, scratch, 0)
    }

    /// On `port` (again, after it was killed); fails if the port is taken.
    fn start_on(sdk: &Sdk, scratch: &Scratch, port: u16) -> Self {
        HttpServer::spawn(sdk, scratch, "py_server.py", port, &[])
    }

    /// `tests/mcp_sdk/raw_server.py --http` in `mode`.
    fn raw(sdk: &Sdk, scratch: &Scratch, mode: &str) -> Self {
        HttpServer::spawn(sdk, scratch, "raw_server.py", 0, &[("MODE", mode)])
    }

    fn spawn(sdk: &Sdk, scratch: &Scratch, file: &str, port: u16, env: &[(&str, &str)]) -> Self {
        let mut command = Command::new(&sdk.python);
        command
            .arg(sdk.fixture(file))
            .args(["--http", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        scratch.env(sdk, &mut command, 1000);
        command.envs(env.iter().copied());
        let mut child = command.spawn().expect("the server starts");
        // The server prints `listening on PORT` once it listens; it exits if it cannot
        // bind, and then says nothing.
        let stdout = child.stdout.take().expect("stdout");
        let (said, heard) = mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines().map_while(Result::ok);
            let _ = said.send(lines.next());
            lines.for_each(drop);
        });
        let line = heard
            .recv_timeout(Duration::from_secs(30))
            .ok()
            .flatten()
            .unwrap_or_else(|| panic!("{file} never listened on port {port}"));
        let port = line
            .strip_prefix("listening on ")
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or_else(|| panic!("{file} said {line:?}, not where it listens"));
        HttpServer {
            child,
            port,
            url: format!("http://127.0.0.1:{port}/mcp"),
        }
    }

    /// The proxy's arguments that name it.
    fn upstream(&self) -> Vec<String> {
        vec!["--upstream".into(), self.url.clone()]
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A port nothing listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// An HTTP proxy in front of `server` on 127.0.0.1; killed on drop.
struct HttpProxy {
    child: Child,
    url: String,
}

impl HttpProxy {
    /// In front of a server it starts (`server` is a command), or, with `["--upstream",
    /// url]`, in front of an HTTP server.
    fn start(sdk: &Sdk, scratch: &Scratch, server: Vec<String>) -> Self {
        HttpProxy::start_with(sdk, scratch, &[], server)
    }

    /// [`HttpProxy::start`] with more options (`--store URL`).
    fn start_with(sdk: &Sdk, scratch: &Scratch, extra: &[String], server: Vec<String>) -> Self {
        let mut command = Command::new(IDEM);
        command
            .args(["proxy", "--listen", "127.0.0.1:0"])
            .args(extra);
        if server.first().is_some_and(|a| a == "--upstream") {
            command.args(server);
        } else {
            command.arg("--").args(server);
        }
        command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        scratch.env(sdk, &mut command, 1000);
        let mut child = command.spawn().expect("the proxy starts");
        let stderr = child.stderr.take().expect("stderr");
        let (found, url) = mpsc::channel();
        std::thread::spawn(move || {
            let mut found = Some(found);
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(at) = line.find("http://") {
                    if let Some(found) = found.take() {
                        let _ = found.send(line[at..].trim().to_owned());
                    }
                }
                eprintln!("proxy: {line}");
            }
        });
        let url = url
            .recv_timeout(Duration::from_secs(30))
            .expect("the proxy says where it listens");
        HttpProxy { child, url }
    }

    fn transport(&self) -> Vec<String> {
        vec!["http".into(), self.url.clone()]
    }
}

impl Drop for HttpProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn replayed(result: &Value) -> bool {
    result["_meta"]["idem/replayed"] == json!(true)
}

/// Every scenario of one client against one upstream through one transport.
fn exercise(sdk: &Sdk, scratch: &Scratch, client: &str, transport: &[String], what: &str) {
    let list = scenario(sdk, scratch, client, &["list"], transport);
    let hint = |name: &str| {
        let tools = list["tools"].as_array().expect("tools");
        let tool = tools.iter().find(|t| t["name"] == name).expect(name);
        tool["annotations"]["idempotentHint"] == json!(true)
    };
    assert!(hint("send_email") && hint("fail_once"), "{what}: {list}");
    assert!(
        !hint("count_emails"),
        "{what}: a read-only tool is not marked: {list}"
    );

    // The client gives up on the first call before the slow server answers, and retries.
    let retry = scenario(sdk, scratch, client, &["retry", "run-retry"], transport);
    assert_eq!(retry["first"], json!("timeout"), "{what}: {retry}");
    assert!(retry["second"]["message_id"].is_string(), "{what}: {retry}");
    assert_eq!(
        retry["second_meta"]["idem/replayed"],
        json!(true),
        "{what}: {retry}"
    );
    assert_eq!(
        scratch.lines("ledger"),
        1,
        "{what}: one email for the call and its retry"
    );

    // Eight identical calls at once: one email, one message id.
    let burst = scenario(
        sdk,
        scratch,
        client,
        &["concurrent", "run-burst", "8"],
        transport,
    );
    let ids = burst["message_ids"].as_array().expect("ids");
    assert_eq!(ids.len(), 8, "{what}: {burst}");
    assert!(
        ids.iter().all(|id| id.is_string() && *id == ids[0]),
        "{what}: {burst}"
    );
    let replays = burst["results"].as_array().expect("results");
    assert_eq!(
        replays.iter().filter(|r| replayed(r)).count(),
        7,
        "{what}: {burst}"
    );
    assert_eq!(scratch.lines("ledger"), 2, "{what}: one more email");

    // No run id: refused, saying where it goes; nothing sent.
    let norun = scenario(sdk, scratch, client, &["norun"], transport);
    let refused = norun["result"]["jsonrpc_error"]["message"]
        .as_str()
        .unwrap_or_default();
    assert!(refused.contains("_meta[\"idem/run\"]"), "{what}: {norun}");
    assert_eq!(
        scratch.lines("ledger"),
        2,
        "{what}: nothing sent without a run id"
    );

    // A read-only tool runs every time.
    scenario(sdk, scratch, client, &["readonly", "run-read"], transport);
    assert_eq!(
        scratch.lines("reads"),
        2,
        "{what}: a read-only tool ran twice"
    );

    // A tool error is not stored: the retry runs, and succeeds.
    let failing = scenario(
        sdk,
        scratch,
        client,
        &["failonce", "run-fail", "tag"],
        transport,
    );
    let results = failing["results"].as_array().expect("results");
    assert_eq!(results[0]["isError"], json!(true), "{what}: {failing}");
    assert_ne!(results[1]["isError"], json!(true), "{what}: {failing}");
    assert!(!replayed(&results[1]), "{what}: {failing}");
    assert_eq!(
        scratch.lines("fails"),
        2,
        "{what}: the retry of a tool error ran"
    );
}

#[test]
fn sdk_clients_through_the_proxy_get_one_side_effect_per_call() {
    let Some(sdk) = Sdk::find("sdk_clients_through_the_proxy_get_one_side_effect_per_call") else {
        return;
    };
    std::thread::scope(|threads| {
        for server in ["py", "ts"] {
            for client in ["py", "ts"] {
                let sdk = &sdk;
                threads.spawn(move || {
                    let scratch = Scratch::new();
                    let stdio = via_stdio_proxy(&[], sdk.server(server));
                    exercise(
                        sdk,
                        &scratch,
                        client,
                        &stdio,
                        &format!("{client} client, stdio, {server} server"),
                    );
                });
                threads.spawn(move || {
                    let scratch = Scratch::new();
                    let proxy = HttpProxy::start(sdk, &scratch, sdk.server(server));
                    let what = format!("{client} client, streamable HTTP, {server} server");
                    exercise(sdk, &scratch, client, &proxy.transport(), &what);
                });
            }
        }
        // In front of a server that speaks streamable HTTP itself.
        for client in ["py", "ts"] {
            let sdk = &sdk;
            threads.spawn(move || {
                let scratch = Scratch::new();
                let server = HttpServer::start(sdk, &scratch);
                let proxy = HttpProxy::start(sdk, &scratch, server.upstream());
                let what = format!("{client} client, HTTP in front of an HTTP server");
                exercise(sdk, &scratch, client, &proxy.transport(), &what);
            });
            threads.spawn(move || {
                let scratch = Scratch::new();
                let server = HttpServer::start(sdk, &scratch);
                let stdio = via_stdio_proxy(&[], server.upstream());
                let what = format!("{client} client, stdio in front of an HTTP server");
                exercise(sdk, &scratch, client, &stdio, &what);
            });
        }
    });
}

#[test]
fn two_proxies_on_one_machine_share_their_records() {
    let Some(sdk) = Sdk::find("two_proxies_on_one_machine_share_their_records") else {
        return;
    };
    // Two clients (a desktop app and an IDE), each starting its own proxy and server;
    // both proxies use the default store, one SQLite file. The two servers are one mail
    // service written twice (Python, TypeScript): given one name, they share records.
    let scratch = Scratch::new();
    let first = scenario(
        &sdk,
        &scratch,
        "py",
        &["concurrent", "run-shared", "1"],
        &via_stdio_proxy(&["--scope", "mailer"], sdk.server("py")),
    );
    let second = scenario(
        &sdk,
        &scratch,
        "ts",
        &["concurrent", "run-shared", "1"],
        &via_stdio_proxy(&["--scope", "mailer"], sdk.server("ts")),
    );
    assert_eq!(
        first["message_ids"], second["message_ids"],
        "{first} / {second}"
    );
    assert!(replayed(&second["results"][0]), "{second}");
    assert_eq!(scratch.lines("ledger"), 1);
    assert!(
        scratch.path("proxy.sqlite").is_file(),
        "the default store is a SQLite file"
    );
}

#[test]
fn a_published_server_looks_the_same_through_the_proxy() {
    let Some(sdk) = Sdk::find("a_published_server_looks_the_same_through_the_proxy") else {
        return;
    };
    let scratch = Scratch::new();
    let server = sdk.server("everything");
    let mut direct_transport = vec!["stdio".to_owned(), "--".to_owned()];
    direct_transport.extend(server.iter().cloned());
    let mut direct = scenario(&sdk, &scratch, "ts", &["survey"], &direct_transport);
    let mut proxied = scenario(
        &sdk,
        &scratch,
        "ts",
        &["survey"],
        &via_stdio_proxy(&[], server),
    );

    // Progress notifications pass through (their count depends on timing).
    for survey in [&direct, &proxied] {
        assert!(
            survey["progress"].as_u64().unwrap_or(0) >= 2,
            "progress: {survey}"
        );
    }
    // The tools the proxy protects (those not read-only) say so; the rest is unchanged.
    let tools = proxied["tools"].as_array_mut().expect("tools");
    let mut marked = Vec::new();
    for (tool, before) in tools
        .iter_mut()
        .zip(direct["tools"].as_array().expect("tools"))
    {
        let read_only = tool["annotations"]["readOnlyHint"] == json!(true);
        if !read_only {
            assert_eq!(tool["annotations"]["idempotentHint"], json!(true), "{tool}");
            tool["annotations"]["idempotentHint"] = before["annotations"]["idempotentHint"].clone();
            marked.push(tool["name"].clone());
        }
    }
    assert!(!marked.is_empty(), "the server has side-effecting tools");
    for survey in [&mut direct, &mut proxied] {
        survey["progress"] = Value::Null;
    }
    assert_eq!(direct, proxied, "the client sees the same server");
}

#[test]
fn the_servers_own_requests_reach_the_client_during_a_protected_call() {
    let Some(sdk) = Sdk::find("the_servers_own_requests_reach_the_client_during_a_protected_call")
    else {
        return;
    };
    // The reference server's tools that ask the client for a sampling, an elicitation
    // and its roots while they run; over stdio, and over HTTP (its GET stream).
    let scratch = Scratch::new();
    let http = HttpProxy::start(&sdk, &scratch, sdk.server("everything"));
    let transports = [
        via_stdio_proxy(&[], sdk.server("everything")),
        http.transport(),
    ];
    for (n, transport) in transports.iter().enumerate() {
        let run = format!("run-ask-{n}");
        let first = scenario(&sdk, &scratch, "ts", &["ask", &run], transport);
        // The server may ask for the roots once more on its own, at the session's start
        // (when its request and the tool's race): roots are counted as at least one.
        let asked = |result: &Value| {
            let roots = result["asked"]["roots"].as_u64().unwrap_or(0);
            (
                result["asked"]["sampling"].clone(),
                result["asked"]["elicitation"].clone(),
                roots >= 1,
            )
        };
        assert_eq!(
            asked(&first),
            (json!(1), json!(1), true),
            "{transport:?}: {first}"
        );
        assert!(!replayed(&first["sampling"]), "{first}");
        let text = first["sampling"]["content"][0]["text"]
            .as_str()
            .unwrap_or_default();
        assert!(text.contains("sampled by the client"), "{first}");

        // The same calls again: the side-effecting ones are replayed (the client is not
        // asked again), the read-only one runs.
        let again = scenario(&sdk, &scratch, "ts", &["ask", &run], transport);
        assert_eq!(
            asked(&again),
            (json!(0), json!(0), true),
            "{transport:?}: {again}"
        );
        assert!(
            replayed(&again["sampling"]) && replayed(&again["elicitation"]),
            "{again}"
        );
        assert_eq!(again["sampling"]["content"], first["sampling"]["content"]);
    }
}

#[test]
fn a_fleet_of_http_proxies_shares_postgres_or_redis() {
    let Some(sdk) = Sdk::find("a_fleet_of_http_proxies_shares_postgres_or_redis") else {
        return;
    };
    let unique = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    // One table and prefix for every run of this test (its records expire), a run id
    // of its own each time.
    let run = format!("run-fleet-{unique}");
    let stores = [
        ("IDEM_POSTGRES_URL", "--table", "idem_proxy_test"),
        ("IDEM_REDIS_URL", "--prefix", "idem-proxy-test:"),
    ];
    for (variable, option, name) in stores {
        let Some(url) = std::env::var(variable).ok().filter(|u| !u.is_empty()) else {
            eprintln!(
                "SKIPPED a_fleet_of_http_proxies_shares_postgres_or_redis on {variable}: not set"
            );
            continue;
        };
        // Two proxies (two machines of a fleet), each with its own server process.
        let scratch = Scratch::new();
        let extra = [
            "--store".to_owned(),
            url,
            option.to_owned(),
            name.to_owned(),
            // Two implementations of one mail service (Python and TypeScript): one name.
            "--scope".to_owned(),
            "mailer".to_owned(),
        ];
        let a = HttpProxy::start_with(&sdk, &scratch, &extra, sdk.server("py"));
        let b = HttpProxy::start_with(&sdk, &scratch, &extra, sdk.server("ts"));
        let args = ["concurrent", run.as_str(), "1"];
        let first = scenario(&sdk, &scratch, "py", &args, &a.transport());
        let second = scenario(&sdk, &scratch, "ts", &args, &b.transport());
        assert_eq!(
            first["message_ids"], second["message_ids"],
            "{variable}: {second}"
        );
        assert!(replayed(&second["results"][0]), "{variable}: {second}");
        assert_eq!(scratch.lines("ledger"), 1, "{variable}: one email");
    }
}

/// A client speaking JSON-RPC lines to an `idem proxy` on stdio, by hand: for the
/// tests that kill things.
struct Driver {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<Value>,
}

impl Driver {
    /// A proxy in front of the Python SDK's server, initialized.
    fn start(sdk: &Sdk, scratch: &Scratch, extra: &[&str], latency_ms: u64) -> Driver {
        let mut driver = Driver::spawn(
            sdk,
            scratch,
            extra,
            sdk.server("py"),
            &[("LATENCY_MS", &latency_ms.to_string())],
        );
        driver.initialize();
        driver
    }

    /// A proxy in front of `tests/mcp_sdk/raw_server.py` in `mode`, initialized.
    fn raw(sdk: &Sdk, scratch: &Scratch, extra: &[&str], env: &[(&str, &str)]) -> Driver {
        let server = vec![
            sdk.python.display().to_string(),
            sdk.fixture("raw_server.py"),
        ];
        let mut driver = Driver::spawn(sdk, scratch, extra, server, env);
        driver.initialize();
        driver
    }

    /// A proxy in front of `server`, not yet initialized.
    fn spawn(
        sdk: &Sdk,
        scratch: &Scratch,
        extra: &[&str],
        server: Vec<String>,
        env: &[(&str, &str)],
    ) -> Driver {
        let mut command = Command::new(IDEM);
        command.arg("proxy").args(extra);
        if server.first().is_none_or(|a| a != "--upstream") {
            command.arg("--");
        }
        command
            .args(server)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        scratch.env(sdk, &mut command, 0);
        command.envs(env.iter().copied());
        let mut child = command.spawn().expect("the proxy starts");
        let stdin = Some(child.stdin.take().expect("stdin"));
        let stdout = child.stdout.take().expect("stdout");
        let (sender, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Ok(message) = serde_json::from_str(&line) {
                    if sender.send(message).is_err() {
                        break;
                    }
                }
            }
        });
        Driver {
            child,
            stdin,
            lines,
        }
    }

    fn initialize(&mut self) {
        let init = self.request(0, "initialize", Driver::initialize_params());
        assert!(init.get("result").is_some(), "{init}");
        self.send(json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
    }

    fn initialize_params() -> Value {
        json!({"protocolVersion": "2025-11-25", "capabilities": {},
               "clientInfo": {"name": "driver", "version": "1"}})
    }

    /// Closes the proxy's stdin, as a client that went away.
    fn close(&mut self) {
        self.stdin = None;
    }

    /// Waits for the proxy to exit by itself; what it still wrote.
    fn wait_for_exit(mut self, limit: Duration) -> Vec<Value> {
        let deadline = Instant::now() + limit;
        loop {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the proxy did not exit in {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        self.lines.try_iter().collect()
    }

    fn send(&mut self, message: Value) {
        let stdin = self.stdin.as_mut().expect("stdin is open");
        writeln!(stdin, "{message}").expect("the proxy reads");
        stdin.flush().expect("the proxy reads");
    }

    fn send_email(&mut self, id: u64, run: &str) {
        self.send_email_to(id, run, "ada@example.com");
    }

    fn send_email_to(&mut self, id: u64, run: &str, to: &str) {
        self.send(
            json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {
                "name": "send_email",
                "arguments": {"to": to, "subject": "hi", "body": "b"},
                "_meta": {"idem/run": run}
            }}),
        );
    }

    /// The response to request `id` (other messages skipped).
    fn response(&mut self, id: u64) -> Value {
        self.response_within(id, Duration::from_secs(60))
    }

    /// [`Driver::response`], in `limit`.
    fn response_within(&mut self, id: u64, limit: Duration) -> Value {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let message = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("no response to {id} in {limit:?}"));
            if message["id"] == json!(id) {
                return message;
            }
        }
    }

    fn request(&mut self, id: u64, method: &str, params: Value) -> Value {
        self.send(json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}));
        self.response(id)
    }

    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until the ledger has `n` lines: the upstream ran the side effect.
fn wait_for_lines(scratch: &Scratch, name: &str, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while scratch.lines(name) < n {
        assert!(Instant::now() < deadline, "{name} never reached {n} lines");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_proxy_killed_mid_call_loses_nothing_it_promised() {
    let Some(sdk) = Sdk::find("a_proxy_killed_mid_call_loses_nothing_it_promised") else {
        return;
    };
    for at_most_once in [false, true] {
        let scratch = Scratch::new();
        let mut extra = vec!["--lease", "1s"];
        if at_most_once {
            extra.push("--at-most-once");
        }
        let mut proxy = Driver::start(&sdk, &scratch, &extra, 2000);
        proxy.send_email(1, "run-kill");
        // The server sent the email; the proxy dies before it answers (SIGKILL).
        wait_for_lines(&scratch, "ledger", 1);
        proxy.kill();

        // The client starts the proxy again and retries the same call.
        let mut proxy = Driver::start(&sdk, &scratch, &extra, 0);
        proxy.send_email(2, "run-kill");
        let retry = proxy.response(2);
        if at_most_once {
            let message = retry["error"]["message"].as_str().unwrap_or_default();
            assert!(message.contains("outcome unknown"), "{retry}");
            assert_eq!(scratch.lines("ledger"), 1, "at most once: never sent again");
        } else {
            assert!(retry.get("result").is_some(), "{retry}");
            assert_eq!(
                scratch.lines("ledger"),
                2,
                "at least once: at most one more, inside the crash window"
            );
        }
        // Settled: a third call gets the same answer without sending.
        proxy.send_email(3, "run-kill");
        let third = proxy.response(3);
        assert_eq!(third.get("result").is_some(), !at_most_once, "{third}");
        assert_eq!(scratch.lines("ledger"), if at_most_once { 1 } else { 2 });
        proxy.kill();
    }
}

#[test]
fn a_server_that_dies_mid_call_is_restarted_and_the_call_settled_by_policy() {
    let Some(sdk) =
        Sdk::find("a_server_that_dies_mid_call_is_restarted_and_the_call_settled_by_policy")
    else {
        return;
    };
    for at_most_once in [false, true] {
        let scratch = Scratch::new();
        let extra: &[&str] = if at_most_once {
            &["--at-most-once"]
        } else {
            &[]
        };
        let mut proxy = Driver::start(&sdk, &scratch, extra, 1500);
        proxy.send_email(1, "run-crash");
        wait_for_lines(&scratch, "ledger", 1);
        // The server dies with the email sent and its answer not given.
        let ledger = std::fs::read_to_string(scratch.path("ledger")).unwrap();
        let pid = serde_json::from_str::<Value>(ledger.lines().next().unwrap()).unwrap()["pid"]
            .as_u64()
            .expect("the server's pid");
        let killed = Command::new("kill").args(["-9", &pid.to_string()]).status();
        assert!(killed.is_ok_and(|s| s.success()));
        let answer = proxy.response(1);
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("went away during this call"), "{answer}");

        // The proxy restarted the server, in the same client session.
        proxy.send_email(2, "run-crash");
        let retry = proxy.response(2);
        if at_most_once {
            let message = retry["error"]["message"].as_str().unwrap_or_default();
            assert!(message.contains("outcome unknown"), "{retry}");
            assert_eq!(scratch.lines("ledger"), 1);
        } else {
            assert!(retry.get("result").is_some(), "{retry}");
            assert_eq!(scratch.lines("ledger"), 2, "at least once: one more");
        }
        // And serves other calls as before.
        proxy.send_email(3, "run-after");
        let after = proxy.response(3);
        assert!(after.get("result").is_some(), "{after}");
        proxy.kill();
    }
}

/// The ledger's lines for one recipient.
fn lines_to(scratch: &Scratch, to: &str) -> usize {
    let ledger = std::fs::read_to_string(scratch.path("ledger")).unwrap_or_default();
    ledger
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|line| line["to"] == json!(to))
        .count()
}

#[test]
fn a_campaign_of_proxy_kills_at_random_moments() {
    let Some(sdk) = Sdk::find("a_campaign_of_proxy_kills_at_random_moments") else {
        return;
    };
    // Each round: a call, the proxy SIGKILLed at a random moment of it (before the
    // claim, before the email, inside the crash window, after the answer), then the
    // proxy started again and the call retried until it has an answer.
    let scratch = Scratch::new();
    let mut seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1)
        | 1;
    let mut random = move |below: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % below
    };
    let (mut extra_lines, mut unknown) = (0, 0);
    for round in 0..12 {
        let at_most_once = round % 2 == 1;
        let mut extra = vec!["--lease", "1s"];
        if at_most_once {
            extra.push("--at-most-once");
        }
        let to = format!("round-{round}@example.com");
        let run = format!("run-campaign-{round}");
        let mut proxy = Driver::start(&sdk, &scratch, &extra, 300);
        proxy.send_email_to(1, &run, &to);
        std::thread::sleep(Duration::from_millis(random(700)));
        proxy.kill();

        let mut proxy = Driver::start(&sdk, &scratch, &extra, 300);
        proxy.send_email_to(2, &run, &to);
        let retry = proxy.response(2);
        let lines = lines_to(&scratch, &to);
        if at_most_once {
            assert!(
                lines <= 1,
                "round {round}: at most once, {lines} emails: {retry}"
            );
            if retry.get("result").is_none() {
                let message = retry["error"]["message"].as_str().unwrap_or_default();
                assert!(
                    message.contains("outcome unknown"),
                    "round {round}: {retry}"
                );
                unknown += 1;
            } else {
                assert_eq!(lines, 1, "round {round}: {retry}");
            }
        } else {
            assert!(retry.get("result").is_some(), "round {round}: {retry}");
            assert!(
                (1..=2).contains(&lines),
                "round {round}: at least once, {lines} emails"
            );
            extra_lines += lines - 1;
        }
        proxy.kill();
    }
    eprintln!("12 kills: {extra_lines} extra emails (at least once), {unknown} outcomes unknown (at most once)");
}

#[test]
fn a_call_sent_just_before_the_client_closes_stdin_is_answered() {
    let Some(sdk) = Sdk::find("a_call_sent_just_before_the_client_closes_stdin_is_answered") else {
        return;
    };
    for extra in [&[][..], &["--at-most-once"][..]] {
        // `printf '...' | idem proxy -- server`: the call, then end of input at once.
        let scratch = Scratch::new();
        let mut proxy = Driver::start(&sdk, &scratch, extra, 300);
        proxy.send_email(1, "run-eof");
        proxy.send(json!({"jsonrpc": "2.0", "id": 2, "method": "ping"}));
        proxy.close();
        let written = proxy.wait_for_exit(Duration::from_secs(30));
        let answer = written.iter().find(|m| m["id"] == json!(1));
        let answer = answer.unwrap_or_else(|| panic!("{extra:?}: no answer: {written:?}"));
        assert!(
            answer["result"]["structuredContent"]["message_id"].is_string(),
            "{answer}"
        );
        assert!(written
            .iter()
            .any(|m| m["id"] == json!(2) && m.get("result").is_some()));
        assert_eq!(scratch.lines("ledger"), 1, "{extra:?}");

        // Recorded: the retry through a new proxy is replayed, never `outcome unknown`.
        let mut proxy = Driver::start(&sdk, &scratch, extra, 300);
        proxy.send_email(3, "run-eof");
        let retry = proxy.response(3);
        assert_eq!(
            retry["result"]["structuredContent"],
            answer["result"]["structuredContent"]
        );
        assert_eq!(scratch.lines("ledger"), 1, "{extra:?}");
        proxy.kill();
    }
}

#[test]
fn a_client_id_like_the_proxys_own_stays_the_clients() {
    let Some(sdk) = Sdk::find("a_client_id_like_the_proxys_own_stays_the_clients") else {
        return;
    };
    let scratch = Scratch::new();
    let mut proxy = Driver::start(&sdk, &scratch, &[], 300);
    proxy.send_email(1, "run-ids");
    for id in ["idem-proxy-1", "idem-proxy-2", "idem-proxy-0"] {
        proxy.send(json!({"jsonrpc": "2.0", "id": id, "method": "ping"}));
    }
    let call = proxy.response(1);
    assert!(
        call["result"]["structuredContent"]["message_id"].is_string(),
        "{call}"
    );
    proxy.send_email(2, "run-ids");
    let retry = proxy.response(2);
    assert_eq!(
        retry["result"]["structuredContent"],
        call["result"]["structuredContent"]
    );
    proxy.kill();
}

#[test]
fn what_the_proxy_cannot_replay_it_does_not_store() {
    let Some(sdk) = Sdk::find("what_the_proxy_cannot_replay_it_does_not_store") else {
        return;
    };
    let send = |id: u64, run: &str, extra: Value| {
        let mut params = json!({"name": "send", "arguments": {"n": 1}, "_meta": {"idem/run": run}});
        if let (Some(params), Some(extra)) = (params.as_object_mut(), extra.as_object()) {
            params.extend(extra.clone());
        }
        json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": params})
    };

    // A result over the store's limit: the caller gets it whole; a retry gets a tool
    // error that says the call ran, and the tool does not run again.
    let scratch = Scratch::new();
    let mut proxy = Driver::raw(&sdk, &scratch, &[], &[("MODE", "big")]);
    proxy.send(send(1, "run-big", json!({})));
    let first = proxy.response(1);
    let text = first["result"]["content"][0]["text"]
        .as_str()
        .unwrap_or_default();
    assert_eq!(text.len(), 5 << 20, "the whole result");
    proxy.send(send(2, "run-big", json!({})));
    let retry = proxy.response(2);
    assert_eq!(retry["result"]["isError"], json!(true), "{retry}");
    let said = retry["result"]["content"][0]["text"]
        .as_str()
        .unwrap_or_default();
    assert!(said.contains("this call ran"), "{said}");
    assert_eq!(scratch.lines("ledger"), 1, "the tool ran once");
    proxy.kill();

    // A request for the client's input is the first round, not the outcome: the next
    // round, with the client's answers, runs.
    let scratch = Scratch::new();
    let mut proxy = Driver::raw(&sdk, &scratch, &[], &[("MODE", "input")]);
    proxy.send(send(1, "run-input", json!({})));
    let first = proxy.response(1);
    assert_eq!(
        first["result"]["resultType"],
        json!("input_required"),
        "{first}"
    );
    let answers = json!({"inputResponses": {"q": {"action": "accept"}}, "requestState": "s1"});
    proxy.send(send(2, "run-input", answers));
    let second = proxy.response(2);
    assert_eq!(
        second["result"]["structuredContent"]["n"],
        json!(2),
        "{second}"
    );
    assert!(!replayed(&second["result"]), "{second}");
    proxy.kill();

    // A tool that turns side-effecting (notifications/tools/list_changed) is protected
    // from its next call.
    let scratch = Scratch::new();
    let mut proxy = Driver::raw(&sdk, &scratch, &[], &[("MODE", "flip"), ("RO", "true")]);
    for id in 1..=3 {
        proxy.send(send(id, "run-flip", json!({})));
        proxy.response(id);
    }
    assert_eq!(
        scratch.lines("ledger"),
        2,
        "read-only once, then protected: two runs of three"
    );
    proxy.kill();
}

#[test]
fn a_server_that_keeps_exiting_gets_requests_answered_not_stalled() {
    let Some(sdk) = Sdk::find("a_server_that_keeps_exiting_gets_requests_answered_not_stalled")
    else {
        return;
    };
    let scratch = Scratch::new();
    let server = vec![
        sdk.python.display().to_string(),
        sdk.fixture("raw_server.py"),
    ];
    let mut proxy = Driver::spawn(&sdk, &scratch, &[], server, &[("MODE", "exit")]);
    let started = Instant::now();
    let init = proxy.request(0, "initialize", Driver::initialize_params());
    assert!(init.get("error").is_some(), "{init}");
    proxy.send_email(1, "run-exit");
    let call = proxy.response(1);
    assert!(call.get("error").is_some(), "{call}");
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "answered in {:?}",
        started.elapsed()
    );
    proxy.close();
    proxy.wait_for_exit(Duration::from_secs(15));
}

/// Sends one HTTP/1.1 request to `url` (`http://ADDR/mcp`) on a connection of its own
/// (closed after its answer if `close`), without reading the answer.
fn send_http(
    url: &str,
    method: &str,
    session: Option<&str>,
    close: bool,
    body: &str,
) -> std::net::TcpStream {
    let addr = url.trim_start_matches("http://").trim_end_matches("/mcp");
    let mut connection = std::net::TcpStream::connect(addr).expect("the proxy listens");
    let mut head = format!(
        "{method} /mcp HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Accept: application/json, text/event-stream\r\nContent-Length: {}\r\n",
        body.len()
    );
    if let Some(session) = session {
        head.push_str(&format!("Mcp-Session-Id: {session}\r\n"));
    }
    if close {
        head.push_str("Connection: close\r\n");
    }
    head.push_str("\r\n");
    connection.write_all(head.as_bytes()).unwrap();
    connection.write_all(body.as_bytes()).unwrap();
    connection
}

/// One HTTP/1.1 request to `url` (`http://ADDR/mcp`) on a connection of its own: the
/// status code, the `Mcp-Session-Id` header, and the connection (to read the body).
fn http(
    url: &str,
    method: &str,
    session: Option<&str>,
    body: &str,
) -> (u16, Option<String>, std::net::TcpStream) {
    let connection = send_http(url, method, session, false, body);
    connection
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut reader = BufReader::new(connection.try_clone().unwrap());
    let mut status = String::new();
    reader.read_line(&mut status).unwrap();
    let code = status
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let mut session_id = None;
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        if line.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            if name.eq_ignore_ascii_case("mcp-session-id") {
                session_id = Some(value.trim().to_owned());
            }
        }
    }
    (code, session_id, connection)
}

#[test]
fn the_http_proxy_refuses_batches_and_stops_on_sigterm_with_streams_open() {
    let Some(sdk) =
        Sdk::find("the_http_proxy_refuses_batches_and_stops_on_sigterm_with_streams_open")
    else {
        return;
    };
    let scratch = Scratch::new();
    let mut proxy = HttpProxy::start(&sdk, &scratch, sdk.server("py"));
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize",
                      "params": Driver::initialize_params()});
    let (code, session, _) = http(&proxy.url, "POST", None, &init.to_string());
    assert_eq!(code, 200);
    let session = session.expect("a session id");
    let initialized = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    let (code, _, _) = http(&proxy.url, "POST", Some(&session), &initialized.to_string());
    assert_eq!(code, 202);

    // A batch would skip protection: refused, and nothing runs.
    let call = json!({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
        "name": "send_email", "arguments": {"to": "a@example.com", "subject": "s", "body": "b"}}});
    let (code, _, _) = http(
        &proxy.url,
        "POST",
        Some(&session),
        &json!([call]).to_string(),
    );
    assert_eq!(code, 400);
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(scratch.lines("ledger"), 0);

    // Two requests with one id in flight at once: the second is refused, the first
    // answered.
    let slow = json!({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {
        "name": "send_email", "arguments": {"to": "a@example.com", "subject": "s", "body": "b"},
        "_meta": {"idem/run": "run-dup"}}});
    let first = {
        let (url, session, slow) = (proxy.url.clone(), session.clone(), slow.to_string());
        std::thread::spawn(move || http(&url, "POST", Some(&session), &slow).0)
    };
    wait_for_lines(&scratch, "ledger", 1);
    let (code, _, _) = http(&proxy.url, "POST", Some(&session), &slow.to_string());
    assert_eq!(code, 400, "the same id, in flight");
    assert_eq!(first.join().unwrap(), 200);
    assert_eq!(scratch.lines("ledger"), 1);

    // A client holds the stream of the server's messages open; SIGTERM still stops
    // the proxy.
    let (code, _, _stream) = http(&proxy.url, "GET", Some(&session), "");
    assert_eq!(code, 200);
    let pid = proxy.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let deadline = Instant::now() + Duration::from_secs(15);
    while proxy.child.try_wait().unwrap().is_none() {
        assert!(
            Instant::now() < deadline,
            "the proxy did not stop on SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn an_http_server_that_restarts_or_is_down_is_handled_request_by_request() {
    let Some(sdk) =
        Sdk::find("an_http_server_that_restarts_or_is_down_is_handled_request_by_request")
    else {
        return;
    };
    for at_most_once in [false, true] {
        let scratch = Scratch::new();
        let server = HttpServer::start(&sdk, &scratch);
        let port = server.port;
        let mut extra = vec![];
        if at_most_once {
            extra.push("--at-most-once");
        }
        let mut proxy = Driver::spawn(&sdk, &scratch, &extra, server.upstream(), &[]);
        proxy.initialize();
        proxy.send_email_to(1, "run-a", "a@example.com");
        assert!(proxy.response(1).get("result").is_some());

        // The server restarts, forgetting the session: three calls at once are each
        // answered once (one new session for them), and nothing else reaches the client.
        drop(server);
        let server = HttpServer::start_on(&sdk, &scratch, port);
        for (id, to) in [(2, "b"), (3, "c"), (4, "d")] {
            proxy.send_email_to(id, &format!("run-{to}"), &format!("{to}@example.com"));
        }
        let mut answered = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        while answered.len() < 3 {
            let left = deadline.saturating_duration_since(Instant::now());
            let message = proxy.lines.recv_timeout(left).expect("every call answered");
            if message.get("method").is_some() {
                continue;
            }
            assert!(
                [2, 3, 4].contains(&message["id"].as_u64().unwrap_or(0)),
                "a stray answer: {message}"
            );
            assert!(message.get("result").is_some(), "{message}");
            answered.push(message["id"].clone());
        }
        assert_eq!(scratch.lines("ledger"), 4);

        // The server is down: a call is refused at once, as not run; when the server is
        // back, its retry runs it, at most once too (never `outcome unknown`).
        drop(server);
        proxy.send_email_to(5, "run-e", "e@example.com");
        let refused = proxy.response(5);
        let message = refused["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("cannot reach the MCP server"), "{refused}");
        let _server = HttpServer::start_on(&sdk, &scratch, port);
        proxy.send_email_to(6, "run-e", "e@example.com");
        let retry = proxy.response(6);
        assert!(
            retry.get("result").is_some(),
            "at_most_once {at_most_once}: {retry}"
        );
        assert_eq!(lines_to(&scratch, "e@example.com"), 1);
        proxy.kill();
    }
}

#[test]
fn an_http_proxy_whose_server_is_down_keeps_no_session() {
    let Some(sdk) = Sdk::find("an_http_proxy_whose_server_is_down_keeps_no_session") else {
        return;
    };
    let scratch = Scratch::new();
    let port = free_port();
    let upstream = vec![
        "--upstream".to_owned(),
        format!("http://127.0.0.1:{port}/mcp"),
    ];
    let proxy = HttpProxy::start(&sdk, &scratch, upstream);
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize",
                      "params": Driver::initialize_params()});
    let (code, session, _) = http(&proxy.url, "POST", None, &init.to_string());
    assert_eq!(code, 200, "a JSON-RPC error, in an HTTP answer");
    assert_eq!(
        session, None,
        "no session for a server that did not start one"
    );

    // Once it is up, a new initialize starts a session, and a request in it is answered.
    let _server = HttpServer::start_on(&sdk, &scratch, port);
    let (code, session, _) = http(&proxy.url, "POST", None, &init.to_string());
    assert_eq!(code, 200);
    let session = session.expect("a session");
    let ping = json!({"jsonrpc": "2.0", "id": 2, "method": "ping"});
    let (code, _, _) = http(&proxy.url, "POST", Some(&session), &ping.to_string());
    assert_eq!(code, 200);
}

/// A `tools/call` of `raw_server.py`'s `send` under run `run`.
fn send_call(id: u64, run: &str, arguments: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "method": "tools/call", "params": {
        "name": "send", "arguments": arguments, "_meta": {"idem/run": run}}})
}

#[test]
fn an_answer_that_is_not_this_requests_leaves_no_call_waiting() {
    let Some(sdk) = Sdk::find("an_answer_that_is_not_this_requests_leaves_no_call_waiting") else {
        return;
    };
    for mode in ["wrong-id", "null-id", "no-result", "accepted"] {
        for at_most_once in [false, true] {
            let scratch = Scratch::new();
            let server = HttpServer::raw(&sdk, &scratch, mode);
            let extra: &[&str] = if at_most_once {
                &["--at-most-once"]
            } else {
                &[]
            };
            let mut proxy = Driver::spawn(&sdk, &scratch, extra, server.upstream(), &[]);
            proxy.initialize();
            proxy.send(send_call(1, "run-odd", json!({"n": 1})));
            let first = proxy.response_within(1, Duration::from_secs(20));
            assert!(first.get("error").is_some(), "{mode}: {first}");
            assert_eq!(scratch.lines("ledger"), 1);

            // The answer was lost: the claim is settled by policy.
            proxy.send(send_call(2, "run-odd", json!({"n": 1})));
            let retry = proxy.response_within(2, Duration::from_secs(20));
            let message = retry["error"]["message"].as_str().unwrap_or_default();
            if at_most_once {
                assert!(message.contains("outcome"), "{mode}: {retry}");
                assert_eq!(scratch.lines("ledger"), 1, "{mode}: not run again");
            } else {
                assert_eq!(scratch.lines("ledger"), 2, "{mode}: run again: {retry}");
            }
            proxy.kill();
        }
    }
}

#[test]
fn an_http_request_id_still_in_flight_after_its_client_hung_up_is_refused() {
    let Some(sdk) =
        Sdk::find("an_http_request_id_still_in_flight_after_its_client_hung_up_is_refused")
    else {
        return;
    };
    let scratch = Scratch::new();
    // The call runs 4 s after its email: time enough, on a busy machine, for the second
    // POST to arrive while it is in flight.
    let mut server = vec!["env".to_owned(), "LATENCY_MS=4000".to_owned()];
    server.extend(sdk.server("py"));
    let proxy = HttpProxy::start(&sdk, &scratch, server);
    let init = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize",
                      "params": Driver::initialize_params()});
    let (code, session, _) = http(&proxy.url, "POST", None, &init.to_string());
    assert_eq!(code, 200);
    let session = session.expect("a session id");
    let initialized = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
    http(&proxy.url, "POST", Some(&session), &initialized.to_string());

    let call = |run: &str, to: &str| {
        json!({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {
            "name": "send_email", "arguments": {"to": to, "subject": "s", "body": "b"},
            "_meta": {"idem/run": run}}})
        .to_string()
    };
    // A POST whose client hangs up once the call has started: the call runs on.
    let hung_up = send_http(
        &proxy.url,
        "POST",
        Some(&session),
        false,
        &call("run-a", "a@example.com"),
    );
    wait_for_lines(&scratch, "ledger", 1);
    drop(hung_up);
    std::thread::sleep(Duration::from_millis(100));

    // Another call under that id, while the first runs: its answer would be the first's.
    let (code, _, _) = http(
        &proxy.url,
        "POST",
        Some(&session),
        &call("run-b", "b@example.com"),
    );
    assert_eq!(code, 400, "an id in flight");
    assert_eq!(lines_to(&scratch, "b@example.com"), 0);

    // The first call's retry, under a new id, gets its result.
    let retry = call("run-a", "a@example.com").replace("\"id\":7", "\"id\":8");
    let answer = post_json(&proxy.url, &session, &retry);
    assert!(replayed(&answer["result"]), "{answer}");
    assert_eq!(lines_to(&scratch, "a@example.com"), 1);
}

/// A POST of `body` in `session`, on a connection closed after it: the JSON answer.
fn post_json(url: &str, session: &str, body: &str) -> Value {
    let mut connection = send_http(url, "POST", Some(session), true, body);
    connection
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut text = String::new();
    std::io::Read::read_to_string(&mut connection, &mut text).expect("an answer");
    let body = text.split_once("\r\n\r\n").map_or("", |(_, body)| body);
    serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {text}"))
}

#[test]
fn an_http_session_that_never_started_leaves_no_server_running() {
    let Some(sdk) = Sdk::find("an_http_session_that_never_started_leaves_no_server_running") else {
        return;
    };
    let scratch = Scratch::new();
    let pids = scratch.path("pids");
    let server = vec![
        "env".to_owned(),
        "INIT_DELAY_MS=2000".to_owned(),
        format!("PIDS={}", pids.display()),
        sdk.python.display().to_string(),
        sdk.fixture("raw_server.py"),
    ];
    let proxy = HttpProxy::start(&sdk, &scratch, server);

    // An initialize without an id is refused before any server starts.
    let init = json!({"jsonrpc": "2.0", "method": "initialize",
                      "params": Driver::initialize_params()});
    let (code, session, _) = http(&proxy.url, "POST", None, &init.to_string());
    assert_eq!((code, session), (400, None));

    // A client that hangs up before the server answers its initialize: the server stops.
    let body = json!({"jsonrpc": "2.0", "id": 1, "method": "initialize",
                      "params": Driver::initialize_params()});
    let connection = send_http(&proxy.url, "POST", None, false, &body.to_string());
    let deadline = Instant::now() + Duration::from_secs(30);
    let pid = loop {
        let written = std::fs::read_to_string(&pids).unwrap_or_default();
        if let Some(pid) = written.lines().next() {
            break pid.trim().to_owned();
        }
        assert!(Instant::now() < deadline, "the server never started");
        std::thread::sleep(Duration::from_millis(20));
    };
    drop(connection);
    let running = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|stat| !stat.contains(") Z "))
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while running() {
        assert!(
            Instant::now() < deadline,
            "the server of a session that never started still runs"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        std::fs::read_to_string(&pids)
            .unwrap_or_default()
            .lines()
            .count(),
        1,
        "one server was started, and not restarted"
    );
}

#[test]
fn a_request_the_server_never_answers_holds_a_closing_proxy_only_briefly() {
    let Some(sdk) =
        Sdk::find("a_request_the_server_never_answers_holds_a_closing_proxy_only_briefly")
    else {
        return;
    };
    let scratch = Scratch::new();
    let mut proxy = Driver::raw(&sdk, &scratch, &[], &[]);
    proxy.send(json!({"jsonrpc": "2.0", "id": 1, "method": "test/hang"}));
    proxy.send(json!({"jsonrpc": "2.0", "id": 2, "method": "ping"}));
    proxy.response(2);
    let closed = Instant::now();
    proxy.close();
    proxy.wait_for_exit(Duration::from_secs(30));
    assert!(
        closed.elapsed() >= Duration::from_secs(4),
        "it waited a little for the answer"
    );
}

#[test]
fn a_call_whose_arguments_are_not_an_object_is_refused() {
    let Some(sdk) = Sdk::find("a_call_whose_arguments_are_not_an_object_is_refused") else {
        return;
    };
    let scratch = Scratch::new();
    let mut proxy = Driver::raw(&sdk, &scratch, &[], &[]);
    for (id, arguments) in [(1, json!([1, 2])), (2, json!("x")), (3, json!(5))] {
        proxy.send(send_call(id, "run-args", arguments));
        let answer = proxy.response(id);
        assert_eq!(answer["error"]["code"], json!(-32602), "{answer}");
    }
    assert_eq!(scratch.lines("ledger"), 0, "nothing ran");

    // No arguments at all, and an empty object, are the same call.
    proxy.send(send_call(4, "run-args", json!({})));
    assert!(proxy.response(4).get("result").is_some());
    let mut bare = send_call(5, "run-args", json!({}));
    bare["params"].as_object_mut().unwrap().remove("arguments");
    proxy.send(bare);
    assert!(replayed(&proxy.response(5)["result"]));
    assert_eq!(scratch.lines("ledger"), 1);
    proxy.kill();
}

#[test]
fn two_servers_keep_their_records_apart_unless_given_one_scope() {
    let Some(sdk) = Sdk::find("two_servers_keep_their_records_apart_unless_given_one_scope") else {
        return;
    };
    let server = |scratch: &Scratch, ledger: &str| {
        vec![
            "env".to_owned(),
            format!("LEDGER={}", scratch.path(ledger).display()),
            sdk.python.display().to_string(),
            sdk.fixture("raw_server.py"),
        ]
    };
    for scope in [None, Some("mail")] {
        // One machine, one store: two proxies in front of two servers with a tool of
        // the same name, called with the same run and arguments.
        let scratch = Scratch::new();
        let extra: Vec<&str> = scope.map(|s| vec!["--scope", s]).unwrap_or_default();
        for (id, ledger) in [(1, "ledger-a"), (2, "ledger-b")] {
            let mut proxy = Driver::spawn(&sdk, &scratch, &extra, server(&scratch, ledger), &[]);
            proxy.initialize();
            proxy.send(send_call(id, "run-apart", json!({"to": "bob"})));
            assert!(proxy.response(id).get("result").is_some());
            proxy.kill();
        }
        let runs = (scratch.lines("ledger-a"), scratch.lines("ledger-b"));
        match scope {
            None => assert_eq!(runs, (1, 1), "two servers: each runs its own tool"),
            Some(_) => assert_eq!(runs, (1, 0), "one scope: the second replays"),
        }
    }
}

#[test]
fn a_stdio_request_under_an_id_in_flight_is_refused() {
    let Some(sdk) = Sdk::find("a_stdio_request_under_an_id_in_flight_is_refused") else {
        return;
    };
    let scratch = Scratch::new();
    // The first call holds its id for 4 s after its email: time enough, on a busy
    // machine, for the second to arrive while it is in flight.
    let mut proxy = Driver::start(&sdk, &scratch, &[], 4000);
    proxy.send_email_to(1, "run-dup-a", "a@example.com");
    wait_for_lines(&scratch, "ledger", 1);
    proxy.send_email_to(1, "run-dup-b", "b@example.com");
    let refused = proxy.response(1);
    assert_eq!(refused["error"]["code"], json!(-32600), "{refused}");
    // The first call is answered, and still counts as in flight until it is: a client
    // that closes stdin now gets its answer, and nothing runs twice.
    proxy.close();
    let written = proxy.wait_for_exit(Duration::from_secs(30));
    let answer = written.iter().find(|m| m["id"] == json!(1));
    assert!(
        answer.is_some_and(|a| a.get("result").is_some()),
        "{written:?}"
    );
    assert_eq!(lines_to(&scratch, "a@example.com"), 1);
    assert_eq!(lines_to(&scratch, "b@example.com"), 0);
}
