//! What an operator sees of real calls: the `execute_tool` span of each (its name,
//! OpenTelemetry attributes and `idem.outcome`, for every outcome), idem's events inside
//! it, the agent's span around it, and what `idem::observe` tells the caller.
//!
//! A capturing `tracing` layer records every span that closes, with its fields and the
//! events fired inside it; each test installs its own, for its thread (and the threads
//! it starts), so tests running side by side do not see each other's calls.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem::{idempotent, CallOutcome, Error, MemoryStore, Run};
use idem_testkit::faults::Down;
use serde::{Deserialize, Serialize};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record as Values};
use tracing::{Dispatch, Event, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

// ----- The capturing layer ------------------------------------------------------

/// A span that closed: its name, fields, parent's name and the events inside it (each
/// with all its fields, written out).
#[derive(Debug, Clone, Default)]
struct Closed {
    name: &'static str,
    fields: BTreeMap<String, String>,
    parent: Option<&'static str>,
    events: Vec<String>,
}

impl Closed {
    fn field(&self, name: &str) -> Option<&str> {
        self.fields.get(name).map(String::as_str)
    }
    fn outcome(&self) -> &str {
        self.field("idem.outcome").unwrap_or("<none>")
    }
}

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<Closed>>>);

impl Capture {
    /// A dispatcher that records into this capture, and nothing else.
    fn dispatch(&self) -> Dispatch {
        Dispatch::new(tracing_subscriber::registry().with(self.clone()))
    }

    /// The `execute_tool` spans of `tool` that closed, in order.
    fn calls(&self, tool: &str) -> Vec<Closed> {
        let closed = self.0.lock().unwrap();
        closed
            .iter()
            .filter(|s| s.name == "execute_tool" && s.field("gen_ai.tool.name") == Some(tool))
            .cloned()
            .collect()
    }

    fn outcomes(&self, tool: &str) -> Vec<String> {
        self.calls(tool)
            .iter()
            .map(|s| s.outcome().to_owned())
            .collect()
    }
}

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let span = ctx.span(id).expect("a new span is known");
        let mut closed = Closed {
            name: attrs.metadata().name(),
            parent: span.parent().map(|p| p.name()),
            ..Closed::default()
        };
        attrs.record(&mut Fields(&mut closed.fields));
        span.extensions_mut().insert(closed);
    }

    fn on_record(&self, id: &Id, values: &Values<'_>, ctx: Context<'_, S>) {
        let span = ctx.span(id).expect("a recorded span is known");
        let mut extensions = span.extensions_mut();
        if let Some(closed) = extensions.get_mut::<Closed>() {
            values.record(&mut Fields(&mut closed.fields));
        }
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.event_span(event) else {
            return;
        };
        let mut fields = BTreeMap::new();
        event.record(&mut Fields(&mut fields));
        let mut written = fields.remove("message").unwrap_or_default();
        for (name, value) in fields {
            written.push_str(&format!(" {name}={value}"));
        }
        let mut extensions = span.extensions_mut();
        if let Some(closed) = extensions.get_mut::<Closed>() {
            closed.events.push(written);
        }
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let span = ctx.span(&id).expect("a closing span is known");
        let closed = span.extensions_mut().remove::<Closed>();
        if let Some(closed) = closed {
            self.0.lock().unwrap().push(closed);
        }
    }
}

/// Runs `test` on a current-thread runtime with `capture` as this thread's subscriber.
fn with_capture<F: std::future::Future>(capture: &Capture, test: F) -> F::Output {
    let _default = tracing::dispatcher::set_default(&capture.dispatch());
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(test)
}

// ----- Tools ----------------------------------------------------------------------

/// The provider's side: every delivery really happens, and is counted.
#[derive(Clone, Default)]
struct Provider(Arc<AtomicUsize>);

