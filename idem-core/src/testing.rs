//! The store conformance suite: the [`Store`] contract as executable checks.
//!
//! Run it against any store, including your own:
//!
//! ```no_run
//! # async fn demo() {
//! use std::sync::Arc;
//! idem_core::testing::run_all(Arc::new(idem_core::MemoryStore::new())).await;
//! # }
//! ```
//!
//! Call it from a multi-threaded tokio test (`#[tokio::test(flavor = "multi_thread")]`).
//! Every check uses keys of its own, so a store shared with other data (a database
//! table, a Redis prefix) can be checked in place. A failed check panics with the
//! check's name and what it saw. The suite sleeps through a few short leases and TTLs
//! (a few hundred milliseconds each), so it takes a few seconds.
//!
//! Beside the store's own contract, a few checks make whole calls through it: a body
//! that outlives its lease keeps its claim (the heartbeat renews it), a call dropped by
//! its caller settles its claim at once, and one that can finish alone answers the
//! retry with its own result.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::error::Error;
use crate::key_text::Key;
use crate::options::Options;
use crate::protocol::{execute, execute_finishing, Call, ReleaseErrors};
use crate::run::Run;
use crate::store::{
    Claim, ClaimRequest, Counts, Fenced, Filter, Fingerprint, Origin, Outcome, Record, Resolution,
    State, StateKind, Store, Timestamp, Token,
};

/// The lease and TTL the suite lets expire.
const SHORT: Duration = Duration::from_millis(150);
/// How long the suite sleeps to see `SHORT` expire.
const PAST_SHORT: Duration = Duration::from_millis(300);
const LONG: Duration = Duration::from_secs(3600);
/// The lease the heartbeat keeps renewed in the check that a live body outlives it:
/// renewed every third of it, it lapses only if no renewal lands for 600 ms, a stall a
/// loaded machine does not reach (with `SHORT` a 100 ms stall let a duplicate take
/// the claim over, on Redis under a full test run).
const RENEWED: Duration = Duration::from_millis(600);

/// Runs every check against `store`, one after the other.
pub async fn run_all(store: Arc<dyn Store>) {
    claim_acquires_absent_key(&*store).await;
    claim_is_busy_while_leased(&*store).await;
    completed_result_is_replayed(&*store).await;
    other_fingerprint_is_mismatch(&*store).await;
    release_frees_the_key(&*store).await;
    stale_owner_is_fenced_after_takeover(&*store).await;
    expired_lease_is_abandoned_without_takeover(&*store).await;
    expired_record_is_absent(&*store).await;
    failed_outcome_is_replayed_or_retried(&*store).await;
    completed_result_answers_only_live_completed_records(&*store).await;
    fenced_writes_on_unclaimed_key_are_rejected(&*store).await;
    purge_removes_only_expired(&*store).await;
    renewal_keeps_a_claim_alive(&*store).await;
    renewal_is_fenced(&*store).await;
    zero_lease_renewal_gives_the_claim_up(&*store).await;
    a_claim_lives_by_its_lease_and_a_result_by_its_ttl(&*store).await;
    records_keep_their_origin_and_history(&*store).await;
    listings_filter_and_page(&*store).await;
    delete_matching_removes_only_matching_records(&*store).await;
    settled_deletes_leave_running_claims(&*store).await;
    resolve_settles_only_abandoned_claims(&*store).await;
    concurrent_claims_have_one_winner(store.clone()).await;
    concurrent_takeovers_have_one_winner(store.clone()).await;
    concurrent_calls_execute_once(store.clone()).await;
    a_live_body_keeps_its_claim_past_its_lease(store.clone()).await;
    a_dropped_call_settles_its_claim_at_once(store.clone()).await;
    a_call_that_finishes_alone_answers_the_retry(store).await;
}

fn unique_key(check: &str) -> Key {
    let n = Token::generate().map(|t| t.0).unwrap_or_default();
    Key::from_text(format!("conformance-{check}.{n:032x}"))
}

fn fp(n: u8) -> Fingerprint {
    Fingerprint::from_bytes([n; 32])
}

fn request(fingerprint: Fingerprint, lease: Duration, ttl: Duration) -> ClaimRequest {
    ClaimRequest {
        origin: Origin::new("conformance", "conformance"),
        fingerprint,
        token: Token::generate().expect("conformance: token"),
        lease,
        ttl,
        take_over_expired: true,
        retry_failed: true,
    }
}

macro_rules! check {
    ($name:expr, $cond:expr, $($what:tt)+) => {
        assert!($cond, "conformance check `{}` failed: {}", $name, format!($($what)+))
    };
}

async fn ok<T>(name: &str, r: Result<T, Error>) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("conformance check `{name}` failed: store error: {e}"),
    }
}

/// A claim on an absent key acquires it and leaves an in-progress record with the
/// caller's token and fingerprint.
pub async fn claim_acquires_absent_key(store: &dyn Store) {
    let name = "claim_acquires_absent_key";
    let key = unique_key(name);
    let req = request(fp(1), LONG, LONG);
    let claim = ok(name, store.claim(&key, &req).await).await;
    check!(
        name,
        claim == Claim::Acquired { took_over: false },
        "claim returned {claim:?}"
    );
    let record = ok(name, store.get(&key).await).await;
    check!(
        name,
        matches!(
            record,
            Some(Record { fingerprint, state: State::InProgress { token, .. }, .. })
                if fingerprint == fp(1) && token == req.token
        ),
        "get returned {record:?}"
    );
}

/// A second claim while the first lease is alive is `Busy` until that lease.
pub async fn claim_is_busy_while_leased(store: &dyn Store) {
    let name = "claim_is_busy_while_leased";
    let key = unique_key(name);
    ok(name, store.claim(&key, &request(fp(1), LONG, LONG)).await).await;
    let claim = ok(name, store.claim(&key, &request(fp(1), LONG, LONG)).await).await;
    check!(
        name,
        matches!(claim, Claim::Busy { lease_until } if lease_until > Timestamp::now()),
        "second claim returned {claim:?}"
    );
}

