//! The dynamic API, `idem::Tool`, as a user of it sees it: the same keys and records as
//! the attribute (a record written by one replays through the other), and the same
//! outcomes when the caller or the body misbehaves: a call its caller stops waiting
//! for, a panic, a failed body, a concurrent duplicate, a store that fails, an
//! abandoned at-most-once claim settled by a reconcile hook, a body that hangs past
//! `max_run`, a running claim removed from under it. Each test counts how often
//! the side effect really ran and what each caller got.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem::store::State;
use idem::{
    current_key, idempotent, observe, CallOutcome, Error, Key, MemoryStore, OnCancel, Reconciled,
    Run, Store, Tool,
};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// How often the side effect really ran.
#[derive(Clone, Default)]
struct Sent(Arc<AtomicUsize>);

impl Sent {
    fn send(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }
    fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct SendEmail {
    to: String,
    subject: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct MessageId(String);

fn email() -> SendEmail {
    SendEmail {
        to: "ada@example.com".into(),
        subject: "hi".into(),
    }
}

fn run(store: &Arc<dyn Store>) -> Run {
    Run::new("agent-run").with_shared_store(Arc::clone(store))
}

/// Drops `call` once its body has run its side effect (`sent` went past `before`): a
/// caller that gives up mid-body, however slowly a busy machine runs it.
async fn drop_once_started(call: impl Future, sent: &Sent, before: usize) {
    let mut call = std::pin::pin!(call);
    loop {
        tokio::select! {
            _ = &mut call => panic!("the call ended before its caller gave up"),
            _ = tokio::time::sleep(Duration::from_millis(5)) => {
                if sent.count() > before {
                    return;
                }
            }
        }
    }
}

/// Waits until `sent` went past `before`.
async fn started(sent: &Sent, before: usize) {
    while sent.count() <= before {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

static ATTRIBUTE_SENT: AtomicUsize = AtomicUsize::new(0);

/// The same tool, written with the attribute.
#[idempotent(name = "send_email")]
async fn send_email(input: SendEmail) -> Result<MessageId, Error> {
    let n = ATTRIBUTE_SENT.fetch_add(1, Ordering::SeqCst) + 1;
    let key = current_key().expect("a key inside the body");
    Ok(MessageId(format!("attribute-{n}-{key}")))
}

static KEYED_SENT: AtomicUsize = AtomicUsize::new(0);

#[idempotent(name = "send_keyed", key = [input.to])]
async fn send_keyed(input: SendEmail) -> Result<MessageId, Error> {
    KEYED_SENT.fetch_add(1, Ordering::SeqCst);
    Ok(MessageId(format!("keyed-{}", input.to)))
}

#[tokio::test]
async fn a_record_written_by_the_attribute_replays_through_the_dynamic_api_and_back() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let run = run(&store);
    let tool = Tool::new("send_email");
    let sent = Sent::default();

    // The attribute writes; the dynamic tool, with the same input as JSON, replays.
    let first = run.scope(send_email(email())).await.unwrap();
    let key = tool.key_of(&run, &email()).unwrap();
    assert!(first.0.ends_with(key.as_str()), "{first:?} under {key}");
    let as_json = json!({ "subject": "hi", "to": "ada@example.com" });
    assert_eq!(tool.key_of(&run, &as_json).unwrap(), key);
    let replayed: MessageId = tool
        .call(&run, &as_json, {
            let sent = sent.clone();
            move |_| async move { Ok::<_, Error>(MessageId(format!("dynamic-{}", sent.send()))) }
        })
        .await
        .unwrap();
    assert_eq!(replayed, first);
    assert_eq!(sent.count(), 0, "the dynamic body must not run");

    // The dynamic tool writes (another input); the attribute replays.
    let other = SendEmail {
        to: "grace@example.com".into(),
        subject: "hi".into(),
    };
    let written: Value = tool
        .call(&run, &other, {
            let sent = sent.clone();
            move |key| async move {
                Ok::<_, Error>(json!(format!("dynamic-{}-{key}", sent.send())))
            }
        })
        .await
        .unwrap();
    let before = ATTRIBUTE_SENT.load(Ordering::SeqCst);
    let through_attribute = run.scope(send_email(other.clone())).await.unwrap();
    assert_eq!(json!(through_attribute.0), written);
    assert_eq!(
        ATTRIBUTE_SENT.load(Ordering::SeqCst),
        before,
        "the attribute's body ran"
    );
    assert_eq!(sent.count(), 1);

    // What the store holds is one record per input, both completed.
    for input in [email(), other] {
        let key = tool.key_of(&run, &input).unwrap();
        let record = store.get(&key).await.unwrap().expect("a record");
        assert!(
            matches!(record.state, State::Completed { .. }),
            "{record:?}"
        );
    }
}

#[tokio::test]
async fn key_fields_make_the_attributes_key_and_a_different_payload_is_a_mismatch() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let run = run(&store);
    let tool = Tool::new("send_keyed").key(["to"]);
    let first = run.scope(send_keyed(email())).await.unwrap();
    let replayed: MessageId = tool
        .call(&run, &email(), |_| async {
            Ok::<_, Error>(MessageId("dynamic".into()))
        })
        .await
        .unwrap();
    assert_eq!(replayed, first);

    // Same `to`, another subject: one key, another payload.
    let changed = json!({ "to": "ada@example.com", "subject": "changed" });
    let mismatch: Result<Value, Error> = tool
        .call(&run, &changed, |_| async { Ok(json!("ran")) })
        .await;
    assert!(
        matches!(mismatch, Err(Error::PayloadMismatch { .. })),
        "{mismatch:?}"
    );
    assert_eq!(KEYED_SENT.load(Ordering::SeqCst), 1);

    // A JSON pointer names the same field; a missing field counts as null.
    let by_pointer = Tool::new("send_keyed").key(["/to"]);
    assert_eq!(
        by_pointer.key_of(&run, &email()).unwrap(),
        tool.key_of(&run, &email()).unwrap()
    );
    let missing = Tool::new("t").key(["absent"]);
    let null = Tool::new("t").key(["also_absent"]);
    assert_eq!(
        missing.key_of(&run, &json!({})).unwrap(),
        null.key_of(&run, &json!({ "x": 1 })).unwrap()
    );
}

#[tokio::test]
async fn runs_tools_scopes_and_tenants_never_share_a_key() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let input = json!({ "to": "ada@example.com" });
    let key = |tool: &Tool, run: &Run| tool.key_of(run, &input).unwrap();
    let base = key(&Tool::new("send"), &run(&store));
    let keys = [
        key(&Tool::new("send"), &Run::new("another-run")),
        key(&Tool::new("send_sms"), &run(&store)),
        key(&Tool::new("send").scope(json!("account-1")), &run(&store)),
        key(&Tool::new("send"), &run(&store).with_tenant("acme")),
    ];
    for other in &keys {
        assert_ne!(&base, other);
    }
    // Reordered object keys are the same input.
    let reordered = json!({ "b": 2, "a": 1 });
    let ordered = serde_json::from_str::<Value>(r#"{"a":1,"b":2}"#).unwrap();
    let tool = Tool::new("send");
    assert_eq!(
        tool.key_of(&run(&store), &reordered).unwrap(),
        tool.key_of(&run(&store), &ordered).unwrap()
    );
}

#[tokio::test]
async fn a_call_its_caller_stops_waiting_for_finishes_and_the_retry_gets_its_result() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let run = run(&store);
    let tool = Tool::new("slow_send").lease(Duration::from_secs(60));
    let sent = Sent::default();
    let body = |sent: Sent| {
        move |_key: Key| async move {
            let n = sent.send();
            tokio::time::sleep(Duration::from_millis(500)).await;
            Ok::<_, Error>(json!(n))
        }
    };
    drop_once_started(tool.call(&run, &json!({}), body(sent.clone())), &sent, 0).await;
    let started = std::time::Instant::now();
    let retry: Value = tool
        .call(&run, &json!({}), body(sent.clone()))
        .await
        .unwrap();
    assert_eq!(retry, json!(1));
    assert_eq!(sent.count(), 1);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "waited out a lease"
    );

