//! Exactly-once `tools/call` for MCP servers: the rules, shared by the rmcp layer
//! ([`Idempotent`], feature `rmcp`) and the `idem proxy` command.
//!
//! An MCP client that lost a `tools/call` (a timeout, a dropped connection, a
//! restarted host) sends it again. For a tool with a side effect (send an email,
//! charge a card) the second request would run it a second time. These rules make the
//! second request get the first one's result instead:
//!
//! - **Which calls.** Every tool not declared read-only (`annotations.readOnlyHint:
//!   true`) is protected; [`Policy::tool`] adds or configures one, [`Policy::exempt`]
//!   leaves one out. A tool whose annotations are unknown is protected.
//! - **The key.** The agent's run id, from the request's `_meta["idem/run"]`
//!   ([`RUN_META_KEY`], renamed with [`Policy::run_meta_key`]), the tool's name and its
//!   `arguments`, hashed as canonical JSON (reordered keys are the same call). The
//!   run id is the client's to choose and keep across its retries, reconnections and
//!   restarts: one per agent run (or per conversation turn, per task: whatever must not
//!   repeat a side effect).
//! - **Without a run id** a protected call is refused with an `invalid params` error
//!   that says where the id goes, by default; [`WithoutRun::Forward`] forwards it
//!   unprotected instead.
//! - **A replay** carries `_meta["idem/replayed"] = true` ([`REPLAYED_META_KEY`]) in
//!   its result. A result with `isError: true` is not stored, so the next call runs
//!   (unless [`Policy::store_tool_errors`]); a JSON-RPC error is never stored.
//! - **`tools/list`** shows `idempotentHint: true` on every tool it protects.
//!
//! The calls are [`Tool`] calls: the same keys, records, stores and options as the
//! rest of idem (a call whose client stopped waiting finishes and records its result;
//! concurrent duplicates wait for the first; `idem ls` lists them).
//!
//! [`Idempotent`]: crate::mcp::Idempotent

#[cfg(feature = "rmcp")]
mod layer;

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};

use serde_json::{Map, Value};

use crate::error::Error;
use crate::key_text::Key;
use crate::run::{is_blank, Run};
use crate::store::Store;
use crate::telemetry::observe;
use crate::tool::Tool;

#[cfg(feature = "rmcp")]
pub use layer::Idempotent;

/// The request `_meta` field that carries the agent's run id, by default.
pub const RUN_META_KEY: &str = "idem/run";

/// The result `_meta` field that says a result was replayed: an earlier call with the
/// same run, tool and arguments ran the tool, and this call returns its result.
pub const REPLAYED_META_KEY: &str = "idem/replayed";

/// JSON-RPC's `invalid params` error code.
pub const INVALID_PARAMS: i64 = -32602;

/// JSON-RPC's `internal error` code.
pub const INTERNAL_ERROR: i64 = -32603;

/// What a protected call without a run id gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WithoutRun {
    /// An `invalid params` error that says where the run id goes (the default): a
    /// client that forgot it learns at its first call, not at its first duplicate.
    #[default]
    Refuse,
    /// Forwarded unprotected, as if idem were not there.
    Forward,
}

/// Makes every tool's options: see [`Policy::defaults`].
type Defaults = Arc<dyn Fn(Tool) -> Tool + Send + Sync>;

/// Which `tools/call` requests are made idempotent, and how (see the
/// [module docs](self)). Cheap to clone.
#[derive(Clone)]
pub struct Policy {
    store: Option<Arc<dyn Store>>,
    run_meta_key: Arc<str>,
    without_run: WithoutRun,
    store_tool_errors: bool,
    defaults: Option<Defaults>,
    /// Tools given with [`Policy::tool`]: protected whatever their annotations say.
    tools: Arc<HashMap<String, Tool>>,
    exempt: Arc<HashSet<String>>,
    /// Tools made from [`Policy::defaults`], on their first call.
    made: Arc<Mutex<HashMap<String, Tool>>>,
}

impl Default for Policy {
    fn default() -> Self {
        Policy::new()
    }
}

impl fmt::Debug for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Policy")
            .field("store", &self.store.as_ref().map(|store| store.name()))
            .field("run_meta_key", &self.run_meta_key)
            .field("without_run", &self.without_run)
            .field("store_tool_errors", &self.store_tool_errors)
            .field("tools", &self.tools.keys().collect::<Vec<_>>())
            .field("exempt", &self.exempt)
            .finish_non_exhaustive()
    }
}