/// After `complete`, claims return the stored bytes unchanged.
pub async fn completed_result_is_replayed(store: &dyn Store) {
    let name = "completed_result_is_replayed";
    let key = unique_key(name);
    let req = request(fp(2), LONG, LONG);
    ok(name, store.claim(&key, &req).await).await;
    let payload = b"{\"message_id\":\"m-1\",\"bytes\":[0,255]}";
    let fenced = ok(
        name,
        store
            .complete(&key, req.token, Outcome::Completed(payload), LONG)
            .await,
    )
    .await;
    check!(
        name,
        fenced == Fenced::Applied,
        "complete returned {fenced:?}"
    );
    for _ in 0..2 {
        let claim = ok(name, store.claim(&key, &request(fp(2), LONG, LONG)).await).await;
        check!(
            name,
            claim == Claim::Completed(payload.to_vec()),
            "claim after complete returned {claim:?}"
        );
    }
    let record = ok(name, store.get(&key).await).await;
    check!(
        name,
        matches!(&record, Some(Record { state: State::Completed { result }, .. }) if result == payload),
        "get returned {record:?}"
    );
}

/// Another fingerprint under a held or completed key is a `Mismatch`.
pub async fn other_fingerprint_is_mismatch(store: &dyn Store) {
    let name = "other_fingerprint_is_mismatch";
    let key = unique_key(name);
    let req = request(fp(3), LONG, LONG);
    ok(name, store.claim(&key, &req).await).await;
    let claim = ok(name, store.claim(&key, &request(fp(4), LONG, LONG)).await).await;
    check!(
        name,
        claim == Claim::Mismatch,
        "claim while held returned {claim:?}"
    );
    ok(
        name,
        store
            .complete(&key, req.token, Outcome::Completed(b"1"), LONG)
            .await,
    )
    .await;
    let claim = ok(name, store.claim(&key, &request(fp(4), LONG, LONG)).await).await;
    check!(
        name,
        claim == Claim::Mismatch,
        "claim after complete returned {claim:?}"
    );
}

/// `release` by the owner frees the key; `release` by anyone else does nothing.
pub async fn release_frees_the_key(store: &dyn Store) {
    let name = "release_frees_the_key";
    let key = unique_key(name);
    let req = request(fp(5), LONG, LONG);
    ok(name, store.claim(&key, &req).await).await;
    let stranger = ok(name, store.release(&key, Token(req.token.0 ^ 1)).await).await;
    check!(
        name,
        stranger == Fenced::LostLease,
        "release by a stranger returned {stranger:?}"
    );
    let claim = ok(name, store.claim(&key, &request(fp(5), LONG, LONG)).await).await;
    check!(
        name,
        matches!(claim, Claim::Busy { .. }),
        "claim after stranger's release returned {claim:?}"
    );
    let fenced = ok(name, store.release(&key, req.token).await).await;
    check!(
        name,
        fenced == Fenced::Applied,
        "release by owner returned {fenced:?}"
    );
    let claim = ok(name, store.claim(&key, &request(fp(5), LONG, LONG)).await).await;
    check!(
        name,
        claim == Claim::Acquired { took_over: false },
        "claim after release returned {claim:?}"
    );
}

/// After its lease expires, a claim is taken over; the stale owner can then neither
/// complete nor release, and the new owner's result is the one kept.
pub async fn stale_owner_is_fenced_after_takeover(store: &dyn Store) {
    let name = "stale_owner_is_fenced_after_takeover";
    let key = unique_key(name);
    let stale = request(fp(6), SHORT, LONG);
    ok(name, store.claim(&key, &stale).await).await;
    tokio::time::sleep(PAST_SHORT).await;
    let fresh = request(fp(6), LONG, LONG);
    let claim = ok(name, store.claim(&key, &fresh).await).await;
    check!(
        name,
        claim == Claim::Acquired { took_over: true },
        "claim after lease expiry returned {claim:?}"
    );
    let late = ok(
        name,
        store
            .complete(&key, stale.token, Outcome::Completed(b"\"stale\""), LONG)
            .await,
    )
    .await;
    check!(
        name,
        late == Fenced::LostLease,
        "stale complete returned {late:?}"
    );
    let late = ok(name, store.release(&key, stale.token).await).await;
    check!(
        name,
        late == Fenced::LostLease,
        "stale release returned {late:?}"
    );
    let applied = ok(
        name,
        store
            .complete(&key, fresh.token, Outcome::Completed(b"\"fresh\""), LONG)
            .await,
    )
    .await;
    check!(
        name,
        applied == Fenced::Applied,
        "new owner's complete returned {applied:?}"
    );
    let claim = ok(name, store.claim(&key, &request(fp(6), LONG, LONG)).await).await;
    check!(
        name,
        claim == Claim::Completed(b"\"fresh\"".to_vec()),
        "replay returned {claim:?}"
    );
}

/// Without takeover (at-most-once), an expired lease is `Abandoned` until deleted.
pub async fn expired_lease_is_abandoned_without_takeover(store: &dyn Store) {
    let name = "expired_lease_is_abandoned_without_takeover";
    let key = unique_key(name);
    ok(name, store.claim(&key, &request(fp(7), SHORT, LONG)).await).await;
    tokio::time::sleep(PAST_SHORT).await;
    let mut req = request(fp(7), LONG, LONG);
    req.take_over_expired = false;
    for _ in 0..2 {
        let claim = ok(name, store.claim(&key, &req).await).await;
        check!(
            name,
            matches!(claim, Claim::Abandoned { .. }),
            "claim returned {claim:?}"
        );
    }
    let deleted = ok(name, store.delete(&key).await).await;
    check!(
        name,
        deleted,
        "delete of the abandoned record returned false"
    );
    let claim = ok(name, store.claim(&key, &req).await).await;
    check!(
        name,
        claim == Claim::Acquired { took_over: false },
        "claim after delete returned {claim:?}"
    );
}