    // With `OnCancel::Abort` the body is dropped, and the key released for the retry.
    let abort = Tool::new("abort_send")
        .lease(Duration::from_secs(60))
        .on_cancel(OnCancel::Abort);
    let aborted = Sent::default();
    drop_once_started(
        abort.call(&run, &json!({}), body(aborted.clone())),
        &aborted,
        0,
    )
    .await;
    let retry: Value = abort
        .call(&run, &json!({}), body(aborted.clone()))
        .await
        .unwrap();
    assert_eq!(retry, json!(2), "the retry ran again");

    // At most once: the dropped call's outcome is unknown, and nothing runs again.
    let once = Tool::new("pay")
        .lease(Duration::from_secs(60))
        .on_cancel(OnCancel::Abort)
        .at_most_once();
    let paid = Sent::default();
    drop_once_started(once.call(&run, &json!({}), body(paid.clone())), &paid, 0).await;
    let retry: Result<Value, Error> = once.call(&run, &json!({}), body(paid.clone())).await;
    assert!(
        matches!(retry, Err(Error::OutcomeUnknown { .. })),
        "{retry:?}"
    );
    assert_eq!(paid.count(), 1);
}

#[tokio::test]
async fn a_panic_settles_the_claim_and_goes_on_and_a_failed_body_releases_the_key() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let run = run(&store);
    let tool = Tool::new("flaky").lease(Duration::from_secs(60));
    let panicked = tokio::spawn({
        let (tool, run) = (tool.clone(), run.clone());
        async move {
            let _: Result<Value, Error> = tool
                .call(&run, &json!(1), |_| async {
                    panic!("the provider blew up")
                })
                .await;
        }
    })
    .await;
    assert!(panicked.unwrap_err().is_panic());

    #[derive(Debug)]
    enum ToolError {
        Declined,
        #[allow(dead_code)]
        Idem(Error),
    }
    impl From<Error> for ToolError {
        fn from(error: Error) -> Self {
            ToolError::Idem(error)
        }
    }
    let failed: Result<Value, ToolError> = tool
        .call(&run, &json!(1), |_| async { Err(ToolError::Declined) })
        .await;
    assert!(matches!(failed, Err(ToolError::Declined)), "{failed:?}");
    let sent = Sent::default();
    let ok: Result<Value, ToolError> = tool
        .call(&run, &json!(1), {
            let sent = sent.clone();
            move |_| async move { Ok(json!(sent.send())) }
        })
        .await;
    assert_eq!(ok.unwrap(), json!(1), "the retry runs at once");

    // With errors cached, the declined call's error is what every retry gets.
    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    enum Declined {
        Card(String),
        Idem(String),
    }
    impl From<Error> for Declined {
        fn from(error: Error) -> Self {
            Declined::Idem(error.to_string())
        }
    }
    let caching = Tool::new("charge").cache_errors();
    let declined = Sent::default();
    for _ in 0..3 {
        let declined = declined.clone();
        let got: Result<Value, Declined> = caching
            .call(&run, &json!({ "cents": 100 }), move |_| async move {
                declined.send();
                Err(Declined::Card("insufficient funds".into()))
            })
            .await;
        assert_eq!(got, Err(Declined::Card("insufficient funds".into())));
    }
    assert_eq!(declined.count(), 1);
}