impl Provider {
    fn deliver(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }
    fn delivered(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Email {
    to: String,
    body: String,
}

fn email(to: &str) -> Email {
    Email {
        to: to.into(),
        body: "the secret launch date is 2027-01-12".into(),
    }
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
enum ToolError {
    Rejected(String),
    Idem(String),
}

impl From<Error> for ToolError {
    fn from(error: Error) -> Self {
        ToolError::Idem(error.kind().to_owned())
    }
}

#[idempotent(name = "send_email", skip = [provider], on_cancel = "finish")]
async fn send_email(
    provider: Provider,
    email: Email,
    takes: Duration,
) -> Result<String, ToolError> {
    let n = provider.deliver();
    tokio::time::sleep(takes).await;
    if email.to.ends_with(".invalid") {
        return Err(ToolError::Rejected(email.to));
    }
    Ok(format!("msg-{n}"))
}

#[idempotent(name = "notify", key = [to], skip = [provider], fail_fast)]
async fn notify(provider: Provider, to: String, text: String) -> Result<usize, Error> {
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = text;
    Ok(provider.deliver())
}

#[idempotent(name = "charge", at_most_once, skip = [provider, panics])]
async fn charge(provider: Provider, cents: u64, panics: bool) -> Result<usize, Error> {
    let n = provider.deliver();
    assert!(
        !panics,
        "the card network went away mid-charge ({cents} cents)"
    );
    Ok(n)
}

#[idempotent(name = "measure", skip = [provider])]
async fn measure(provider: Provider, what: String) -> Result<f64, Error> {
    provider.deliver();
    let _ = what;
    Ok(f64::NAN)
}

#[idempotent(name = "hold", skip = [provider], on_cancel = "abort")]
async fn hold(provider: Provider, what: String) -> Result<usize, Error> {
    let n = provider.deliver();
    tokio::time::sleep(Duration::from_secs(30)).await;
    let _ = what;
    Ok(n)
}

/// A sync body that outlives its `max_run`: its claim is no longer renewed, so a
/// retry takes it over once the lease runs out, and its own result is fenced off.
#[idempotent(name = "export", lease = "100ms", max_run = "100ms", skip = [provider, takes])]
fn export(provider: Provider, rows: u32, takes: Duration) -> Result<usize, Error> {
    let n = provider.deliver();
    std::thread::sleep(takes);
    let _ = rows;
    Ok(n)
}

fn run() -> Run {
    Run::new("agent-run")
        .with_call_id("call-7")
        .with_store(MemoryStore::new())
}

// ----- Spans ------------------------------------------------------------------------

#[test]
fn a_call_and_its_retry_are_one_span_each_with_the_genai_attributes() {
    let capture = Capture::default();
    let provider = Provider::default();
    let run = run();
    let (first, retry) = with_capture(&capture, async {
        use tracing::Instrument;
        let agent = tracing::info_span!("agent_step");
        let call = || {
            run.scope(send_email(
                provider.clone(),
                email("ada@example.com"),
                Duration::ZERO,
            ))
            .instrument(agent.clone())
        };
        let first = call().await;
        let retry = call().await;
        (first, retry)
    });
    assert_eq!(first, Ok("msg-1".into()));
    assert_eq!(retry, Ok("msg-1".into()));
    assert_eq!(provider.delivered(), 1);

    let calls = capture.calls("send_email");
    assert_eq!(capture.outcomes("send_email"), ["executed", "replayed"]);
    for span in &calls {
        assert_eq!(span.field("otel.name"), Some("execute_tool send_email"));
        assert_eq!(span.field("gen_ai.operation.name"), Some("execute_tool"));
        assert_eq!(span.field("gen_ai.tool.call.id"), Some("call-7"));
        assert_eq!(span.field("idem.store"), Some("memory"));
        assert_eq!(span.field("error.type"), None, "{span:?}");
        assert_eq!(span.parent, Some("agent_step"), "under the agent's span");
        let key = span.field("idem.key").expect("the key is recorded");
        assert!(key.starts_with("send_email."), "{key}");
        // Neither the input nor the result is recorded anywhere.
        for value in span.fields.values() {
            assert!(
                !value.contains("ada@") && !value.contains("secret"),
                "{value}"
            );
            assert!(!value.contains("msg-1"), "{value}");
        }
    }
    assert_eq!(calls[0].field("idem.key"), calls[1].field("idem.key"));
    // idem's own events fire inside the span.
    assert!(
        calls[0].events.iter().any(|e| e.contains("miss, running")),
        "{:?}",
        calls[0].events
    );
    assert!(
        calls[1].events.iter().any(|e| e.contains("hit, replaying")),
        "{:?}",
        calls[1].events
    );
}

#[test]
fn a_duplicate_that_waited_is_waited_then_replayed_with_its_wait() {
    let capture = Capture::default();
    let provider = Provider::default();
    let run = run();
    let (a, b) = with_capture(&capture, async {
        let call = || {
            run.scope(send_email(
                provider.clone(),
                email("bob@example.com"),
                Duration::from_millis(200),
            ))
        };
        tokio::join!(call(), call())
    });
    assert_eq!((a, b), (Ok("msg-1".into()), Ok("msg-1".into())));
    assert_eq!(provider.delivered(), 1);
    let mut outcomes = capture.outcomes("send_email");
    outcomes.sort();
    assert_eq!(outcomes, ["executed", "waited_then_replayed"]);
    let waited = capture
        .calls("send_email")
        .into_iter()
        .find(|s| s.outcome() == "waited_then_replayed")
        .unwrap();
    let seconds: f64 = waited.field("idem.wait_seconds").unwrap().parse().unwrap();
    assert!((0.05..5.0).contains(&seconds), "waited {seconds} s");
}

#[test]
fn a_tool_error_is_executed_with_its_error_type() {
    let capture = Capture::default();
    let provider = Provider::default();
    let sent = with_capture(&capture, async {
        run()
            .scope(send_email(
                provider.clone(),
                email("eve@x.invalid"),
                Duration::ZERO,
            ))
            .await
    });
    assert!(matches!(sent, Err(ToolError::Rejected(_))));
    let span = &capture.calls("send_email")[0];
    assert_eq!(span.outcome(), "executed");
    assert_eq!(span.field("otel.status_code"), Some("ERROR"));
    let error_type = span.field("error.type").unwrap();
    assert!(error_type.ends_with("ToolError"), "{error_type}");
}

#[test]
fn a_mismatch_and_a_busy_key_say_so() {
    let capture = Capture::default();
    let provider = Provider::default();
    let run = run();
    let (first, busy, mismatch) = with_capture(&capture, async {
        let first = run.scope(notify(provider.clone(), "ada".into(), "hello".into()));
        let busy = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            run.scope(notify(provider.clone(), "ada".into(), "hello".into()))
                .await
        };
        let (first, busy) = tokio::join!(first, busy);
        let mismatch = run
            .scope(notify(provider.clone(), "ada".into(), "other text".into()))
            .await;
        (first, busy, mismatch)
    });
    assert_eq!(first.unwrap(), 1);
    assert!(matches!(busy, Err(Error::InProgress { .. })), "{busy:?}");
    assert!(
        matches!(mismatch, Err(Error::PayloadMismatch { .. })),
        "{mismatch:?}"
    );
    assert_eq!(provider.delivered(), 1);
    let mut outcomes = capture.outcomes("notify");
    outcomes.sort();
    assert_eq!(outcomes, ["executed", "in_progress", "payload_mismatch"]);
    for span in capture.calls("notify") {
        let expected = match span.outcome() {
            "in_progress" => Some("in_progress"),
            "payload_mismatch" => Some("payload_mismatch"),
            _ => None,
        };
        assert_eq!(span.field("error.type"), expected, "{span:?}");
    }
}

#[test]
fn a_panic_is_not_recorded_and_its_retry_is_outcome_unknown() {
    let capture = Capture::default();
    let provider = Provider::default();
    let run = run();
    let retry = with_capture(&capture, async {
        let panicked = tokio::spawn({
            let (run, provider) = (run.clone(), provider.clone());
            let dispatch = capture.dispatch();
            async move {
                use tracing::instrument::WithSubscriber;
                run.scope(charge(provider, 500, true))
                    .with_subscriber(dispatch)
                    .await
            }
        })
        .await;
        assert!(panicked.unwrap_err().is_panic());
        run.scope(charge(provider.clone(), 500, false)).await
    });
    assert!(
        matches!(retry, Err(Error::OutcomeUnknown { .. })),
        "{retry:?}"
    );
    assert_eq!(provider.delivered(), 1);
    let calls = capture.calls("charge");
    assert_eq!(
        capture.outcomes("charge"),
        ["not_recorded", "outcome_unknown"]
    );
    assert_eq!(calls[0].field("error.type"), Some("panic"));
    assert_eq!(calls[1].field("error.type"), Some("outcome_unknown"));
}

#[test]
fn a_result_that_cannot_be_stored_is_not_recorded() {
    let capture = Capture::default();
    let provider = Provider::default();
    let measured = with_capture(&capture, async {
        run().scope(measure(provider.clone(), "nan".into())).await
    });
    assert!(
        matches!(measured, Err(Error::Unreplayable { .. })),
        "{measured:?}"
    );
    let span = &capture.calls("measure")[0];
    assert_eq!(span.outcome(), "not_recorded");
    assert_eq!(span.field("error.type"), Some("unreplayable"));
}

#[test]
fn a_call_without_a_run_is_rejected() {
    let capture = Capture::default();
    let provider = Provider::default();
    let refused = with_capture(&capture, async {
        charge(provider.clone(), 100, false).await
    });
    assert!(matches!(refused, Err(Error::NoRun { .. })), "{refused:?}");
    assert_eq!(provider.delivered(), 0);
    let span = &capture.calls("charge")[0];
    assert_eq!(span.outcome(), "rejected");
    assert_eq!(span.field("error.type"), Some("no_run"));
    assert_eq!(span.field("idem.key"), None);
}

#[test]
fn a_key_asked_for_is_no_call() {
    // A map with a key that is not a string does not serialize for `key = [...]`.
    let unserializable: std::collections::HashMap<(u8, u8), u8> = [((1, 2), 3)].into();
    let capture = Capture::default();
    let run = run();
    let (key, refused, called) = with_capture(&capture, async {
        let tool = idem::Tool::new("lookup");
        let key = tool.key_of(&run, &email("ada@example.com"));
        let refused = tool.clone().key(["to"]).key_of(&run, &unserializable);
        let called = tool
            .call(&run, &email("ada@example.com"), |key| async move {
                Ok::<_, Error>(key.to_string())
            })
            .await;
        (key, refused, called)
    });
    // The key is the one a call gets, and asking for it made no call: the one span is
    // the call's.
    assert_eq!(called.unwrap(), key.unwrap().to_string());
    assert!(matches!(refused, Err(Error::Input { .. })), "{refused:?}");
    assert_eq!(capture.outcomes("lookup"), ["executed"]);
}

#[test]
fn a_dropped_call_is_cancelled_unless_its_body_runs_on() {
    let capture = Capture::default();
    let provider = Provider::default();
    let run = run();
    with_capture(&capture, async {
        // Settled when dropped: cancelled.
        let held = tokio::time::timeout(
            Duration::from_millis(100),
            run.scope(hold(provider.clone(), "a lock".into())),
        )
        .await;
        assert!(held.is_err());
        // Runs on to its end after the caller's timeout: executed.
        let sent = tokio::time::timeout(
            Duration::from_millis(50),
            run.scope(send_email(
                provider.clone(),
                email("cy@example.com"),
                Duration::from_millis(200),
            )),
        )
        .await;
        assert!(sent.is_err());
        let retry = run
            .scope(send_email(
                provider.clone(),
                email("cy@example.com"),
                Duration::from_millis(200),
            ))
            .await;
        assert_eq!(retry, Ok("msg-2".into()));
    });
    assert_eq!(provider.delivered(), 2);
    let held = &capture.calls("hold")[0];
    assert_eq!(held.outcome(), "cancelled");
    assert_eq!(held.field("error.type"), Some("cancelled"));
    let mut sent = capture.outcomes("send_email");
    sent.sort();
    assert_eq!(sent, ["executed", "waited_then_replayed"]);
}

#[test]
fn a_claim_whose_owner_stopped_renewing_is_taken_over() {
    let capture = Capture::default();
    let provider = Provider::default();
    let run = run();
    let dispatch = capture.dispatch();
    let stuck = std::thread::spawn({
        let (run, provider, dispatch) = (run.clone(), provider.clone(), dispatch.clone());
        move || {
            tracing::dispatcher::with_default(&dispatch, || {
                run.sync_scope(|| export(provider, 10, Duration::from_millis(800)))
            })
        }
    });
    // Past its max_run (100 ms) and one lease (100 ms) after its last renewal.
    std::thread::sleep(Duration::from_millis(450));
    let retry = tracing::dispatcher::with_default(&dispatch, || {
        run.sync_scope(|| export(provider.clone(), 10, Duration::ZERO))
    });
    assert_eq!(retry.unwrap(), 2);
    let stuck = stuck.join().unwrap();
    assert!(
        matches!(
            stuck,
            Err(Error::LostLease {
                lost_to: idem::LostTo::AnotherCall,
                ..
            })
        ),
        "{stuck:?}"
    );
    let calls = capture.calls("export");
    let outcomes: Vec<_> = calls.iter().map(|s| s.outcome()).collect();
    assert_eq!(outcomes, ["took_over", "not_recorded"]);
    assert_eq!(calls[1].field("error.type"), Some("lost_lease"));
    assert!(
        calls[0].events.iter().any(|e| e.contains("taking over")),
        "{:?}",
        calls[0].events
    );
}

#[test]
fn an_unreachable_store_is_a_store_error_and_nothing_runs() {
    let capture = Capture::default();
    let provider = Provider::default();
    let sent = with_capture(&capture, async {
        Run::new("agent-run")
            .with_store(Down::new())
            .scope(charge(provider.clone(), 100, false))
            .await
    });
    assert!(matches!(sent, Err(Error::Store { .. })), "{sent:?}");
    assert_eq!(provider.delivered(), 0);
    let span = &capture.calls("charge")[0];
    assert_eq!(span.outcome(), "store_error");
    assert_eq!(span.field("error.type"), Some("store"));
    assert_eq!(span.field("idem.store"), Some("custom"));
}

// ----- Telling a replay from a fresh run ------------------------------------------

#[tokio::test]
async fn observe_tells_a_replay_from_a_fresh_run() {
    let provider = Provider::default();
    let run = run();
    let call = || {
        run.scope(send_email(
            provider.clone(),
            email("di@example.com"),
            Duration::ZERO,
        ))
    };

    let (first, report) = idem::observe(call()).await;
    let report = report.expect("an idempotent call was made");
    assert_eq!(first, Ok("msg-1".into()));
    assert!(!report.replayed());
    assert_eq!(report.outcome(), CallOutcome::Executed);
    assert_eq!(report.tool(), "send_email");

    let (retry, again) = idem::observe(call()).await;
    let again = again.unwrap();
    assert_eq!(retry, Ok("msg-1".into()));
    assert!(again.replayed());
    assert_eq!(again.outcome(), CallOutcome::Replayed);
    assert_eq!(again.key(), report.key());
    assert_eq!(provider.delivered(), 1);

    // No idempotent call inside: nothing to report.
    let (value, none) = idem::observe(async { 7 }).await;
    assert_eq!((value, none.is_none()), (7, true));
}

#[idempotent(name = "plan", skip = [provider])]
async fn plan(provider: Provider, to: String) -> Result<String, Error> {
    // A tool that calls a tool: the outer call is the one reported.
    let sent = send_email(provider, email(&to), Duration::ZERO)
        .await
        .map_err(|e| Error::store("custom", format!("{e:?}")))?;
    Ok(format!("planned {sent}"))
}

#[tokio::test]
async fn observe_reports_the_outermost_call() {
    let provider = Provider::default();
    let run = run();
    // The inner tool has run before: it replays, the outer call executes.
    run.scope(send_email(
        provider.clone(),
        email("fay@example.com"),
        Duration::ZERO,
    ))
    .await
    .unwrap();
    let (planned, report) =
        idem::observe(run.scope(plan(provider.clone(), "fay@example.com".into()))).await;
    assert_eq!(planned.unwrap(), "planned msg-1");
    let report = report.unwrap();
    assert_eq!(report.tool(), "plan");
    assert_eq!(report.outcome(), CallOutcome::Executed);

    // Sync code has its own scope.
    let (exported, report) =
        idem::observe_sync(|| run.sync_scope(|| export(provider.clone(), 99, Duration::ZERO)));
    assert!(exported.is_ok());
    assert_eq!(report.unwrap().outcome(), CallOutcome::Executed);
    let (_, report) =
        idem::observe_sync(|| run.sync_scope(|| export(provider.clone(), 99, Duration::ZERO)));
    assert!(report.unwrap().replayed());
}

// ----- OpenTelemetry ----------------------------------------------------------------

#[test]
fn opentelemetry_exports_the_call_under_the_agents_span() {
    use opentelemetry::trace::{Status, TracerProvider as _};
    use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
    use tracing::Instrument;

    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("agent")));
    let _default = tracing::subscriber::set_default(subscriber);
    let ledger = Provider::default();
    let run = run();
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(
            async {
                let ok = run.scope(charge(ledger.clone(), 900, false)).await;
                let unknown = run.scope(charge(ledger.clone(), 901, true));
                let unknown = tokio::spawn(unknown.in_current_span()).await;
                assert!(unknown.unwrap_err().is_panic());
                let retry = run.scope(charge(ledger.clone(), 901, false)).await;
                (ok.unwrap(), retry.unwrap_err().kind())
            }
            .instrument(tracing::info_span!("agent_step")),
        );
    provider.force_flush().unwrap();
    let spans = exporter.get_finished_spans().unwrap();
    let agent = spans.iter().find(|s| s.name == "agent_step").unwrap();
    let calls: Vec<_> = spans
        .iter()
        .filter(|s| s.name == "execute_tool charge")
        .collect();
    assert_eq!(calls.len(), 3, "{spans:#?}");
    let attribute = |span: &opentelemetry_sdk::trace::SpanData, key: &str| {
        span.attributes
            .iter()
            .find(|kv| kv.key.as_str() == key)
            .map(|kv| kv.value.to_string())
    };
    for span in &calls {
        assert_eq!(span.parent_span_id, agent.span_context.span_id());
        assert_eq!(span.span_context.trace_id(), agent.span_context.trace_id());
        assert_eq!(span.span_kind, opentelemetry::trace::SpanKind::Internal);
        assert_eq!(
            attribute(span, "gen_ai.tool.name").as_deref(),
            Some("charge")
        );
        assert_eq!(
            attribute(span, "gen_ai.operation.name").as_deref(),
            Some("execute_tool")
        );
        assert_eq!(
            attribute(span, "gen_ai.tool.call.id").as_deref(),
            Some("call-7")
        );
    }
    let outcomes: Vec<_> = calls
        .iter()
        .map(|s| attribute(s, "idem.outcome").unwrap())
        .collect();
    assert_eq!(outcomes, ["executed", "not_recorded", "outcome_unknown"]);
    assert_eq!(calls[0].status, Status::Unset);
    assert!(
        matches!(calls[2].status, Status::Error { .. }),
        "{:?}",
        calls[2].status
    );
    assert_eq!(
        attribute(calls[2], "error.type").as_deref(),
        Some("outcome_unknown")
    );
}