/// A record past its TTL is absent: `get` is `None` and a claim acquires it afresh,
/// whether or not it was purged.
pub async fn expired_record_is_absent(store: &dyn Store) {
    let name = "expired_record_is_absent";
    let key = unique_key(name);
    let req = request(fp(8), LONG, SHORT);
    ok(name, store.claim(&key, &req).await).await;
    ok(
        name,
        store
            .complete(&key, req.token, Outcome::Completed(b"1"), SHORT)
            .await,
    )
    .await;
    tokio::time::sleep(PAST_SHORT).await;
    let record = ok(name, store.get(&key).await).await;
    check!(name, record.is_none(), "get after TTL returned {record:?}");
    let claim = ok(name, store.claim(&key, &request(fp(9), LONG, LONG)).await).await;
    check!(
        name,
        claim == Claim::Acquired { took_over: false },
        "claim after TTL (even with another fingerprint) returned {claim:?}"
    );
}

/// A failed outcome is replayed to claims that do not retry failures, and re-claimed
/// by those that do.
pub async fn failed_outcome_is_replayed_or_retried(store: &dyn Store) {
    let name = "failed_outcome_is_replayed_or_retried";
    let key = unique_key(name);
    let req = request(fp(10), LONG, LONG);
    ok(name, store.claim(&key, &req).await).await;
    ok(
        name,
        store
            .complete(&key, req.token, Outcome::Failed(b"\"card declined\""), LONG)
            .await,
    )
    .await;
    let mut replay = request(fp(10), LONG, LONG);
    replay.retry_failed = false;
    let claim = ok(name, store.claim(&key, &replay).await).await;
    check!(
        name,
        claim == Claim::Failed(b"\"card declined\"".to_vec()),
        "claim returned {claim:?}"
    );
    let claim = ok(name, store.claim(&key, &request(fp(10), LONG, LONG)).await).await;
    check!(
        name,
        claim == Claim::Acquired { took_over: false },
        "retrying claim returned {claim:?}"
    );
}

/// [`Store::with_completed_result`], the hit path without a claim, answers only for a
/// live, completed record of the same fingerprint, and then once, with the stored
/// bytes. (Never answering, the default, passes.)
pub async fn completed_result_answers_only_live_completed_records(store: &dyn Store) {
    let name = "completed_result_answers_only_live_completed_records";
    let answers = |key: &Key, fingerprint: Fingerprint| {
        let mut answers: Vec<Vec<u8>> = Vec::new();
        store.with_completed_result(key, &fingerprint, &mut |bytes| answers.push(bytes.to_vec()));
        answers
    };
    let no_answer = |what: &str, key: &Key, fingerprint: Fingerprint| {
        let answers = answers(key, fingerprint);
        check!(name, answers.is_empty(), "{what}: answered {answers:?}");
    };
    let key = unique_key(name);
    no_answer("absent key", &key, fp(11));
    let req = request(fp(11), LONG, SHORT);
    ok(name, store.claim(&key, &req).await).await;
    no_answer("in progress", &key, fp(11));
    ok(
        name,
        store
            .complete(&key, req.token, Outcome::Completed(b"\"m-2\""), SHORT)
            .await,
    )
    .await;
    let answered = answers(&key, fp(11));
    check!(
        name,
        answered.is_empty() || answered == [b"\"m-2\"".to_vec()],
        "completed: answered {answered:?}"
    );
    no_answer("another fingerprint", &key, fp(12));
    tokio::time::sleep(PAST_SHORT).await;
    no_answer("expired", &key, fp(11));

    let key = unique_key(name);
    let req = request(fp(11), LONG, LONG);
    ok(name, store.claim(&key, &req).await).await;
    ok(
        name,
        store
            .complete(&key, req.token, Outcome::Failed(b"\"declined\""), LONG)
            .await,
    )
    .await;
    no_answer("failed", &key, fp(11));
}

/// `complete` and `release` on a key nobody claimed change nothing.
pub async fn fenced_writes_on_unclaimed_key_are_rejected(store: &dyn Store) {
    let name = "fenced_writes_on_unclaimed_key_are_rejected";
    let key = unique_key(name);
    let token = Token::generate().expect("conformance: token");
    let fenced = ok(
        name,
        store
            .complete(&key, token, Outcome::Completed(b"1"), LONG)
            .await,
    )
    .await;
    check!(
        name,
        fenced == Fenced::LostLease,
        "complete returned {fenced:?}"
    );
    let fenced = ok(name, store.release(&key, token).await).await;
    check!(
        name,
        fenced == Fenced::LostLease,
        "release returned {fenced:?}"
    );
    let record = ok(name, store.get(&key).await).await;
    check!(name, record.is_none(), "get returned {record:?}");
}

/// `purge_expired` keeps live records; expired ones are absent after it (removed by
/// the purge, or by the store's own expiry).
pub async fn purge_removes_only_expired(store: &dyn Store) {
    let name = "purge_removes_only_expired";
    let short = unique_key(name);
    let long = unique_key(name);
    for (key, ttl) in [(&short, SHORT), (&long, LONG)] {
        let req = request(fp(11), LONG, ttl);
        ok(name, store.claim(key, &req).await).await;
        ok(
            name,
            store
                .complete(key, req.token, Outcome::Completed(b"1"), ttl)
                .await,
        )
        .await;
    }
    tokio::time::sleep(PAST_SHORT).await;
    ok(name, store.purge_expired().await).await;
    let gone = ok(name, store.get(&short).await).await;
    check!(name, gone.is_none(), "expired record after purge: {gone:?}");
    let kept = ok(name, store.get(&long).await).await;
    check!(name, kept.is_some(), "live record was purged");
}

/// 64 concurrent claims of one key: exactly one acquires it, the rest are busy.
pub async fn concurrent_claims_have_one_winner(store: Arc<dyn Store>) {
    let name = "concurrent_claims_have_one_winner";
    let key = unique_key(name);
    let took_over = race_for(name, &store, &key, fp(12)).await;
    check!(name, !took_over, "the winner took over an absent key");
}