#[tokio::test]
async fn concurrent_duplicates_run_once_and_fail_fast_says_in_progress() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let run = run(&store);
    let tool = Tool::new("once");
    let sent = Sent::default();
    let calls: Vec<_> = (0..8)
        .map(|_| {
            let (tool, run, sent) = (tool.clone(), run.clone(), sent.clone());
            tokio::spawn(async move {
                tool.call(&run, &json!("same"), move |_| async move {
                    let n = sent.send();
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    Ok::<_, Error>(json!(n))
                })
                .await
            })
        })
        .collect();
    let mut got = Vec::new();
    for call in calls {
        got.push(call.await.unwrap().unwrap());
    }
    assert!(got.iter().all(|v| v == &json!(1)), "{got:?}");
    assert_eq!(sent.count(), 1);

    let fast = Tool::new("fast").fail_fast();
    let holder = Sent::default();
    let holding = tokio::spawn({
        let (fast, run, holder) = (fast.clone(), run.clone(), holder.clone());
        async move {
            fast.call(&run, &json!(1), move |_| async move {
                holder.send();
                tokio::time::sleep(Duration::from_millis(500)).await;
                Ok::<_, Error>(json!("done"))
            })
            .await
        }
    });
    started(&holder, 0).await;
    let busy: Result<Value, Error> = fast
        .call(&run, &json!(1), |_| async { Ok(json!("2")) })
        .await;
    assert!(matches!(busy, Err(Error::InProgress { .. })), "{busy:?}");
    assert_eq!(holding.await.unwrap().unwrap(), json!("done"));
}