// ----- What a hostile caller does -------------------------------------------------

#[test]
fn a_call_dropped_while_its_caller_panics_is_cancelled_not_a_panic() {
    let capture = Capture::default();
    let provider = Provider::default();
    let run = run();
    with_capture(&capture, async {
        let owner = run.scope(send_email(
            provider.clone(),
            email("gil@example.com"),
            Duration::from_millis(300),
        ));
        let owner = tokio::spawn(owner);
        tokio::time::sleep(Duration::from_millis(50)).await;
        let (run, provider) = (run.clone(), provider.clone());
        let agent = tokio::spawn(async move {
            let mut waiting = Box::pin(run.scope(send_email(
                provider,
                email("gil@example.com"),
                Duration::from_millis(300),
            )));
            let pending = futures_poll_once(waiting.as_mut()).await;
            assert!(pending, "the duplicate waits for the first call");
            panic!("the agent's own bug, unrelated to the tool");
        });
        assert!(agent.await.unwrap_err().is_panic());
        owner.await.unwrap().unwrap();
    });
    let mut outcomes = capture.outcomes("send_email");
    outcomes.sort();
    assert_eq!(outcomes, ["cancelled", "executed"]);
    let cancelled = capture
        .calls("send_email")
        .into_iter()
        .find(|s| s.outcome() == "cancelled")
        .unwrap();
    assert_eq!(cancelled.field("error.type"), Some("cancelled"));
    // It waited before it was dropped, and says how long.
    assert!(
        cancelled.field("idem.wait_seconds").is_some(),
        "{cancelled:?}"
    );
}