/// 64 concurrent claims of a key whose claim was abandoned (its lease expired), and
/// then of a key holding a cached error, all taking over or retrying: exactly one
/// acquires it each time, the rest are busy. A store that decides on a read and then
/// writes must write only if the record is still the one it read.
pub async fn concurrent_takeovers_have_one_winner(store: Arc<dyn Store>) {
    let name = "concurrent_takeovers_have_one_winner";
    let abandoned = unique_key(name);
    ok(
        name,
        store.claim(&abandoned, &request(fp(13), SHORT, LONG)).await,
    )
    .await;
    tokio::time::sleep(PAST_SHORT).await;
    let took_over = race_for(name, &store, &abandoned, fp(13)).await;
    check!(
        name,
        took_over,
        "the winner of an abandoned claim did not take it over"
    );

    let failed = unique_key(name);
    let first = request(fp(14), LONG, LONG);
    ok(name, store.claim(&failed, &first).await).await;
    ok(
        name,
        store
            .complete(&failed, first.token, Outcome::Failed(b"\"declined\""), LONG)
            .await,
    )
    .await;
    let took_over = race_for(name, &store, &failed, fp(14)).await;
    check!(
        name,
        !took_over,
        "the winner of a failed key took over a claim"
    );
}

/// Claims `key` from 64 tasks at once; checks that one acquires it and 63 are busy, and
/// returns whether the winner took over.
async fn race_for(name: &str, store: &Arc<dyn Store>, key: &Key, fingerprint: Fingerprint) -> bool {
    let tasks: Vec<_> = (0..64)
        .map(|_| {
            let store = store.clone();
            let key = key.clone();
            tokio::spawn(async move { store.claim(&key, &request(fingerprint, LONG, LONG)).await })
        })
        .collect();
    let (mut winners, mut busy) = (Vec::new(), 0);
    for task in tasks {
        match ok(name, task.await.expect("conformance: task panicked")).await {
            Claim::Acquired { took_over } => winners.push(took_over),
            Claim::Busy { .. } => busy += 1,
            other => panic!("conformance check `{name}` failed: claim returned {other:?}"),
        }
    }
    check!(
        name,
        winners.len() == 1 && busy == 63,
        "{} acquired, {busy} busy",
        winners.len()
    );
    winners[0]
}

/// 64 concurrent idempotent calls with one key: the operation runs once, and all 64
/// callers receive its value.
pub async fn concurrent_calls_execute_once(store: Arc<dyn Store>) {
    let name = "concurrent_calls_execute_once";
    let run = Run::new(format!("{}", unique_key(name))).with_shared_store(store);
    let runs = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..64)
        .map(|_| {
            let run = run.clone();
            let runs = runs.clone();
            tokio::spawn(async move {
                let call = Call::new(Some(&run), "conformance_tool", Options::new(), &"input");
                execute::<Result<String, Error>, ReleaseErrors, _>(call, async move {
                    let n = runs.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    Ok(format!("value-{n}"))
                })
                .await
            })
        })
        .collect();
    let mut values = Vec::new();
    for task in tasks {
        let result = task.await.expect("conformance: task panicked");
        match result {
            Ok(Ok(v)) => values.push(v),
            other => panic!("conformance check `{name}` failed: a caller got {other:?}"),
        }
    }
    let executions = runs.load(Ordering::SeqCst);
    check!(
        name,
        executions == 1,
        "the operation ran {executions} times"
    );
    check!(
        name,
        values.iter().all(|v| v == "value-0"),
        "callers got different values: {values:?}"
    );
}

/// Renewals keep a claim alive for as long as they come, well past its first lease;
/// when they stop, the claim runs out one lease after the last.
pub async fn renewal_keeps_a_claim_alive(store: &dyn Store) {
    let name = "renewal_keeps_a_claim_alive";
    let key = unique_key(name);
    let owner = request(fp(20), SHORT, LONG);
    ok(name, store.claim(&key, &owner).await).await;
    for _ in 0..8 {
        tokio::time::sleep(SHORT / 3).await;
        let renewed = ok(name, store.renew(&key, owner.token, SHORT, LONG).await).await;
        check!(
            name,
            renewed == Fenced::Applied,
            "renew returned {renewed:?}"
        );
        let claim = ok(name, store.claim(&key, &request(fp(20), LONG, LONG)).await).await;
        check!(
            name,
            matches!(claim, Claim::Busy { .. }),
            "claim of a renewed key returned {claim:?}"
        );
    }
    tokio::time::sleep(PAST_SHORT).await;
    let claim = ok(name, store.claim(&key, &request(fp(20), LONG, LONG)).await).await;
    check!(
        name,
        claim == Claim::Acquired { took_over: true },
        "claim after the renewals stopped returned {claim:?}"
    );
}

/// Only the owner renews, only while the key is its claim: a stranger, an owner whose
/// claim was taken over or completed, or a key nobody claimed get `LostLease`. An owner
/// whose lease ran out without a takeover gets its claim back.
pub async fn renewal_is_fenced(store: &dyn Store) {
    let name = "renewal_is_fenced";
    let key = unique_key(name);
    let lost = |what: &str, fenced: Fenced| {
        check!(
            name,
            fenced == Fenced::LostLease,
            "{what}: renew returned {fenced:?}"
        )
    };
    let nobody = ok(name, store.renew(&key, Token(7), LONG, LONG).await).await;
    lost("unclaimed key", nobody);

    let owner = request(fp(21), SHORT, LONG);
    ok(name, store.claim(&key, &owner).await).await;
    let stranger = ok(
        name,
        store
            .renew(&key, Token(owner.token.0 ^ 1), LONG, LONG)
            .await,
    )
    .await;
    lost("stranger", stranger);
    tokio::time::sleep(PAST_SHORT).await;
    let revived = ok(name, store.renew(&key, owner.token, LONG, LONG).await).await;
    check!(
        name,
        revived == Fenced::Applied,
        "an owner whose lease ran out unclaimed could not renew: {revived:?}"
    );
    let claim = ok(name, store.claim(&key, &request(fp(21), LONG, LONG)).await).await;
    check!(
        name,
        matches!(claim, Claim::Busy { .. }),
        "claim after the revival returned {claim:?}"
    );

    let key = unique_key(name);
    let stale = request(fp(22), SHORT, LONG);
    ok(name, store.claim(&key, &stale).await).await;
    tokio::time::sleep(PAST_SHORT).await;
    let fresh = request(fp(22), LONG, LONG);
    ok(name, store.claim(&key, &fresh).await).await;
    let late = ok(name, store.renew(&key, stale.token, LONG, LONG).await).await;
    lost("owner taken over", late);
    ok(
        name,
        store
            .complete(&key, fresh.token, Outcome::Completed(b"1"), LONG)
            .await,
    )
    .await;
    let done = ok(name, store.renew(&key, fresh.token, LONG, LONG).await).await;
    lost("completed key", done);
    let record = ok(name, store.get(&key).await).await;
    check!(
        name,
        matches!(&record, Some(Record { state: State::Completed { result }, .. }) if result == b"1"),
        "renewals changed a completed record: {record:?}"
    );
}