/// What to do with one `tools/call` request: see [`Policy::plan`].
#[derive(Debug)]
pub enum Plan {
    /// Forward it unchanged: the tool is read-only or exempt, or the call has no run
    /// id and the policy forwards such calls.
    Forward,
    /// Make it idempotent: [`Protected::call`].
    Protect(Protected),
}

/// A `tools/call` to make idempotent: its tool and run.
#[derive(Debug)]
pub struct Protected {
    tool: Tool,
    run: Run,
    store_tool_errors: bool,
    run_meta_key: Arc<str>,
}

/// The answer to a protected call.
#[derive(Debug)]
pub enum Answer<P> {
    /// A tool result (a `CallToolResult`'s JSON): run now, or replayed, with
    /// `_meta["idem/replayed"] = true`.
    Result(Value),
    /// What the forward gave that is not a tool result (a JSON-RPC error, an upstream
    /// that went away): not stored, passed back as it is.
    Unstored(P),
    /// idem could not make the call safe (no run id, the store is down, the key's
    /// arguments differ, ...): answer with [`rpc_error`]'s JSON-RPC error.
    Refused(Error),
}

/// The error type of a protected call's body: what cannot be stored.
enum Unstored<P> {
    Idem(Error),
    /// A tool result with `isError: true`, under a policy that does not store them.
    ToolError(Value),
    Forwarded(P),
}

impl<P> From<Error> for Unstored<P> {
    fn from(error: Error) -> Self {
        Unstored::Idem(error)
    }
}

impl Policy {
    /// The default policy: every tool not declared read-only is protected, the run id
    /// is read from `_meta["idem/run"]`, calls without one are refused, tool errors are
    /// not stored, and records go to idem's default store.
    pub fn new() -> Self {
        Policy {
            store: None,
            run_meta_key: RUN_META_KEY.into(),
            without_run: WithoutRun::Refuse,
            store_tool_errors: false,
            defaults: None,
            tools: Arc::default(),
            exempt: Arc::default(),
            made: Arc::default(),
        }
    }

    /// Keeps the records in `store` (by default, idem's default store).
    pub fn store(self, store: impl Store) -> Self {
        self.shared_store(Arc::new(store))
    }

    /// Keeps the records in a store shared with other code.
    pub fn shared_store(mut self, store: Arc<dyn Store>) -> Self {
        self.store = Some(store);
        self
    }

    /// Reads the run id from the request's `_meta[name]` instead of
    /// `_meta["idem/run"]`.
    pub fn run_meta_key(mut self, name: impl Into<Arc<str>>) -> Self {
        self.run_meta_key = name.into();
        self
    }

    /// What a protected call without a run id gets (by default, refused).
    pub fn without_run(mut self, without_run: WithoutRun) -> Self {
        self.without_run = without_run;
        self
    }

    /// Stores a tool result with `isError: true` like any other, so retries get it
    /// instead of running the tool again (for errors a retry cannot fix). By default
    /// it is not stored.
    pub fn store_tool_errors(mut self) -> Self {
        self.store_tool_errors = true;
        self
    }

    /// The options of every protected tool: `make` gets a [`Tool`] with the tool's name
    /// and idem's default options, and sets any (`|tool| tool.ttl(DAY)`). Not applied
    /// to the tools given with [`Policy::tool`].
    pub fn defaults(mut self, make: impl Fn(Tool) -> Tool + Send + Sync + 'static) -> Self {
        self.defaults = Some(Arc::new(make));
        self
    }

    /// Protects the tool named `tool.name()` with `tool`'s options, whatever its
    /// annotations say (a read-only tool included).
    pub fn tool(mut self, tool: Tool) -> Self {
        let name = tool.name().to_owned();
        Arc::make_mut(&mut self.exempt).remove(&name);
        Arc::make_mut(&mut self.tools).insert(name, tool);
        self
    }

    /// Leaves the tool named `name` unprotected: its calls are forwarded unchanged.
    pub fn exempt(mut self, name: impl Into<String>) -> Self {
        let name = name.into();
        Arc::make_mut(&mut self.tools).remove(&name);
        Arc::make_mut(&mut self.exempt).insert(name);
        self
    }

