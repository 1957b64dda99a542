//! The protocol as a caller sees it: how often the operation ran, what each caller got
//! back, what the store holds.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use idem_core::__private::{execute, execute_blocking, CacheErrors, Call, ReleaseErrors};
use idem_core::store::{
    Claim, ClaimRequest, Fenced, Fingerprint, KeyParts, Outcome, State, Store, Token,
};
use idem_core::{current_key, Error, Key, MemoryStore, Options, Run, SledStore};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Email {
    to: String,
    body: String,
}

fn email(to: &str, body: &str) -> Email {
    Email {
        to: to.into(),
        body: body.into(),
    }
}

/// A side effect that counts how often it really ran.
#[derive(Clone, Default)]
struct Outbox(Arc<AtomicUsize>);

impl Outbox {
    fn sent(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
    async fn send(&self, input: &Email, options: Options) -> Result<Result<String, Error>, Error> {
        let outbox = self.clone();
        let call = Call::new(None, "send_email", options, input);
        let to = input.to.clone();
        execute::<_, ReleaseErrors, _>(call, async move {
            let n = outbox.0.fetch_add(1, Ordering::SeqCst);
            Ok(format!("msg-{n}-to-{to}"))
        })
        .await
    }
}

fn memory_run(id: &str) -> Run {
    Run::new(id).with_store(MemoryStore::new())
}

#[tokio::test]
async fn completed_call_is_replayed_without_running_again() {
    let run = memory_run("run-1");
    let outbox = Outbox::default();
    let input = email("ada@example.com", "hi");
    let first = run
        .scope(outbox.send(&input, Options::new()))
        .await
        .unwrap()
        .unwrap();
    let second = run
        .scope(outbox.send(&input, Options::new()))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(outbox.sent(), 1);
    assert_eq!(first, second);
}

#[tokio::test]
async fn another_run_id_runs_again() {
    let store = MemoryStore::new();
    let outbox = Outbox::default();
    let input = email("ada@example.com", "hi");
    for id in ["run-a", "run-b"] {
        let run = Run::new(id).with_store(store.clone());
        run.scope(outbox.send(&input, Options::new()))
            .await
            .unwrap()
            .unwrap();
    }
    assert_eq!(outbox.sent(), 2);
}

#[tokio::test]
async fn result_runs_again_after_ttl() {
    let run = memory_run("run-ttl");
    let outbox = Outbox::default();
    let input = email("ada@example.com", "hi");
    let options = Options::new().ttl(Duration::from_millis(100));
    let first = run
        .scope(outbox.send(&input, options))
        .await
        .unwrap()
        .unwrap();
    let replay = run
        .scope(outbox.send(&input, options))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((outbox.sent(), &replay), (1, &first));
    tokio::time::sleep(Duration::from_millis(200)).await;
    let later = run
        .scope(outbox.send(&input, options))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(outbox.sent(), 2);
    assert_ne!(later, first);
}

#[tokio::test]
async fn same_key_other_payload_is_payload_mismatch() {
    let run = memory_run("run-mismatch");
    let runs = Arc::new(AtomicUsize::new(0));
    let call = |input: Email| {
        let runs = runs.clone();
        let run = run.clone();
        async move {
            // The key is only the recipient; the fingerprint covers the whole email.
            let call = Call::with_key(Some(&run), "send_email", Options::new(), &input, &input.to);
            execute::<Result<usize, Error>, ReleaseErrors, _>(call, async move {
                Ok(runs.fetch_add(1, Ordering::SeqCst))
            })
            .await
        }
    };
    call(email("ada@example.com", "first"))
        .await
        .unwrap()
        .unwrap();
    let err = call(email("ada@example.com", "second")).await.unwrap_err();
    assert!(matches!(err, Error::PayloadMismatch { .. }), "{err}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // The same payload still replays.
    assert_eq!(
        call(email("ada@example.com", "first"))
            .await
            .unwrap()
            .unwrap(),
        0
    );
}

#[tokio::test]
async fn failed_call_releases_its_key_so_a_retry_runs() {
    let run = memory_run("run-err");
    let runs = Arc::new(AtomicUsize::new(0));
    for expected in [Err("timeout".to_string()), Ok(1), Ok(1)] {
        let runs = runs.clone();
        let call = Call::new(Some(&run), "flaky", Options::new(), &"x");
        let got = execute::<Result<usize, String>, ReleaseErrors, _>(call, async move {
            let n = runs.fetch_add(1, Ordering::SeqCst);
            if n == 0 {
                Err("timeout".to_string())
            } else {
                Ok(n)
            }
        })
        .await
        .unwrap();
        assert_eq!(got, expected);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn cached_error_is_replayed_when_opted_in() {
    let run = memory_run("run-cache-err");
    let runs = Arc::new(AtomicUsize::new(0));
    for _ in 0..3 {
        let runs = runs.clone();
        let call = Call::new(Some(&run), "charge", Options::new(), &"card-1");
        let got = execute::<Result<u32, String>, CacheErrors, _>(call, async move {
            runs.fetch_add(1, Ordering::SeqCst);
            Err("card declined".to_string())
        })
        .await
        .unwrap();
        assert_eq!(got, Err("card declined".to_string()));
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn stored_result_of_another_type_is_a_typed_error() {
    let run = memory_run("run-types");
    let call = || Call::new(Some(&run), "lookup", Options::new(), &1);
    execute::<Result<String, Error>, ReleaseErrors, _>(call(), async { Ok("text".into()) })
        .await
        .unwrap()
        .unwrap();
    let ran = AtomicUsize::new(0);
    let err = execute::<Result<u64, Error>, ReleaseErrors, _>(call(), async {
        ran.fetch_add(1, Ordering::SeqCst);
        Ok(7)
    })
    .await
    .unwrap_err();
    assert!(matches!(err, Error::StoredResult { .. }), "{err}");
    assert_eq!(
        ran.load(Ordering::SeqCst),
        0,
        "a type change must not re-run"
    );
}

#[tokio::test]
async fn call_without_a_run_is_no_run() {
    let err = Call::new(None, "send_email", Options::new(), &1).unwrap_err();
    assert!(
        matches!(err, Error::NoRun { ref tool, blank_id: None } if tool == "send_email"),
        "{err}"
    );
}

#[tokio::test]
async fn unserializable_input_is_a_typed_error_and_nothing_runs() {
    let run = memory_run("run-input");
    let input: std::collections::HashMap<(u8, u8), u8> = [((1, 2), 3)].into();
    let call = Call::new(Some(&run), "tool", Options::new(), &input);
    let ran = AtomicUsize::new(0);
    let err = execute::<Result<(), Error>, ReleaseErrors, _>(call, async {
        ran.fetch_add(1, Ordering::SeqCst);
        Ok(())
    })
    .await
    .unwrap_err();
    assert!(matches!(err, Error::Input { .. }), "{err}");
    assert_eq!(ran.load(Ordering::SeqCst), 0);
}

/// Claims `call`'s key directly in the store, as another process would.
async fn claim_elsewhere(store: &dyn Store, call: &Call, lease: Duration) -> Token {
    let token = Token::generate().unwrap();
    let request = ClaimRequest {
        origin: idem_core::store::Origin::new("run", "tool"),
        fingerprint: *call.fingerprint(),
        token,
        lease,
        ttl: Duration::from_secs(60),
        take_over_expired: true,
        retry_failed: true,
    };
    store.claim(call.key(), &request).await.unwrap();
    token
}

#[tokio::test]
async fn concurrent_duplicate_fails_fast_or_waits_bounded() {
    let store = MemoryStore::new();
    let run = Run::new("run-busy").with_store(store.clone());
    let options = Options::new().fail_fast();
    let call = || Call::new(Some(&run), "tool", options, &1);
    claim_elsewhere(&store, &call().unwrap(), Duration::from_secs(60)).await;

    let err = execute::<Result<(), Error>, ReleaseErrors, _>(call(), async { Ok(()) })
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InProgress { .. }), "{err}");

    let waiting = Options::new().wait(Duration::from_millis(150));
    let started = std::time::Instant::now();
    let err = execute::<Result<(), Error>, ReleaseErrors, _>(
        Call::new(Some(&run), "tool", waiting, &1),
        async { Ok(()) },
    )
    .await
    .unwrap_err();
    assert!(matches!(err, Error::InProgress { .. }), "{err}");
    assert!(started.elapsed() >= Duration::from_millis(150));
}

#[tokio::test]
async fn waiter_receives_the_owners_result() {
    let run = memory_run("run-wait");
    let runs = Arc::new(AtomicUsize::new(0));
    let call = |runs: Arc<AtomicUsize>| {
        let run = run.clone();
        async move {
            execute::<Result<usize, Error>, ReleaseErrors, _>(
                Call::new(Some(&run), "slow", Options::new(), &1),
                async move {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    Ok(runs.fetch_add(1, Ordering::SeqCst) + 100)
                },
            )
            .await
        }
    };
    let (a, b) = tokio::join!(call(runs.clone()), call(runs.clone()));
    assert_eq!((a.unwrap().unwrap(), b.unwrap().unwrap()), (100, 100));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn expired_lease_reruns_or_is_outcome_unknown() {
    let store = MemoryStore::new();
    let run = Run::new("run-crash").with_store(store.clone());
    let runs = Arc::new(AtomicUsize::new(0));
    let exec = |options: Options| {
        let runs = runs.clone();
        execute::<Result<usize, Error>, ReleaseErrors, _>(
            Call::new(Some(&run), "charge", options, &1),
            async move { Ok(runs.fetch_add(1, Ordering::SeqCst)) },
        )
    };
    // A "crashed" owner: claimed, never completed.
    let crashed = Call::new(Some(&run), "charge", Options::new(), &1).unwrap();
    claim_elsewhere(&store, &crashed, Duration::from_millis(100)).await;

    let err = exec(Options::new().at_most_once()).await.unwrap_err();
    assert!(matches!(err, Error::OutcomeUnknown { .. }), "{err}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);

    // At-least-once (default): the waiter waits out the lease, takes over, runs once.
    assert_eq!(exec(Options::new()).await.unwrap().unwrap(), 0);
    assert_eq!(exec(Options::new()).await.unwrap().unwrap(), 0);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A memory store whose renewals never reach it, as if a network partition cut the
/// owner off from the store while its body ran.
#[derive(Clone, Default)]
struct RenewalsLost(MemoryStore);

#[async_trait::async_trait]
impl Store for RenewalsLost {
    async fn claim(&self, key: &Key, request: &ClaimRequest) -> Result<Claim, Error> {
        self.0.claim(key, request).await
    }
    async fn complete(
        &self,
        key: &Key,
        token: Token,
        outcome: Outcome<'_>,
        ttl: Duration,
    ) -> Result<Fenced, Error> {
        self.0.complete(key, token, outcome, ttl).await
    }
    async fn release(&self, key: &Key, token: Token) -> Result<Fenced, Error> {
        self.0.release(key, token).await
    }
    async fn renew(&self, _: &Key, _: Token, _: Duration, _: Duration) -> Result<Fenced, Error> {
        Err(Error::store("partitioned", "no route to the store"))
    }
    async fn get(&self, key: &Key) -> Result<Option<idem_core::store::Record>, Error> {
        self.0.get(key).await
    }
    async fn delete(&self, key: &Key) -> Result<bool, Error> {
        self.0.delete(key).await
    }
    async fn purge_expired(&self) -> Result<u64, Error> {
        self.0.purge_expired().await
    }
}

#[tokio::test]
async fn stale_owner_cannot_overwrite_the_new_owners_result() {
    let run = Run::new("run-fence").with_store(RenewalsLost::default());
    let short = Options::new().lease(Duration::from_millis(100));
    // The owner's renewals cannot reach the store, so its claim runs out while it runs;
    // a retry takes over and completes first.
    let stale = execute::<Result<String, Error>, ReleaseErrors, _>(
        Call::new(Some(&run), "tool", short, &1),
        async {
            tokio::time::sleep(Duration::from_millis(400)).await;
            Ok("stale".to_string())
        },
    );
    let fresh = async {
        tokio::time::sleep(Duration::from_millis(200)).await;
        execute::<Result<String, Error>, ReleaseErrors, _>(
            Call::new(Some(&run), "tool", short, &1),
            async { Ok("fresh".to_string()) },
        )
        .await
    };
    let (stale, fresh) = tokio::join!(stale, fresh);
    assert!(
        matches!(
            stale,
            Err(Error::LostLease {
                lost_to: idem_core::LostTo::AnotherCall,
                ..
            })
        ),
        "{stale:?}"
    );
    let message = stale.unwrap_err().to_string();
    assert!(message.contains("taken over by another call"), "{message}");
    assert_eq!(fresh.unwrap().unwrap(), "fresh");
    let replay = execute::<Result<String, Error>, ReleaseErrors, _>(
        Call::new(Some(&run), "tool", short, &1),
        async { Ok("never".to_string()) },
    )
    .await;
    assert_eq!(replay.unwrap().unwrap(), "fresh");
}

#[tokio::test]
async fn the_key_is_visible_inside_the_body_and_nested_calls_have_their_own() {
    let run = memory_run("run-key");
    assert!(current_key().is_none());
    let outer_call = Call::new(Some(&run), "outer", Options::new(), &1).unwrap();
    let outer_key = outer_call.key().clone();
    let outer = execute::<Result<(String, String, String), Error>, ReleaseErrors, _>(
        Ok(outer_call),
        async {
            let before = current_key().unwrap().to_string();
            // The nested call finds the ambient run, and gets its own key.
            let inner = execute::<Result<String, Error>, ReleaseErrors, _>(
                Call::new(None, "inner", Options::new(), &1),
                async { Ok(current_key().unwrap().to_string()) },
            )
            .await??;
            let after = current_key().unwrap().to_string();
            Ok((before, inner, after))
        },
    );
    let seen = run.scope(outer).await.unwrap().unwrap();
    assert_eq!(seen.0, outer_key.as_str());
    assert_eq!(seen.2, outer_key.as_str());
    assert_ne!(seen.1, seen.0);
    assert!(seen.1.starts_with("inner."));
}

#[tokio::test]
async fn call_ids_allow_intentional_repeats_and_tenants_never_share() {
    let store = MemoryStore::new();
    let outbox = Outbox::default();
    let input = email("ada@example.com", "reminder");
    let base = Run::new("run-1").with_store(store.clone());
    for run in [
        base.clone().with_call_id("call_1"),
        base.clone().with_call_id("call_1"), // a retry of call_1
        base.clone().with_call_id("call_2"), // the model asked again
        base.clone().with_tenant("acme"),
        base.clone().with_tenant("globex"),
    ] {
        run.scope(outbox.send(&input, Options::new()))
            .await
            .unwrap()
            .unwrap();
    }
    assert_eq!(outbox.sent(), 4);
}

#[test]
fn sync_tools_run_once_in_a_sync_scope() {
    let run = memory_run("run-sync");
    let runs = AtomicUsize::new(0);
    let charge = |amount: u32| {
        execute_blocking::<Result<String, Error>, ReleaseErrors, _>(
            Call::new(None, "charge", Options::new(), &amount),
            || {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok(format!("ch_{amount}_{}", current_key().unwrap()))
            },
        )
    };
    let a = run.sync_scope(|| charge(500)).unwrap().unwrap();
    let b = run.sync_scope(|| charge(500)).unwrap().unwrap();
    assert_eq!(a, b);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert!(matches!(charge(500), Err(Error::NoRun { .. })));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_duplicates_execute_once_on_memory_and_sled() {
    let dir = tempfile::tempdir().unwrap();
    let stores: [Arc<dyn Store>; 2] = [
        Arc::new(MemoryStore::new()),
        Arc::new(SledStore::open(dir.path()).unwrap()),
    ];
    for store in stores {
        let run = Run::new("run-64").with_shared_store(store.clone());
        let outbox = Outbox::default();
        let input = email("ada@example.com", "once");
        let tasks: Vec<_> = (0..64)
            .map(|_| {
                let (run, outbox, input) = (run.clone(), outbox.clone(), input.clone());
                tokio::spawn(async move { run.scope(outbox.send(&input, Options::new())).await })
            })
            .collect();
        let mut values = Vec::new();
        for t in tasks {
            values.push(t.await.unwrap().unwrap().unwrap());
        }
        assert_eq!(outbox.sent(), 1);
        assert!(values.iter().all(|v| v == &values[0]), "{values:?}");
        // The store holds the completed result the callers got.
        let key = Call::new(Some(&run), "send_email", Options::new(), &input).unwrap();
        let record = store.get(key.key()).await.unwrap().unwrap();
        let State::Completed { result } = record.state else {
            panic!("{record:?}")
        };
        assert_eq!(
            serde_json::from_slice::<String>(&result).unwrap(),
            values[0]
        );
        let parts = KeyParts {
            tenant: None,
            run_id: run.id(),
            call_id: None,
            tool: "send_email",
        };
        assert_eq!(record.fingerprint, Fingerprint::of(&parts, &input).unwrap());
    }
}

/// Nests `0` arrays deep, without building the structure in memory.
struct Nested(u32);

impl Serialize for Nested {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        if self.0 == 0 {
            return s.serialize_u8(0);
        }
        let mut seq = s.serialize_seq(Some(1))?;
        seq.serialize_element(&Nested(self.0 - 1))?;
        seq.end()
    }
}

#[tokio::test]
async fn absurdly_nested_input_is_a_typed_error_not_a_stack_overflow() {
    let run = memory_run("run-deep");
    let ran = AtomicUsize::new(0);
    let err = execute::<Result<(), Error>, ReleaseErrors, _>(
        Call::new(Some(&run), "tool", Options::new(), &Nested(1_000_000)),
        async {
            ran.fetch_add(1, Ordering::SeqCst);
            Ok(())
        },
    )
    .await
    .unwrap_err();
    assert!(matches!(err, Error::Input { .. }), "{err}");
    assert!(err.to_string().contains("nested deeper"), "{err}");
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    // Reasonable nesting still works, and the depth count recovered after the error.
    execute::<Result<(), Error>, ReleaseErrors, _>(
        Call::new(Some(&run), "tool", Options::new(), &Nested(100)),
        async { Ok(()) },
    )
    .await
    .unwrap()
    .unwrap();
}

/// A stored result whose `Deserialize` calls another tool on the same store: decoding
/// runs user code, so the hit path must hold no store lock while it decodes (the
/// inner call's claim would wait on it forever).
#[test]
fn a_result_may_call_a_tool_on_the_same_store_while_it_is_replayed() {
    /// The run the decode's tool call uses.
    static RUN: std::sync::Mutex<Option<Run>> = std::sync::Mutex::new(None);
    static INNER_RUNS: AtomicUsize = AtomicUsize::new(0);

    #[derive(Debug, Serialize)]
    struct Receipt(u32);

    impl<'de> Deserialize<'de> for Receipt {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            let n = u32::deserialize(d)?;
            let run = RUN.lock().unwrap().clone();
            let call = Call::new(run.as_ref(), "audit_replay", Options::new(), &n);
            execute_blocking::<Result<(), Error>, ReleaseErrors, _>(call, || {
                INNER_RUNS.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })
            .map_err(serde::de::Error::custom)?
            .map_err(serde::de::Error::custom)?;
            Ok(Receipt(n))
        }
    }

    let dir = tempfile::tempdir().unwrap();
    for store in [
        Arc::new(MemoryStore::new()) as Arc<dyn Store>,
        Arc::new(SledStore::open(dir.path()).unwrap()),
    ] {
        INNER_RUNS.store(0, Ordering::SeqCst);
        let run = Run::new("replay-calls-a-tool").with_shared_store(store);
        *RUN.lock().unwrap() = Some(run.clone());
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let receipt = |n: u32| {
                let call = Call::new(Some(&run), "issue_receipt", Options::new(), &"order-1");
                execute_blocking::<Result<Receipt, Error>, ReleaseErrors, _>(call, move || {
                    Ok(Receipt(n))
                })
                .map(|r| r.map(|r| r.0))
            };
            let _ = tx.send((receipt(7), receipt(8)));
        });
        let (first, replayed) = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the replay never finished: the store held its lock while decoding");
        assert_eq!(first.unwrap().unwrap(), 7);
        assert_eq!(
            replayed.unwrap().unwrap(),
            7,
            "the stored receipt is replayed"
        );
        assert_eq!(
            INNER_RUNS.load(Ordering::SeqCst),
            1,
            "the decode's own tool call ran once"
        );
    }
}

/// A runtime built without timers (`enable_time` not called): a body that outlives its
/// lease keeps its claim, and a duplicate waits for it, neither needing tokio's timer
/// (which panics there).
#[test]
fn waits_and_renewals_need_no_tokio_timer() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let run = Run::new("run-no-timer").with_store(MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    // The body finishes when another thread says so, 600 ms from now: four leases.
    let (done, finished) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(600));
        let _ = done.send(());
    });
    let options = Options::new().lease(Duration::from_millis(150));
    let (first, second) = runtime.block_on(async {
        let owner = {
            let runs = runs.clone();
            execute::<Result<usize, Error>, ReleaseErrors, _>(
                Call::new(Some(&run), "slow", options, &1),
                async move {
                    let n = runs.fetch_add(1, Ordering::SeqCst);
                    let _ = finished.await;
                    Ok(n)
                },
            )
        };
        let duplicate = {
            let runs = runs.clone();
            execute::<Result<usize, Error>, ReleaseErrors, _>(
                Call::new(Some(&run), "slow", options, &1),
                async move { Ok(runs.fetch_add(1, Ordering::SeqCst) + 100) },
            )
        };
        tokio::join!(owner, duplicate)
    });
    assert_eq!(first.unwrap().unwrap(), 0);
    assert_eq!(
        second.unwrap().unwrap(),
        0,
        "the duplicate waited for the owner"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