/// A zero-lease renewal gives the claim up at once: a claim that does not take over
/// finds it abandoned (until the TTL after it), one that does takes it over.
pub async fn zero_lease_renewal_gives_the_claim_up(store: &dyn Store) {
    let name = "zero_lease_renewal_gives_the_claim_up";
    let key = unique_key(name);
    let owner = request(fp(23), LONG, LONG);
    ok(name, store.claim(&key, &owner).await).await;
    let given_up = ok(
        name,
        store.renew(&key, owner.token, Duration::ZERO, LONG).await,
    )
    .await;
    check!(
        name,
        given_up == Fenced::Applied,
        "zero-lease renew returned {given_up:?}"
    );
    let mut at_most_once = request(fp(23), LONG, LONG);
    at_most_once.take_over_expired = false;
    let claim = ok(name, store.claim(&key, &at_most_once).await).await;
    let floor = Timestamp::now().after(LONG - Duration::from_secs(60));
    check!(
        name,
        matches!(claim, Claim::Abandoned { expires_at } if expires_at > floor),
        "at-most-once claim of a claim given up returned {claim:?}"
    );
    let claim = ok(name, store.claim(&key, &request(fp(23), LONG, LONG)).await).await;
    check!(
        name,
        claim == Claim::Acquired { took_over: true },
        "at-least-once claim of a claim given up returned {claim:?}"
    );
}

/// A claim lives by its lease, however short its TTL: it is still held (and can be
/// completed) after the TTL has passed. The result then lives for its TTL from the
/// completion.
pub async fn a_claim_lives_by_its_lease_and_a_result_by_its_ttl(store: &dyn Store) {
    let name = "a_claim_lives_by_its_lease_and_a_result_by_its_ttl";
    let key = unique_key(name);
    let owner = request(fp(24), LONG, SHORT);
    ok(name, store.claim(&key, &owner).await).await;
    tokio::time::sleep(PAST_SHORT).await;
    let record = ok(name, store.get(&key).await).await;
    check!(
        name,
        matches!(
            record,
            Some(Record {
                state: State::InProgress { .. },
                ..
            })
        ),
        "a claim past its TTL but within its lease reads as {record:?}"
    );
    let claim = ok(name, store.claim(&key, &request(fp(24), LONG, SHORT)).await).await;
    check!(
        name,
        matches!(claim, Claim::Busy { .. }),
        "a claim past its TTL but within its lease was claimed again: {claim:?}"
    );
    let completed = ok(
        name,
        store
            .complete(&key, owner.token, Outcome::Completed(b"\"late\""), SHORT)
            .await,
    )
    .await;
    check!(
        name,
        completed == Fenced::Applied,
        "completing a claim past its TTL returned {completed:?}"
    );
    let claim = ok(name, store.claim(&key, &request(fp(24), LONG, SHORT)).await).await;
    check!(
        name,
        claim == Claim::Completed(b"\"late\"".to_vec()),
        "claim after completion returned {claim:?}"
    );
    tokio::time::sleep(PAST_SHORT).await;
    let record = ok(name, store.get(&key).await).await;
    check!(
        name,
        record.is_none(),
        "a result past its TTL from completion reads as {record:?}"
    );
}

/// `record` encoded as idem 0.1 wrote it (record format 1, which kept no metadata),
/// for checking that a store still reads what such a build stored. The Redis store
/// counts a record's times from the moment it stored it: give such a record times
/// from 0.
pub fn format_1_bytes(record: &Record) -> Vec<u8> {
    crate::record::encode_format_1(record)
}

/// A request under `origin`.
fn request_of(origin: &Origin, fingerprint: Fingerprint, lease: Duration) -> ClaimRequest {
    ClaimRequest {
        origin: origin.clone(),
        ..request(fingerprint, lease, LONG)
    }
}

/// An origin of its own: a unique run, with a tenant and a call id.
fn unique_origin(check: &str, tool: &str) -> Origin {
    Origin {
        tenant: Some("tenant-é".into()),
        run_id: unique_key(check).to_string().into(),
        call_id: Some("call_1".into()),
        tool: tool.into(),
    }
}

/// Whether `t` is within a minute of this process's clock (a store may keep the
/// metadata's times by a server's clock).
fn about_now(t: Timestamp) -> bool {
    let now = Timestamp::now().as_millis();
    t.as_millis().abs_diff(now) < 60_000
}