/// Polls `future` once; whether it is still pending.
async fn futures_poll_once<F: std::future::Future>(mut future: std::pin::Pin<&mut F>) -> bool {
    std::future::poll_fn(|cx| std::task::Poll::Ready(future.as_mut().poll(cx).is_pending())).await
}

#[test]
fn a_store_that_panics_is_a_store_error_and_nothing_runs() {
    let capture = Capture::default();
    let provider = Provider::default();
    let charged = with_capture(&capture, async {
        Run::new("agent-run")
            .with_store(Down::new().panicking_on_claim())
            .scope(charge(provider.clone(), 100, false))
            .await
    });
    assert!(matches!(charged, Err(Error::Store { .. })), "{charged:?}");
    assert_eq!(provider.delivered(), 0);
    let span = &capture.calls("charge")[0];
    assert_eq!(span.outcome(), "store_error");
    assert_eq!(span.field("error.type"), Some("store"));
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
#[serde(untagged)]
enum Amount {
    Float(f64),
    Int(u64),
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
struct Quote {
    token: String,
    amount: Amount,
}

/// Its result does not read back as itself (`Int(1)` reads back as `Float(1.0)`).
#[idempotent(name = "quote", skip = [provider])]
async fn quote(provider: Provider, customer: String) -> Result<Quote, Error> {
    provider.deliver();
    let _ = customer;
    Ok(Quote {
        token: "tok-RESULT-9999".into(),
        amount: Amount::Int(1),
    })
}

/// Serializing it fails with a message that quotes it.
struct Secret(&'static str);

impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom(format!(
            "cannot serialize {}",
            self.0
        )))
    }
}

