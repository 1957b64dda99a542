//! A tool registry with no attribute: three tools registered at run time, looked up by
//! name, called with JSON arguments, as an agent framework or an MCP server that
//! forwards calls would. The agent's first call of each times out after the side effect;
//! its retry gets the first result, and each side effect happened once.
//!
//! ```sh
//! cargo run --example tool_registry
//! ```
//!
//! Runs on an in-memory store, so it leaves nothing behind; `Run::new(..)` alone would
//! use the embedded default store, as the attribute does.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem::{Error, Key, MemoryStore, Run, Tool};
use serde_json::{json, Value};

/// A tool's body: JSON arguments and the call's key in, a JSON result out.
type Body = Arc<
    dyn Fn(Key, Value) -> Pin<Box<dyn Future<Output = Result<Value, Error>> + Send>> + Send + Sync,
>;

/// Tools by name, each an idempotent [`Tool`] and its body.
#[derive(Default)]
struct Registry {
    tools: HashMap<String, (Tool, Body)>,
}

impl Registry {
    fn register<F, Fut>(&mut self, tool: Tool, body: F)
    where
        F: Fn(Key, Value) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Value, Error>> + Send + 'static,
    {
        let body: Body = Arc::new(move |key, args| Box::pin(body(key, args)));
        self.tools.insert(tool.name().to_owned(), (tool, body));
    }

    /// Calls the tool named `name` with `args`, at most once per (run, tool, args).
    async fn call(&self, run: &Run, name: &str, args: Value) -> Result<Value, Error> {
        let Some((tool, body)) = self.tools.get(name) else {
            return Ok(json!({ "error": format!("no tool named {name}") }));
        };
        let body = Arc::clone(body);
        let input = args.clone();
        tool.call(run, &args, move |key| body(key, input)).await
    }
}

/// How often each side effect really happened.
#[derive(Clone, Default)]
struct Effects(Arc<[AtomicUsize; 3]>);

impl Effects {
    fn happened(&self, i: usize) -> usize {
        self.0[i].fetch_add(1, Ordering::SeqCst) + 1
    }
    fn count(&self, i: usize) -> usize {
        self.0[i].load(Ordering::SeqCst)
    }
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let effects = Effects::default();
    let slow = Duration::from_millis(300);
    let mut registry = Registry::default();
    let e = effects.clone();
    registry.register(
        Tool::new("send_email").ttl(Duration::from_secs(24 * 60 * 60)),
        move |key, args| {
            let n = e.happened(0);
            async move {
                tokio::time::sleep(slow).await; // the provider answers slowly
                Ok(json!({ "message_id": format!("msg-{n}"), "to": args["to"], "idempotency_key": key.to_string() }))
            }
        },
    );
    let e = effects.clone();
    registry.register(
        Tool::new("charge_card").at_most_once().key(["order"]),
        move |_key, args| {
            let n = e.happened(1);
            async move {
                tokio::time::sleep(slow).await;
                Ok(json!({ "charge": format!("ch-{n}"), "cents": args["cents"] }))
            }
        },
    );
    let e = effects.clone();
    registry.register(
        Tool::new("create_ticket").ttl(Duration::from_secs(60 * 60)),
        move |_key, args| {
            let n = e.happened(2);
            async move {
                tokio::time::sleep(slow).await;
                Ok(json!({ "ticket": n, "title": args["title"] }))
            }
        },
    );

    let run = Run::new("agent-run-7").with_store(MemoryStore::new());
    let calls = [
        (
            "send_email",
            json!({ "to": "ada@example.com", "subject": "Your receipt" }),
        ),
        ("charge_card", json!({ "order": "A-1001", "cents": 4200 })),
        (
            "create_ticket",
            json!({ "title": "Refund request", "priority": 2 }),
        ),
    ];
    println!(
        "{:<14} {:<30} {:<30} side effects",
        "tool", "first call", "retry"
    );
    for (i, (name, args)) in calls.into_iter().enumerate() {
        // The agent gives up after 100 ms: the body goes on and records its result.
        let first = tokio::time::timeout(
            Duration::from_millis(100),
            registry.call(&run, name, args.clone()),
        )
        .await;
        let first = match first {
            Ok(value) => value?.to_string(),
            Err(_) => "timed out".to_owned(),
        };
        // The retry, with the same arguments.
        let retry = registry.call(&run, name, args).await?;
        let shown = retry.to_string();
        println!(
            "{name:<14} {first:<30} {:<30} {}",
            &shown[..shown.len().min(30)],
            effects.count(i)
        );
        assert_eq!(effects.count(i), 1, "{name} ran twice");
    }
    Ok(())
}
