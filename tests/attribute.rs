//! `#[idempotent]` as a user writes it: how often each body really ran, and what every
//! caller got back.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use idem::{idempotent, Error, MemoryStore, Run};
use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
enum ToolError {
    #[error(transparent)]
    Idem(#[from] Error),
    #[error("provider said no: {0}")]
    Provider(String),
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct SendEmail {
    to: String,
    subject: String,
}

fn email(to: &str, subject: &str) -> SendEmail {
    SendEmail {
        to: to.into(),
        subject: subject.into(),
    }
}

fn run(id: &str) -> Run {
    Run::new(id).with_store(MemoryStore::new())
}

static SENT: AtomicUsize = AtomicUsize::new(0);

#[idempotent(ttl = "24h")]
async fn send_email(input: SendEmail) -> Result<String, ToolError> {
    let n = SENT.fetch_add(1, Ordering::SeqCst);
    Ok(format!("msg-{n}-{}", input.to))
}

#[tokio::test]
async fn async_tool_in_a_scoped_run_runs_once() {
    let before = SENT.load(Ordering::SeqCst);
    let run = run("scoped");
    let a = run.scope(send_email(email("ada@x", "hi"))).await.unwrap();
    let b = run.scope(send_email(email("ada@x", "hi"))).await.unwrap();
    assert_eq!(a, b);
    // Another input, and another run, run again.
    run.scope(send_email(email("bob@x", "hi"))).await.unwrap();
    Run::new("scoped-2")
        .with_store(MemoryStore::new())
        .scope(send_email(email("ada@x", "hi")))
        .await
        .unwrap();
    assert_eq!(SENT.load(Ordering::SeqCst) - before, 3);
}

#[tokio::test]
async fn no_run_is_an_error_and_nothing_runs() {
    let before = SENT.load(Ordering::SeqCst);
    let err = send_email(email("ada@x", "hi")).await.unwrap_err();
    assert!(
        matches!(err, ToolError::Idem(Error::NoRun { ref tool, blank_id: None }) if tool == "attribute::send_email")
    );
    assert_eq!(SENT.load(Ordering::SeqCst), before);
}

#[idempotent(name = "charge_card", at_most_once)]
fn charge(run: &Run, card: &str, cents: u64, counter: &Counter) -> Result<String, ToolError> {
    let _ = run;
    counter.bump();
    Ok(format!(
        "ch_{card}_{cents}_{}",
        idem::current_key().unwrap()
    ))
}

/// Counts side effects; serializes to nothing, so it does not change the key.
#[derive(Default, Clone)]
struct Counter(Arc<AtomicUsize>);
impl Counter {
    fn bump(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst)
    }
    fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}
impl Serialize for Counter {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_unit()
    }
}

#[test]
fn sync_tool_with_an_explicit_run_argument() {
    let run = run("explicit");
    let counter = Counter::default();
    let a = charge(&run, "4242", 500, &counter).unwrap();
    let b = charge(&run, "4242", 500, &counter).unwrap();
    assert_eq!((a.as_str(), counter.get()), (b.as_str(), 1));
    // The key the body saw is the one named after `name`, not the function.
    assert!(a.contains("charge_card."), "{a}");
    charge(&run, "4242", 700, &counter).unwrap();
    assert_eq!(counter.get(), 2);
}

#[idempotent]
fn sync_ambient(x: u32, counter: &Counter) -> Result<u32, Error> {
    counter.bump();
    Ok(x * 2)
}

#[test]
fn sync_tool_in_a_sync_scope() {
    let run = run("sync-scope");
    let counter = Counter::default();
    let v = run.sync_scope(|| sync_ambient(21, &counter)).unwrap();
    let w = run.sync_scope(|| sync_ambient(21, &counter)).unwrap();
    assert_eq!((v, w, counter.get()), (42, 42, 1));
    assert!(matches!(
        sync_ambient(21, &counter),
        Err(Error::NoRun { .. })
    ));
}

#[idempotent(key = [input.to], skip = [counter])]
async fn keyed_by_recipient(input: SendEmail, counter: Counter) -> Result<usize, ToolError> {
    Ok(counter.bump())
}

#[tokio::test]
async fn key_from_some_fields_and_payload_mismatch() {
    let run = run("keyed");
    let counter = Counter::default();
    let first = run
        .scope(keyed_by_recipient(email("ada@x", "one"), counter.clone()))
        .await
        .unwrap();
    let err = run
        .scope(keyed_by_recipient(email("ada@x", "two"), counter.clone()))
        .await
        .unwrap_err();
    assert!(
        matches!(err, ToolError::Idem(Error::PayloadMismatch { .. })),
        "{err}"
    );
    let again = run
        .scope(keyed_by_recipient(email("ada@x", "one"), counter.clone()))
        .await
        .unwrap();
    assert_eq!((first, again, counter.get()), (0, 0, 1));
}