    /// The `_meta` field the run id is read from.
    pub fn run_key(&self) -> &str {
        &self.run_meta_key
    }

    /// Whether calls of the tool `name` are protected, given its `readOnlyHint`
    /// (`None`: not declared, or the tool is unknown).
    pub fn protects(&self, name: &str, read_only_hint: Option<bool>) -> bool {
        if self.tools.contains_key(name) {
            return true;
        }
        !self.exempt.contains(name) && read_only_hint != Some(true)
    }

    /// Marks the tools of a `tools/list` result (its `tools` array, as JSON) that this
    /// policy protects with `annotations.idempotentHint: true`.
    pub fn mark_listed(&self, tools: &mut [Value]) {
        for tool in tools {
            let Some(tool) = tool.as_object_mut() else {
                continue;
            };
            let Some(name) = tool.get("name").and_then(Value::as_str) else {
                continue;
            };
            if !self.protects(name, read_only_hint(tool)) {
                continue;
            }
            let annotations = tool
                .entry("annotations")
                .or_insert_with(|| Value::Object(Map::new()));
            if let Some(annotations) = annotations.as_object_mut() {
                annotations.insert("idempotentHint".to_owned(), Value::Bool(true));
            }
        }
    }

    /// What to do with a `tools/call` of the tool `name` (whose `readOnlyHint` is
    /// `read_only_hint`) with the request's `_meta`.
    pub fn plan(
        &self,
        name: &str,
        read_only_hint: Option<bool>,
        meta: Option<&Map<String, Value>>,
    ) -> Plan {
        if !self.protects(name, read_only_hint) {
            return Plan::Forward;
        }
        // Absent, not a string, or blank: no run id.
        let run_id = meta
            .and_then(|meta| meta.get(&*self.run_meta_key))
            .and_then(Value::as_str)
            .filter(|id| !is_blank(id));
        if run_id.is_none() && self.without_run == WithoutRun::Forward {
            return Plan::Forward;
        }
        // No run id: a run with a blank one, which the call refuses (`Error::NoRun`).
        let run = Run::new(run_id.unwrap_or(""));
        let run = match &self.store {
            Some(store) => run.with_shared_store(Arc::clone(store)),
            None => run,
        };
        Plan::Protect(Protected {
            tool: self.tool_named(name),
            run,
            store_tool_errors: self.store_tool_errors,
            run_meta_key: Arc::clone(&self.run_meta_key),
        })
    }

    /// The tool `name` with its options: given, or made from the defaults once.
    fn tool_named(&self, name: &str) -> Tool {
        if let Some(tool) = self.tools.get(name) {
            return tool.clone();
        }
        let Some(defaults) = &self.defaults else {
            return Tool::new(name);
        };
        let mut made = self
            .made
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        made.entry(name.to_owned())
            .or_insert_with(|| defaults(Tool::new(name)))
            .clone()
    }
}

impl Protected {
    /// The tool, with its options.
    pub fn tool(&self) -> &Tool {
        &self.tool
    }

    /// The run the call belongs to.
    pub fn run(&self) -> &Run {
        &self.run
    }

    /// Makes the call: runs `forward` (which calls the tool and gives its
    /// `CallToolResult` as JSON, or `Err` with anything that is not one) at most once
    /// per key within the TTL, and answers with its result, run now or replayed.
    ///
    /// `arguments` is the request's `arguments` (absent is `{}`). What `forward`
    /// returns is stored unless it is an `Err` or, by default, a result with
    /// `isError: true`.
    pub async fn call<P, F, Fut>(
        self,
        arguments: Option<&Map<String, Value>>,
        forward: F,
    ) -> Answer<P>
    where
        P: Send + 'static,
        F: FnOnce() -> Fut + Send,
        Fut: Future<Output = Result<Value, P>> + Send + 'static,
    {
        let empty = Map::new();
        let arguments = arguments.unwrap_or(&empty);
        let store_tool_errors = self.store_tool_errors;
        let limit = self
            .run
            .store()
            .map_or(usize::MAX, |s| s.max_result_bytes());
        // A result too large to store: this caller gets it from here.
        let too_large: Arc<Mutex<Option<Value>>> = Arc::default();
        let kept = Arc::clone(&too_large);
        let call = self.tool.call(&self.run, arguments, move |key| {
            let forwarded = forward();
            async move {
                match forwarded.await {
                    Ok(result) if is_tool_error(&result) && !store_tool_errors => {
                        Err(Unstored::ToolError(result))
                    }
                    Ok(result) => Ok(within_limit(result, limit, &key, &kept)),
                    Err(other) => Err(Unstored::Forwarded(other)),
                }
            }
        });
        let (answer, report) = observe(call).await;
        match answer {
            Ok(mut result) => {
                if let Some(whole) = lock(&too_large).take() {
                    return Answer::Result(whole);
                }
                if report.is_some_and(|report| report.replayed()) {
                    mark_replayed(&mut result);
                }
                Answer::Result(result)
            }
            Err(Unstored::ToolError(result)) => Answer::Result(result),
            Err(Unstored::Forwarded(other)) => Answer::Unstored(other),
            Err(Unstored::Idem(error)) => Answer::Refused(error),
        }
    }