/// A record keeps who claimed it (run, tenant, call id, tool) and its history: when it
/// was first claimed, last renewed and completed, and how many attempts and takeovers
/// it took. A takeover and a retry of a cached error go on with the history.
pub async fn records_keep_their_origin_and_history(store: &dyn Store) {
    let name = "records_keep_their_origin_and_history";
    let key = unique_key(name);
    let origin = unique_origin(name, "send_email");
    let first = request_of(&origin, fp(30), SHORT);
    ok(name, store.claim(&key, &first).await).await;
    let record = ok(name, store.get(&key).await).await;
    let meta = record.as_ref().map(|r| r.meta.clone()).unwrap_or_default();
    check!(
        name,
        meta.origin.as_ref() == Some(&origin)
            && about_now(meta.claimed_at)
            && meta.completed_at.is_none()
            && meta.renewed_at.is_none()
            && (meta.attempts, meta.takeovers) == (1, 0),
        "a fresh claim reads as {record:?}"
    );
    let claimed_at = meta.claimed_at;
    tokio::time::sleep(PAST_SHORT).await;
    let second = request_of(&origin, fp(30), LONG);
    let claim = ok(name, store.claim(&key, &second).await).await;
    check!(
        name,
        claim == Claim::Acquired { took_over: true },
        "takeover returned {claim:?}"
    );
    ok(name, store.renew(&key, second.token, LONG, LONG).await).await;
    let record = ok(name, store.get(&key).await).await;
    let meta = record.as_ref().map(|r| r.meta.clone()).unwrap_or_default();
    check!(
        name,
        meta.origin.as_ref() == Some(&origin)
            && meta.claimed_at == claimed_at
            && meta.renewed_at.is_some_and(about_now)
            && (meta.attempts, meta.takeovers) == (2, 1),
        "a claim taken over, then renewed, reads as {record:?}"
    );
    let done = store.complete(&key, second.token, Outcome::Failed(b"\"declined\""), LONG);
    ok(name, done.await).await;
    let record = ok(name, store.get(&key).await).await;
    let meta = record.as_ref().map(|r| r.meta.clone()).unwrap_or_default();
    check!(
        name,
        meta.origin.as_ref() == Some(&origin)
            && meta.claimed_at == claimed_at
            && meta.completed_at.is_some_and(about_now)
            && meta.renewed_at.is_some()
            && (meta.attempts, meta.takeovers) == (2, 1),
        "a completed claim reads as {record:?}"
    );
    let third = request_of(&origin, fp(30), LONG);
    let claim = ok(name, store.claim(&key, &third).await).await;
    check!(
        name,
        claim == Claim::Acquired { took_over: false },
        "retry returned {claim:?}"
    );
    let record = ok(name, store.get(&key).await).await;
    let meta = record.as_ref().map(|r| r.meta.clone()).unwrap_or_default();
    check!(
        name,
        meta.claimed_at == claimed_at
            && meta.completed_at.is_none()
            && (meta.attempts, meta.takeovers) == (3, 1),
        "a retried error reads as {record:?}"
    );
}

/// Every key listed under `filter`, walking pages of `limit`; fails on a key listed
/// twice or a record that does not match.
async fn listed(name: &str, store: &dyn Store, filter: &Filter, limit: usize) -> Vec<Key> {
    let (mut keys, mut after, mut pages) = (Vec::new(), None, 0);
    loop {
        let page = ok(name, store.list(filter, after.as_ref(), limit).await).await;
        pages += 1;
        check!(name, pages < 100_000, "the listing never ends");
        for listed in page.records {
            check!(
                name,
                filter.matches(&listed.key, &listed.record, page.now),
                "listed {listed:?}, which does not match {filter:?}"
            );
            check!(
                name,
                !keys.contains(&listed.key),
                "{} listed twice",
                listed.key
            );
            keys.push(listed.key);
        }
        match page.next {
            Some(next) => after = Some(next),
            None => return keys,
        }
    }
}

/// A run's records in each state: 6 completed, 3 running, 2 abandoned, 2 failed (and
/// 3 of another tool, completed); returns their keys by state.
async fn fill_run(name: &str, store: &dyn Store, origin: &Origin) -> Vec<(StateKind, Key)> {
    let mut made = Vec::new();
    let plan = [
        (StateKind::Completed, 6),
        (StateKind::Running, 3),
        (StateKind::Abandoned, 2),
        (StateKind::Failed, 2),
    ];
    for (kind, n) in plan {
        for _ in 0..n {
            let key = unique_key(name);
            let lease = if kind == StateKind::Abandoned {
                SHORT
            } else {
                LONG
            };
            let req = request_of(origin, fp(31), lease);
            ok(name, store.claim(&key, &req).await).await;
            let outcome = match kind {
                StateKind::Completed => Some(Outcome::Completed(b"{\"id\":\"m-1\"}")),
                StateKind::Failed => Some(Outcome::Failed(b"\"declined\"")),
                _ => None,
            };
            if let Some(outcome) = outcome {
                ok(name, store.complete(&key, req.token, outcome, LONG).await).await;
            }
            made.push((kind, key));
        }
    }
    let other_tool = Origin {
        tool: "charge_card".into(),
        ..origin.clone()
    };
    for _ in 0..3 {
        let key = unique_key(name);
        let req = request_of(&other_tool, fp(31), LONG);
        ok(name, store.claim(&key, &req).await).await;
        let done = store.complete(&key, req.token, Outcome::Completed(b"1"), LONG);
        ok(name, done.await).await;
        made.push((StateKind::Completed, key));
    }
    tokio::time::sleep(PAST_SHORT).await;
    made
}

/// Listings walk every matching record once, page by page, whatever the page size;
/// each filter (run, tenant, tool, state, age) keeps exactly its records; counts agree.
pub async fn listings_filter_and_page(store: &dyn Store) {
    let name = "listings_filter_and_page";
    let origin = unique_origin(name, "send_email");
    let made = fill_run(name, store, &origin).await;
    let run = Filter {
        run_id: Some(origin.run_id.to_string()),
        ..Filter::default()
    };
    let mut all: Vec<Key> = made.iter().map(|(_, k)| k.clone()).collect();
    all.sort();
    for limit in [1, 4, 1000] {
        let mut keys = listed(name, store, &run, limit).await;
        keys.sort();
        check!(
            name,
            keys == all,
            "pages of {limit} listed {} of {} records",
            keys.len(),
            all.len()
        );
    }
    for kind in StateKind::ALL {
        let filter = Filter {
            state: Some(kind),
            ..run.clone()
        };
        let mut keys = listed(name, store, &filter, 5).await;
        keys.sort();
        let mut want: Vec<Key> = made
            .iter()
            .filter(|(k, _)| *k == kind)
            .map(|(_, k)| k.clone())
            .collect();
        want.sort();
        check!(
            name,
            keys == want,
            "state {kind} listed {keys:?}, made {want:?}"
        );
    }
    let tool = Filter {
        tool: Some("charge_card".into()),
        ..run.clone()
    };
    check!(
        name,
        listed(name, store, &tool, 2).await.len() == 3,
        "the tool filter"
    );
    let other_tenant = Filter {
        tenant: Some("someone else".into()),
        ..run.clone()
    };
    check!(
        name,
        listed(name, store, &other_tenant, 10).await.is_empty(),
        "the tenant filter"
    );
    let tenant = Filter {
        tenant: origin.tenant.as_deref().map(str::to_owned),
        ..run.clone()
    };
    check!(
        name,
        listed(name, store, &tenant, 10).await.len() == all.len(),
        "the tenant filter"
    );
    let old = Filter {
        claimed_before: Some(Timestamp::from_millis(
            Timestamp::now().as_millis() - 3_600_000,
        )),
        ..run.clone()
    };
    check!(
        name,
        listed(name, store, &old, 10).await.is_empty(),
        "the age filter kept new records"
    );
    let young = Filter {
        claimed_before: Some(Timestamp::now().after(Duration::from_secs(3600))),
        ..run.clone()
    };
    check!(
        name,
        listed(name, store, &young, 10).await.len() == all.len(),
        "the age filter"
    );
    let counts = ok(name, store.count(&run).await).await;
    let want = Counts {
        running: 3,
        abandoned: 2,
        completed: 9,
        failed: 2,
        unreadable: 0,
    };
    check!(name, counts == want, "counted {counts:?}");
}