#[tokio::test]
async fn observe_reports_the_same_outcomes_and_a_failing_store_is_a_store_error() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let run = run(&store);
    let tool = Tool::new("observed");
    let one = json!(1);
    let call = || tool.call(&run, &one, |_| async { Ok::<_, Error>(json!("v")) });
    let (first, report) = observe(call()).await;
    assert_eq!(first.unwrap(), json!("v"));
    assert_eq!(report.unwrap().outcome(), CallOutcome::Executed);
    let (again, report) = observe(call()).await;
    assert_eq!(again.unwrap(), json!("v"));
    let report = report.unwrap();
    assert_eq!(report.outcome(), CallOutcome::Replayed);
    assert_eq!(report.tool(), "observed");

    // No run id: refused before anything runs.
    let blank = Run::new(" ").with_shared_store(Arc::clone(&store));
    let refused: Result<Value, Error> = tool
        .call(&blank, &json!(1), |_| async { Ok(json!(1)) })
        .await;
    assert!(matches!(refused, Err(Error::NoRun { .. })), "{refused:?}");

    // An input that cannot be keyed is a typed error, and the body does not run.
    let mut map = std::collections::HashMap::new();
    map.insert((1, 2), "tuple keys are not JSON");
    let sent = Sent::default();
    let unkeyable: Result<Value, Error> = tool
        .call(&run, &map, {
            let sent = sent.clone();
            move |_| async move { Ok(json!(sent.send())) }
        })
        .await;
    assert!(
        matches!(unkeyable, Err(Error::Input { .. })),
        "{unkeyable:?}"
    );
    assert_eq!(sent.count(), 0);
}

#[tokio::test]
async fn a_reconcile_hook_settles_an_abandoned_claim_with_what_happened_downstream() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let run = run(&store);
    let asked = Sent::default();
    let tool = Tool::new("charge")
        .lease(Duration::from_secs(60))
        .on_cancel(OnCancel::Abort)
        .reconcile({
            let asked = asked.clone();
            move |key: Key, input: Value| {
                let asked = asked.clone();
                async move {
                    asked.send();
                    assert_eq!(input, json!({ "cents": 500 }));
                    Reconciled::Happened(json!({ "charge": format!("ch-{key}") }))
                }
            }
        });
    assert_eq!(tool.options().delivery, idem::Delivery::AtMostOnce);
    let input = json!({ "cents": 500 });
    // The first call is dropped after the charge went out: its outcome is unknown.
    let charged = Sent::default();
    let call = tool.call(&run, &input, {
        let charged = charged.clone();
        move |_| async move {
            charged.send();
            tokio::time::sleep(Duration::from_secs(10)).await;
            Ok::<_, Error>(json!("never returned"))
        }
    });
    drop_once_started(call, &charged, 0).await;
    let key = tool.key_of(&run, &input).unwrap();
    let retry: Value = tool
        .call(&run, &input, |_| async {
            Ok::<_, Error>(json!("charged twice"))
        })
        .await
        .unwrap();
    assert_eq!(retry, json!({ "charge": format!("ch-{key}") }));
    assert_eq!((charged.count(), asked.count()), (1, 1));
}

#[tokio::test]
async fn a_reconcile_answer_that_does_not_read_as_the_result_type_stays_unknown() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let run = run(&store);
    let tool = Tool::new("typed_charge")
        .lease(Duration::from_secs(60))
        .on_cancel(OnCancel::Abort)
        .reconcile(|_, _| async { Reconciled::Happened(json!(1)) });
    let input = json!({ "cents": 500 });
    let charged = Sent::default();
    let call = tool.call(&run, &input, {
        let charged = charged.clone();
        move |_| async move {
            charged.send();
            tokio::time::sleep(Duration::from_secs(10)).await;
            Ok::<String, Error>("never returned".into())
        }
    });
    drop_once_started(call, &charged, 0).await;
    let retry: Result<String, Error> = tool
        .call(&run, &input, |_| async { Ok("charged twice".into()) })
        .await;
    assert!(
        matches!(retry, Err(Error::OutcomeUnknown { .. })),
        "{retry:?}"
    );
    let key = tool.key_of(&run, &input).unwrap();
    let record = store.get(&key).await.unwrap().expect("the abandoned claim");
    assert!(
        !matches!(record.state, State::Completed { .. }),
        "{record:?}"
    );
}