#[idempotent(skip = [counter])]
async fn flaky(attempt_fails: bool, counter: Counter) -> Result<usize, ToolError> {
    let n = counter.bump();
    if attempt_fails && n == 0 {
        return Err(ToolError::Provider("timeout".into()));
    }
    Ok(n)
}

#[tokio::test]
async fn errors_release_the_key_by_default() {
    let run = run("errors");
    let counter = Counter::default();
    let err = run.scope(flaky(true, counter.clone())).await.unwrap_err();
    assert!(matches!(err, ToolError::Provider(_)));
    assert_eq!(run.scope(flaky(true, counter.clone())).await.unwrap(), 1);
    assert_eq!(run.scope(flaky(true, counter.clone())).await.unwrap(), 1);
    assert_eq!(counter.get(), 2);
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
enum Declined {
    Card(String),
    Idem(String),
}
impl From<Error> for Declined {
    fn from(e: Error) -> Self {
        Declined::Idem(e.to_string())
    }
}

#[idempotent(cache_errors, skip = [counter])]
async fn decline(card: String, counter: Counter) -> Result<u32, Declined> {
    counter.bump();
    Err(Declined::Card(card))
}

#[tokio::test]
async fn errors_are_replayed_when_cached() {
    let run = run("cached-errors");
    let counter = Counter::default();
    for _ in 0..3 {
        let err = run.scope(decline("4000".into(), counter.clone())).await;
        assert_eq!(err, Err(Declined::Card("4000".into())));
    }
    assert_eq!(counter.get(), 1);
}

struct Mailer {
    sent: Counter,
}

impl Mailer {
    #[idempotent]
    async fn send(&self, to: &str) -> Result<usize, ToolError> {
        Ok(self.sent.bump())
    }

    #[idempotent(name = "mailer_bump")]
    fn bump(&mut self, by: usize) -> Result<usize, ToolError> {
        Ok(self.sent.bump() + by)
    }
}

/// A mailer whose tool name is data: `name = ...` takes any expression that gives a
/// `&str`, also one that borrows from `self` or from an argument.
struct NamedMailer {
    name: String,
    sent: Counter,
}

impl NamedMailer {
    const KIND: &'static str = "mailer_kind";

    #[idempotent(name = &self.name)]
    async fn send(&self, to: &str) -> Result<String, ToolError> {
        self.sent.bump();
        Ok(idem::current_key().unwrap().to_string())
    }

    #[idempotent(name = self.name.as_str())]
    fn send_now(&self, to: &str) -> Result<String, ToolError> {
        self.sent.bump();
        Ok(idem::current_key().unwrap().to_string())
    }

    #[idempotent(name = Self::KIND)]
    async fn send_kind(&self, to: &str) -> Result<String, ToolError> {
        self.sent.bump();
        Ok(idem::current_key().unwrap().to_string())
    }
}

#[idempotent(name = tool, skip = [tool, counter])]
async fn named_by_argument(tool: &str, to: String, counter: &Counter) -> Result<String, ToolError> {
    counter.bump();
    Ok(idem::current_key().unwrap().to_string())
}

#[tokio::test]
async fn tool_names_may_borrow_from_the_call() {
    let run = run("named");
    let mailer = NamedMailer {
        name: "mailer one".into(),
        sent: Counter::default(),
    };
    let (a, b) = (
        run.scope(mailer.send("ada@x")).await.unwrap(),
        run.scope(mailer.send("ada@x")).await.unwrap(),
    );
    assert_eq!((a.as_str(), mailer.sent.get()), (b.as_str(), 1));
    assert!(a.starts_with("mailer_one."), "{a}");
    let now = run.sync_scope(|| mailer.send_now("ada@x")).unwrap();
    assert_eq!(now, a, "the same name and input: the same key, replayed");
    let kind = run.scope(mailer.send_kind("ada@x")).await.unwrap();
    assert!(kind.starts_with("mailer_kind."), "{kind}");
    assert_eq!(mailer.sent.get(), 2);

    let counter = Counter::default();
    for tool in ["by_argument", "by_argument", "another"] {
        let name = String::from(tool);
        let key = run
            .scope(named_by_argument(&name, "ada@x".into(), &counter))
            .await
            .unwrap();
        assert!(key.starts_with(&format!("{tool}.")), "{key}");
    }
    assert_eq!(counter.get(), 2, "one run per name");
}

#[tokio::test]
async fn methods_leave_the_receiver_out_of_the_key() {
    let run = run("methods");
    let a = Mailer {
        sent: Counter::default(),
    };
    let b = Mailer {
        sent: a.sent.clone(),
    };
    run.scope(a.send("ada@x")).await.unwrap();
    run.scope(b.send("ada@x")).await.unwrap();
    assert_eq!(a.sent.get(), 1);
    let mut m = Mailer {
        sent: Counter::default(),
    };
    let x = run.sync_scope(|| m.bump(10)).unwrap();
    let y = run.sync_scope(|| m.bump(10)).unwrap();
    assert_eq!((x, y, m.sent.get()), (10, 10, 1));
}

/// Two tools whose methods are both called `call`, with the same arguments.
trait Tool {
    fn call(&self, args: u32) -> Result<String, Error>;
}
struct Weather;
struct Stocks;
impl Tool for Weather {
    #[idempotent]
    fn call(&self, args: u32) -> Result<String, Error> {
        Ok(format!("weather {args} {}", idem::current_key().unwrap()))
    }
}
impl Tool for Stocks {
    #[idempotent]
    fn call(&self, args: u32) -> Result<String, Error> {
        Ok(format!("stocks {args} {}", idem::current_key().unwrap()))
    }
}

#[test]
fn same_method_name_on_two_types_is_two_tools() {
    let run = run("two-tools");
    let w = run.sync_scope(|| Weather.call(1)).unwrap();
    let s = run.sync_scope(|| Stocks.call(1)).unwrap();
    assert!(
        w.starts_with("weather") && s.starts_with("stocks"),
        "{w} / {s}"
    );
}

#[idempotent]
async fn generic_tool<T: Serialize + Send + Sync>(
    item: T,
    tag: impl Serialize + Send,
) -> Result<String, Error> {
    Ok(serde_json::to_string(&item).unwrap())
}

#[tokio::test]
async fn generic_and_impl_trait_arguments() {
    let run = run("generic");
    let a = run.scope(generic_tool(vec![1, 2], "t")).await.unwrap();
    let b = run.scope(generic_tool("s", 5)).await.unwrap();
    assert_eq!((a.as_str(), b.as_str()), ("[1,2]", "\"s\""));
}

#[idempotent]
async fn inner_tool(n: u32, counter: &Counter) -> Result<String, Error> {
    counter.bump();
    Ok(idem::current_key().unwrap().to_string())
}

#[idempotent]
async fn outer_tool(n: u32, counter: &Counter) -> Result<(String, String, String), Error> {
    counter.bump();
    let before = idem::current_key().unwrap().to_string();
    let inner = inner_tool(n, counter).await?;
    Ok((before, inner, idem::current_key().unwrap().to_string()))
}

#[tokio::test]
async fn nested_tools_are_keyed_separately() {
    let run = run("nested");
    let counter = Counter::default();
    let (outer, inner, after) = run.scope(outer_tool(1, &counter)).await.unwrap();
    assert_ne!(outer, inner);
    assert_eq!(outer, after);
    assert!(
        outer.starts_with("attribute__outer_tool.") && inner.starts_with("attribute__inner_tool.")
    );
    run.scope(outer_tool(1, &counter)).await.unwrap();
    // Inner directly, with the same input, is a replay of the nested call.
    assert_eq!(run.scope(inner_tool(1, &counter)).await.unwrap(), inner);
    assert_eq!(counter.get(), 2);
}

#[async_trait::async_trait]
trait AsyncTool {
    async fn call(&self, args: SendEmail) -> Result<String, ToolError>;
}

struct AsyncMailer(Counter);

#[async_trait::async_trait]
impl AsyncTool for AsyncMailer {
    #[idempotent(name = "async_mailer")]
    async fn call(&self, args: SendEmail) -> Result<String, ToolError> {
        let n = self.0.bump();
        Ok(format!("{n} {}", args.to))
    }
}

#[tokio::test]
async fn methods_of_async_trait_impls() {
    let run = run("async-trait");
    let tool: Box<dyn AsyncTool + Send + Sync> = Box::new(AsyncMailer(Counter::default()));
    // The future is created outside the scope and first polled inside it.
    let fut = tool.call(email("ada@x", "hi"));
    let a = run.scope(fut).await.unwrap();
    let b = run.scope(tool.call(email("ada@x", "hi"))).await.unwrap();
    assert_eq!(a, b);
    assert!(matches!(
        tool.call(email("ada@x", "hi")).await,
        Err(ToolError::Idem(Error::NoRun { .. }))
    ));
}

#[derive(Debug, PartialEq)]
struct PlainError(String);

fn to_plain(e: Error) -> PlainError {
    PlainError(format!("idem: {e}"))
}

#[idempotent(map_error = to_plain, fail_fast)]
async fn mapped(x: u8) -> Result<u8, PlainError> {
    Ok(x)
}

#[tokio::test]
async fn map_error_converts_idem_errors() {
    let err = mapped(1).await.unwrap_err();
    assert!(err.0.starts_with("idem: no run"), "{err:?}");
}

#[idempotent(lease = "100ms", wait = "2s")]
async fn slow(x: u8, counter: &Counter) -> Result<usize, Error> {
    let n = counter.bump();
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    Ok(n + usize::from(x))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_execute_once() {
    let run = run("concurrent");
    let counter = Counter::default();
    let tasks: Vec<_> = (0..64)
        .map(|_| {
            let (run, counter) = (run.clone(), counter.clone());
            tokio::spawn(async move { run.scope(slow(7, &counter)).await })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap().unwrap(), 7);
    }
    assert_eq!(counter.get(), 1);
}

/// A crate that re-exports idem under another path.
mod reexport {
    pub use idem as engine;
}

#[idempotent(crate = "crate::reexport::engine")]
async fn through_a_reexport(x: u8) -> Result<u8, Error> {
    Ok(x)
}

#[tokio::test]
async fn crate_option_points_generated_code_elsewhere() {
    assert_eq!(
        run("reexport").scope(through_a_reexport(3)).await.unwrap(),
        3
    );
}

/// A wrapper like rmcp's `Parameters<T>`, destructured in the signature.
#[derive(Serialize)]
struct Parameters<T>(T);

#[idempotent(skip = [counter])]
async fn destructured(
    Parameters(input): Parameters<SendEmail>,
    (a, b): (u8, u8),
    counter: &Counter,
) -> Result<String, Error> {
    counter.bump();
    Ok(format!("{} {a} {b}", input.to))
}

#[tokio::test]
async fn destructured_arguments_are_keyed_by_what_they_bind() {
    let run = run("patterns");
    let counter = Counter::default();
    let call = |to: &str, a: u8| destructured(Parameters(email(to, "s")), (a, 2), &counter);
    let first = run.scope(call("ada@x", 1)).await.unwrap();
    assert_eq!(run.scope(call("ada@x", 1)).await.unwrap(), first);
    run.scope(call("bob@x", 1)).await.unwrap();
    run.scope(call("ada@x", 9)).await.unwrap();
    assert_eq!(counter.get(), 3);
}

/// A request context, as an MCP server or an agent framework passes one: it may carry
/// the run id in its metadata.
struct RequestContext {
    run_id: Option<String>,
    store: MemoryStore,
}

impl RequestContext {
    fn run(&self) -> Option<Run> {
        let id = self.run_id.as_ref()?;
        Some(Run::new(id.clone()).with_store(self.store.clone()))
    }
}

#[idempotent(run = ctx.run(), skip = [ctx, counter])]
async fn from_request(to: String, ctx: &RequestContext, counter: &Counter) -> Result<usize, Error> {
    Ok(counter.bump())
}

#[tokio::test]
async fn the_run_can_come_from_a_request_context() {
    let store = MemoryStore::new();
    let counter = Counter::default();
    let ctx = |id: Option<&str>| RequestContext {
        run_id: id.map(str::to_owned),
        store: store.clone(),
    };
    let a = ctx(Some("run-a"));
    assert_eq!(from_request("x".into(), &a, &counter).await.unwrap(), 0);
    assert_eq!(from_request("x".into(), &a, &counter).await.unwrap(), 0);
    assert_eq!(
        from_request("x".into(), &ctx(Some("run-b")), &counter)
            .await
            .unwrap(),
        1
    );
    // No run id in the request: the ambient run, and without one, `NoRun`.
    let none = ctx(None);
    let err = from_request("x".into(), &none, &counter).await.unwrap_err();
    assert!(matches!(err, Error::NoRun { .. }), "{err}");
    let ambient = run("ambient");
    assert_eq!(
        ambient
            .scope(from_request("x".into(), &none, &counter))
            .await
            .unwrap(),
        2
    );
    assert_eq!(counter.get(), 3);
}