#[idempotent(name = "bad_input")]
async fn bad_input(secret: Secret) -> Result<u32, Error> {
    let _ = secret.0;
    Ok(1)
}

#[test]
fn neither_the_input_nor_the_result_reaches_a_span_or_an_event() {
    let capture = Capture::default();
    let provider = Provider::default();
    let run = run();
    let (quoted, refused) = with_capture(&capture, async {
        let quoted = run.scope(quote(provider.clone(), "ada".into())).await;
        let refused = run.scope(bad_input(Secret("sk-live-INPUT-4242"))).await;
        (quoted, refused)
    });
    // The caller's errors keep the whole story.
    let quoted = quoted.unwrap_err();
    assert!(matches!(quoted, Error::Unreplayable { .. }), "{quoted:?}");
    assert!(quoted.to_string().contains("tok-RESULT-9999"), "{quoted}");
    assert!(refused
        .unwrap_err()
        .to_string()
        .contains("sk-live-INPUT-4242"));
    // The telemetry does not.
    let spans = [capture.calls("quote"), capture.calls("bad_input")].concat();
    assert_eq!(spans.len(), 2);
    assert_eq!(spans[0].field("error.type"), Some("unreplayable"));
    assert_eq!(spans[1].outcome(), "rejected");
    assert_eq!(spans[1].field("error.type"), Some("input"));
    assert_eq!(spans[1].field("gen_ai.tool.call.id"), Some("call-7"));
    for span in &spans {
        assert!(!span.events.is_empty(), "{span:?}");
        for text in span.fields.values().chain(&span.events) {
            assert!(
                !text.contains("RESULT") && !text.contains("INPUT"),
                "{text}"
            );
        }
    }
}