/// A body that hangs is stopped at `max_run`, and a running claim an operator removes
/// is a lost lease: through `Tool` as through the attribute (see `lifecycle.rs` and
/// `keys_and_errors.rs`), each a typed error, and the retry runs the body again.
#[tokio::test]
async fn a_hung_body_stops_at_max_run_and_a_removed_claim_is_a_lost_lease() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let run = run(&store);
    let sent = Sent::default();

    // Hangs the first time only.
    let hangs = Tool::new("hangs").max_run(Duration::from_millis(300));
    let once = json!("once");
    let call = || {
        let sent = sent.clone();
        hangs.call(&run, &once, move |_| async move {
            if sent.send() == 1 {
                std::future::pending::<()>().await;
            }
            Ok::<_, Error>(json!(sent.count()))
        })
    };
    let hung = tokio::time::timeout(Duration::from_secs(10), call())
        .await
        .expect("stopped at max_run, not hung");
    assert!(
        matches!(hung, Err(Error::MaxRunExceeded { .. })),
        "{hung:?}"
    );
    assert_eq!(call().await.unwrap(), json!(2), "released: the retry ran");
    assert_eq!(sent.count(), 2);

    // An operator removes the running claim.
    let removed = Tool::new("removed");
    let go = Arc::new(tokio::sync::Notify::new());
    let (keys, mut key) = tokio::sync::mpsc::unbounded_channel();
    let x = json!("x");
    let first = removed.call(&run, &x, {
        let (sent, go) = (sent.clone(), Arc::clone(&go));
        move |key| async move {
            sent.send();
            keys.send(key).unwrap();
            go.notified().await;
            Ok::<_, Error>(json!("first"))
        }
    });
    let operator = async {
        let key = key.recv().await.unwrap();
        assert!(store.delete(&key).await.unwrap());
        go.notify_one();
    };
    let (first, ()) = tokio::join!(first, operator);
    assert!(
        matches!(
            first,
            Err(Error::LostLease {
                lost_to: idem::LostTo::Removal,
                ..
            })
        ),
        "{first:?}"
    );
    let retry: Value = removed
        .call(&run, &x, |_| async { Ok::<_, Error>(json!("retry")) })
        .await
        .unwrap();
    assert_eq!(retry, json!("retry"), "nothing was stored: the retry ran");
    assert_eq!(sent.count(), 3);
}

/// A `Tool` closure that panics before it returns its body's future panics as a body
/// does: the panic reaches the caller and the claim is settled at once, so the retry
/// runs without waiting out the lease. The closure runs in the key's scope.
#[tokio::test]
async fn a_closure_that_panics_before_its_future_settles_the_claim_at_once() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let run = run(&store);
    let tool = Tool::new("panics_early").lease(Duration::from_secs(60));
    let input = json!(1);
    let panicked = tokio::spawn({
        let (tool, run, input) = (tool.clone(), run.clone(), input.clone());
        async move {
            tool.call(&run, &input, |key| {
                assert_eq!(current_key(), Some(key), "in the key's scope");
                let value: u32 = std::hint::black_box(None).expect("boom, before the future");
                async move { Ok::<_, Error>(json!(value)) }
            })
            .await
        }
    })
    .await;
    let payload = panicked.unwrap_err().into_panic();
    let message = payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied());
    assert_eq!(
        message,
        Some("boom, before the future"),
        "the closure's own panic, not the assertion's"
    );
    let started = std::time::Instant::now();
    let retry: Value = tool
        .call(&run, &input, |_| async { Ok::<_, Error>(json!(2)) })
        .await
        .unwrap();
    assert_eq!(retry, json!(2));
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "the retry waited {:?}: the claim was not settled",
        started.elapsed()
    );
}

/// A result type whose `Deserialize` panics.
#[derive(Debug, Serialize)]
struct PanicsOnRead(u32);

impl<'de> Deserialize<'de> for PanicsOnRead {
    fn deserialize<D: serde::Deserializer<'de>>(_: D) -> Result<Self, D::Error> {
        panic!("a Deserialize that panics")
    }
}

/// A panic in the result type's `Deserialize` is a stored result that cannot be read,
/// a typed error, on the hit path and for a call that waited for another's claim; the
/// body does not run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_deserialize_is_a_stored_result_error_on_every_path() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let run = run(&store);
    let tool = Tool::new("reads");
    let sent = Sent::default();
    let go = Arc::new(tokio::sync::Notify::new());
    let input = json!("x");
    let first = tool.call(&run, &input, {
        let (sent, go) = (sent.clone(), Arc::clone(&go));
        move |_| async move {
            sent.send();
            go.notified().await;
            Ok::<_, Error>(json!(7))
        }
    });
    let waiter = async {
        started(&sent, 0).await;
        let waiting = tool.call(&run, &input, |_| async { Ok::<_, Error>(PanicsOnRead(8)) });
        let mut waiting = std::pin::pin!(waiting);
        // It waits for the first call's claim, then reads its record.
        tokio::select! {
            _ = &mut waiting => panic!("the duplicate did not wait"),
            _ = tokio::time::sleep(Duration::from_millis(100)) => go.notify_one(),
        }
        waiting.await
    };
    let (first, waited) = tokio::join!(first, waiter);
    assert_eq!(first.unwrap(), json!(7));
    assert!(
        matches!(waited, Err(Error::StoredResult { .. })),
        "{waited:?}"
    );
    let hit = tool
        .call(&run, &input, |_| async { Ok::<_, Error>(PanicsOnRead(9)) })
        .await;
    assert!(matches!(hit, Err(Error::StoredResult { .. })), "{hit:?}");
    assert_eq!(sent.count(), 1, "the body ran once");
}