    /// The JSON-RPC error (code, message) for an [`Answer::Refused`] error of this
    /// call: see [`rpc_error`].
    pub fn rpc_error(&self, error: &Error) -> (i64, String) {
        rpc_error(error, &self.run_meta_key)
    }
}

/// The JSON-RPC error (code, message) for an error idem answered a protected call
/// with: `invalid params` for the client's mistakes (no run id, where `run_meta_key`
/// names the `_meta` field it goes in; arguments that differ under one key), else
/// `internal error` with idem's message.
pub fn rpc_error(error: &Error, run_meta_key: &str) -> (i64, String) {
    match error {
        Error::NoRun { tool, .. } => (
            INVALID_PARAMS,
            format!(
                "`{tool}` has side effects and needs the agent's run id: send it as a \
                 non-empty string in the request's _meta[\"{run_meta_key}\"], the same on \
                 every retry"
            ),
        ),
        Error::PayloadMismatch { .. } | Error::Input { .. } => (INVALID_PARAMS, error.to_string()),
        other => (INTERNAL_ERROR, other.to_string()),
    }
}

/// `result`, if it is within the store's `limit`; else a stand-in to store in its
/// place (a tool error that says the call ran and its result is not replayed), with
/// `result` kept for the caller that ran it. So the tool never runs twice for want of
/// room, and a retry is told the truth.
fn within_limit(result: Value, limit: usize, key: &Key, kept: &Mutex<Option<Value>>) -> Value {
    let size = serde_json::to_vec(&result).map_or(0, |bytes| bytes.len());
    if size <= limit {
        return result;
    }
    tracing::warn!(%key, size, limit, "idem: a tool result is over the store's limit; the caller gets it, and retries get a tool error that says it ran");
    *lock(kept) = Some(result);
    let text = format!(
        "this call ran (idempotency key {key}), but its result ({size} bytes) is over the \
         store's limit ({limit} bytes), so it was given to the first call only and is not \
         replayed; the tool is not run again"
    );
    serde_json::json!({"content": [{"type": "text", "text": text}], "isError": true})
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Whether a `tools/call` result is the call's outcome (`resultType` absent or
/// `"complete"`), to store; not a request for the client's input
/// (`"input_required"`) nor a task to poll (`"task"`), which the next round or poll
/// completes.
pub fn is_outcome(result: &Value) -> bool {
    match result.get("resultType") {
        None => true,
        Some(kind) => kind == "complete",
    }
}

/// A tool's `annotations.readOnlyHint`, from its `tools/list` entry.
pub fn read_only_hint(tool: &Map<String, Value>) -> Option<bool> {
    tool.get("annotations")?.get("readOnlyHint")?.as_bool()
}

/// Whether a `CallToolResult`'s JSON says `isError: true`.
fn is_tool_error(result: &Value) -> bool {
    result.get("isError").and_then(Value::as_bool) == Some(true)
}

/// Sets `_meta["idem/replayed"] = true` on a `CallToolResult`'s JSON.
fn mark_replayed(result: &mut Value) {
    let Some(result) = result.as_object_mut() else {
        return;
    };
    let meta = result
        .entry("_meta")
        .or_insert_with(|| Value::Object(Map::new()));
    if let Some(meta) = meta.as_object_mut() {
        meta.insert(REPLAYED_META_KEY.to_owned(), Value::Bool(true));
    }
}