#[test]
fn a_fail_fast_call_that_never_waited_has_no_wait() {
    let capture = Capture::default();
    let provider = Provider::default();
    let run = run();
    let busy = with_capture(&capture, async {
        let first = run.scope(notify(provider.clone(), "bo".into(), "hi".into()));
        let second = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            run.scope(notify(provider.clone(), "bo".into(), "hi".into()))
                .await
        };
        tokio::join!(first, second).1
    });
    assert!(matches!(busy, Err(Error::InProgress { .. })), "{busy:?}");
    let span = capture
        .calls("notify")
        .into_iter()
        .find(|s| s.outcome() == "in_progress")
        .unwrap();
    assert_eq!(span.field("idem.wait_seconds"), None, "{span:?}");
}

#[tokio::test]
async fn observe_skips_a_call_it_stopped_waiting_for_and_reports_the_next() {
    let provider = Provider::default();
    let run = run();
    let call = || {
        run.scope(send_email(
            provider.clone(),
            email("hal@example.com"),
            Duration::from_millis(200),
        ))
    };
    let (retry, report) = idem::observe(async {
        // The agent's timeout drops the first call; it finishes in the background.
        assert!(tokio::time::timeout(Duration::from_millis(30), call())
            .await
            .is_err());
        call().await
    })
    .await;
    assert_eq!(retry, Ok("msg-1".into()));
    let report = report.expect("the retry is reported");
    assert_eq!(report.outcome(), CallOutcome::WaitedThenReplayed);
    assert!(report.waited().is_some());
    assert_eq!(provider.delivered(), 1);

    // A waiter the agent gave up on is not reported either; the retry after it is.
    let (retry, report) = idem::observe(async {
        let owner = tokio::spawn(run.scope(send_email(
            provider.clone(),
            email("ida@example.com"),
            Duration::from_millis(200),
        )));
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(tokio::time::timeout(
            Duration::from_millis(30),
            run.scope(send_email(
                provider.clone(),
                email("ida@example.com"),
                Duration::from_millis(200)
            )),
        )
        .await
        .is_err());
        owner.await.unwrap().unwrap();
        run.scope(send_email(
            provider.clone(),
            email("ida@example.com"),
            Duration::from_millis(200),
        ))
        .await
    })
    .await;
    assert_eq!(retry, Ok("msg-2".into()));
    assert_eq!(report.unwrap().outcome(), CallOutcome::Replayed);

    // `select!` over two calls reports the one that answered, whichever was polled first.
    for i in 0..4 {
        let (_, report) = idem::observe(async {
            tokio::select! {
                _ = run.scope(hold(provider.clone(), format!("select-{i}"))) => {}
                sent = run.scope(send_email(provider.clone(), email("hal@example.com"), Duration::ZERO)) => {
                    sent.unwrap();
                }
            }
        })
        .await;
        assert_eq!(report.unwrap().tool(), "send_email");
    }

    // An observe inside another reports to both.
    let ((_, inner), outer) = idem::observe(idem::observe(call())).await;
    assert!(inner.unwrap().replayed());
    assert!(outer.unwrap().replayed());
}

#[test]
fn the_heartbeats_events_fire_inside_the_span() {
    let capture = Capture::default();
    let provider = Provider::default();
    let run = run();
    let dispatch = capture.dispatch();
    let stuck = tracing::dispatcher::with_default(&dispatch, || {
        run.sync_scope(|| export(provider.clone(), 11, Duration::from_millis(300)))
    });
    // Nobody took it over: its late result is still recorded.
    assert_eq!(stuck.unwrap(), 1);
    let span = &capture.calls("export")[0];
    assert!(
        span.events
            .iter()
            .any(|e| e.contains("ran past its max_run")),
        "{:?}",
        span.events
    );
}