/// Removing a run's records removes those and nothing else.
pub async fn delete_matching_removes_only_matching_records(store: &dyn Store) {
    let name = "delete_matching_removes_only_matching_records";
    let origin = unique_origin(name, "send_email");
    let bystander = unique_origin(name, "send_email");
    let made = fill_run(name, store, &origin).await;
    let kept = fill_run(name, store, &bystander).await;
    let run = |o: &Origin| Filter {
        run_id: Some(o.run_id.to_string()),
        ..Filter::default()
    };
    let removed = ok(name, store.delete_matching(&run(&origin)).await).await;
    check!(
        name,
        removed == made.len() as u64,
        "removed {removed} of {} records",
        made.len()
    );
    for (_, key) in &made {
        let record = ok(name, store.get(key).await).await;
        check!(name, record.is_none(), "{key} is still there: {record:?}");
    }
    let left = ok(name, store.count(&run(&bystander)).await).await;
    check!(
        name,
        left.total() == kept.len() as u64,
        "another run kept {left:?}"
    );
}

/// Deletes that leave running calls' claims (what `idem evict` does without `--force`):
/// `delete_settled` removes a completed, failed or abandoned record and keeps a running
/// claim; `delete_settled_matching` (`delete_matching` by each settled state) removes a
/// run's records but its running claims.
pub async fn settled_deletes_leave_running_claims(store: &dyn Store) {
    let name = "settled_deletes_leave_running_claims";
    let origin = unique_origin(name, "send_email");
    let made = fill_run(name, store, &origin).await;
    for (kind, key) in &made {
        let removed = ok(name, store.delete_settled(key).await).await;
        let there = ok(name, store.get(key).await).await.is_some();
        match kind {
            StateKind::Running => check!(
                name,
                !removed && there,
                "a running claim was removed ({removed}, still there: {there})"
            ),
            _ => check!(
                name,
                removed && !there,
                "a {kind} record was not removed ({removed}, still there: {there})"
            ),
        }
    }
    let absent = ok(name, store.delete_settled(&unique_key(name)).await).await;
    check!(name, !absent, "an absent key was reported removed");

    let origin = unique_origin(name, "send_email");
    let made = fill_run(name, store, &origin).await;
    let run = Filter {
        run_id: Some(origin.run_id.to_string()),
        ..Filter::default()
    };
    let removed = ok(
        name,
        crate::store::delete_settled_matching(store, &run).await,
    )
    .await;
    let running = made.iter().filter(|(k, _)| *k == StateKind::Running);
    check!(
        name,
        removed == (made.len() - running.clone().count()) as u64,
        "removed {removed} of {} settled records",
        made.len() - running.clone().count()
    );
    for (_, key) in running {
        let record = ok(name, store.get(key).await).await;
        check!(
            name,
            record.is_some(),
            "the running claim {key} was removed"
        );
    }
}

/// An abandoned claim is resolved as completed (the next call replays the result) or
/// released (the next call runs); a running claim, another token or a completed record
/// are left as they are.
pub async fn resolve_settles_only_abandoned_claims(store: &dyn Store) {
    let name = "resolve_settles_only_abandoned_claims";
    let origin = unique_origin(name, "charge_card");
    let (done, gone) = (unique_key(name), unique_key(name));
    let (a, b) = (
        request_of(&origin, fp(32), SHORT),
        request_of(&origin, fp(33), SHORT),
    );
    ok(name, store.claim(&done, &a).await).await;
    ok(name, store.claim(&gone, &b).await).await;
    let completed = Resolution::Completed {
        result: b"{\"charge\":\"ch_1\"}",
        ttl: LONG,
    };
    let early = ok(name, store.resolve(&done, a.token, completed).await).await;
    check!(
        name,
        early == Fenced::LostLease,
        "a running claim was resolved: {early:?}"
    );
    tokio::time::sleep(PAST_SHORT).await;
    let wrong = ok(name, store.resolve(&done, b.token, completed).await).await;
    check!(
        name,
        wrong == Fenced::LostLease,
        "another token resolved a claim: {wrong:?}"
    );
    let applied = ok(name, store.resolve(&done, a.token, completed).await).await;
    check!(
        name,
        applied == Fenced::Applied,
        "resolving as completed returned {applied:?}"
    );
    let record = ok(name, store.get(&done).await).await;
    check!(
        name,
        matches!(&record, Some(Record { state: State::Completed { result }, meta, .. })
            if result == b"{\"charge\":\"ch_1\"}" && meta.origin.as_ref() == Some(&origin)
                && meta.completed_at.is_some()),
        "a claim resolved as completed reads as {record:?}"
    );
    let mut at_most_once = request_of(&origin, fp(32), LONG);
    at_most_once.take_over_expired = false;
    let claim = ok(name, store.claim(&done, &at_most_once).await).await;
    check!(
        name,
        claim == Claim::Completed(b"{\"charge\":\"ch_1\"}".to_vec()),
        "the next call after resolving got {claim:?}"
    );
    let again = ok(
        name,
        store.resolve(&done, a.token, Resolution::Released).await,
    )
    .await;
    check!(
        name,
        again == Fenced::LostLease,
        "a completed record was resolved: {again:?}"
    );
    let released = ok(
        name,
        store.resolve(&gone, b.token, Resolution::Released).await,
    )
    .await;
    check!(
        name,
        released == Fenced::Applied,
        "releasing returned {released:?}"
    );
    let mut at_most_once = request_of(&origin, fp(33), LONG);
    at_most_once.take_over_expired = false;
    let claim = ok(name, store.claim(&gone, &at_most_once).await).await;
    check!(
        name,
        claim == Claim::Acquired { took_over: false },
        "the next call after releasing got {claim:?}"
    );
}

/// A run of its own on `store`.
fn run_on(store: &Arc<dyn Store>, check: &str) -> Run {
    Run::new(unique_key(check).to_string()).with_shared_store(store.clone())
}

/// A call whose body runs past its lease (until three fail-fast duplicates, a lease
/// apart, have had their answers) keeps its claim throughout: the duplicates get
/// `InProgress`, the body runs once, and its caller gets its value.
pub async fn a_live_body_keeps_its_claim_past_its_lease(store: Arc<dyn Store>) {
    let name = "a_live_body_keeps_its_claim_past_its_lease";
    let run = run_on(&store, name);
    let options = Options::new().lease(RENEWED);
    let runs = Arc::new(AtomicUsize::new(0));
    // The body runs until the duplicates have had their answers (three leases at
    // least), so that each of them comes while it runs, however slow the machine; a
    // body that never hears so (a duplicate that ran it again) ends after eight.
    let answered = Arc::new(tokio::sync::Notify::new());
    let call = |options: Options, runs: Arc<AtomicUsize>| {
        let answered = Arc::clone(&answered);
        execute::<Result<String, Error>, ReleaseErrors, _>(
            Call::new(Some(&run), "conformance_slow", options, &"input"),
            async move {
                let n = runs.fetch_add(1, Ordering::SeqCst);
                let _ = tokio::time::timeout(RENEWED * 8, answered.notified()).await;
                Ok(format!("value-{n}"))
            },
        )
    };
    let owner = call(options, runs.clone());
    let duplicates = async {
        let mut answers = Vec::new();
        for _ in 0..3 {
            tokio::time::sleep(RENEWED).await;
            answers.push(call(options.fail_fast(), runs.clone()).await);
        }
        answered.notify_one();
        answers
    };
    let (owner, duplicates) = tokio::join!(owner, duplicates);
    check!(
        name,
        matches!(&owner, Ok(Ok(v)) if v == "value-0"),
        "the owner got {owner:?}"
    );
    for answer in duplicates {
        check!(
            name,
            matches!(answer, Err(Error::InProgress { .. })),
            "a duplicate during the body got {answer:?}"
        );
    }
    let executions = runs.load(Ordering::SeqCst);
    check!(name, executions == 1, "the body ran {executions} times");
}

/// A call dropped by its caller mid-body settles its claim at once: at-least-once, a
/// retry runs at once; at-most-once, a retry gets `OutcomeUnknown` at once. Neither
/// waits out the hour-long lease.
pub async fn a_dropped_call_settles_its_claim_at_once(store: Arc<dyn Store>) {
    let name = "a_dropped_call_settles_its_claim_at_once";
    for options in [Options::new(), Options::new().at_most_once()] {
        let run = run_on(&store, name);
        let options = options.lease(LONG);
        let call = |body: std::pin::Pin<Box<dyn std::future::Future<Output = _> + Send>>| {
            execute::<Result<String, Error>, ReleaseErrors, _>(
                Call::new(Some(&run), "conformance_dropped", options, &"input"),
                body,
            )
        };
        let dropped = tokio::time::timeout(SHORT, call(Box::pin(std::future::pending()))).await;
        check!(
            name,
            dropped.is_err(),
            "the pending call returned {dropped:?}"
        );
        let started = std::time::Instant::now();
        let retry = tokio::time::timeout(
            Duration::from_secs(10),
            call(Box::pin(async { Ok("retried".to_string()) })),
        )
        .await;
        let answered = match options.delivery {
            crate::Delivery::AtLeastOnce => matches!(&retry, Ok(Ok(Ok(v))) if v == "retried"),
            crate::Delivery::AtMostOnce => {
                matches!(retry, Ok(Err(Error::OutcomeUnknown { .. })))
            }
        };
        check!(
            name,
            answered,
            "{:?}: the retry got {retry:?} after {:?}",
            options.delivery,
            started.elapsed()
        );
    }
}

/// A call that can run alone, dropped by its caller mid-body, finishes in the
/// background: the retry waits for it and gets its value, and the body ran once.
pub async fn a_call_that_finishes_alone_answers_the_retry(store: Arc<dyn Store>) {
    let name = "a_call_that_finishes_alone_answers_the_retry";
    let run = run_on(&store, name);
    let runs = Arc::new(AtomicUsize::new(0));
    let call = |runs: Arc<AtomicUsize>| {
        execute_finishing::<Result<String, Error>, ReleaseErrors, _>(
            Call::new(
                Some(&run),
                "conformance_finishing",
                Options::new().lease(LONG),
                &"input",
            ),
            move || async move {
                let n = runs.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(SHORT * 2).await;
                Ok(format!("value-{n}"))
            },
        )
    };
    let dropped = tokio::time::timeout(SHORT / 3, call(runs.clone())).await;
    check!(
        name,
        dropped.is_err(),
        "the first call returned {dropped:?}"
    );
    let retry = tokio::time::timeout(Duration::from_secs(10), call(runs.clone())).await;
    check!(
        name,
        matches!(&retry, Ok(Ok(Ok(v))) if v == "value-0"),
        "the retry got {retry:?}"
    );
    let executions = runs.load(Ordering::SeqCst);
    check!(name, executions == 1, "the body ran {executions} times");
}
