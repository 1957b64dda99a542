//! The crash campaign: an agent loop of idempotent tool calls in a worker process that
//! is killed with SIGKILL at chosen and random points, restarted with the same run id,
//! and left to retry to the end. Side effects go to a ledger file that survives the
//! process (one fsynced line per execution). Shared by the `crash_campaign` example
//! (long runs, prints the table) and `tests/crash_campaign.rs` (bounded, asserts).
//!
//! Kill points, by where the worker kills itself: before the claim, after the claim,
//! in the body before the side effect, after the side effect before completion (the
//! crash window), after completion before the call returns; and, from the driver, at a
//! random moment (which lands anywhere, including inside store writes and flushes).
//!
//! Beside them, points where the agent misbehaves in a live process: a cancel point
//! (the agent's `select!` stops waiting for the call there, before or after the side
//! effect, and retries at once) and a panic point (the body panics there; the agent
//! catches it and retries at once). Neither may cost a duplicate outside the window, and
//! no such retry may wait out a lease.
//! `IDEM_CAMPAIGN_TRACE=1` prints each worker run's plan and how it ended.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use idem::store::{Claim, ClaimRequest, Fenced, Outcome, Record, Token};
use idem::{idempotent, Error, Key, Run, Store};
use serde::{Deserialize, Serialize};

/// The environment variable that makes a process a campaign worker (its value: the
/// worker's configuration as JSON).
pub const WORKER_ENV: &str = "IDEM_CAMPAIGN_WORKER";

/// Exit code of a worker whose store did not open.
const REOPEN_FAILED: i32 = 40;
/// Exit code of a worker that got an error other than `OutcomeUnknown`.
const CALL_FAILED: i32 = 41;

/// Which store the worker keeps its records in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum StoreKind {
    /// `SledStore`, in a directory.
    Sled,
    /// `SqliteStore`, in a file.
    Sqlite,
    /// `PostgresStore`, at a URL (table `idem_campaign`).
    Postgres,
    /// `RedisStore`, at a URL (prefix `idem-campaign:`).
    Redis,
}

impl fmt::Display for StoreKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StoreKind::Sled => "sled",
            StoreKind::Sqlite => "sqlite",
            StoreKind::Postgres => "postgres",
            StoreKind::Redis => "redis",
        })
    }
}

/// What happens to a call whose owner crashed after its side effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Policy {
    /// The default: the retry runs the body again.
    AtLeastOnce,
    /// `at_most_once`: the retry gets `OutcomeUnknown`.
    AtMostOnce,
    /// At-least-once, with the body forwarding `idem::current_key()` to a downstream
    /// that deduplicates by it (as Stripe does with `Idempotency-Key`).
    Downstream,
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Policy::AtLeastOnce => "at-least-once",
            Policy::AtMostOnce => "at-most-once",
            Policy::Downstream => "at-least-once + downstream key",
        })
    }
}

/// Where a worker is killed, or where its agent stops waiting or its body panics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Phase {
    /// Before the call claims its key.
    BeforeClaim,
    /// After the claim, before the body starts.
    AfterClaim,
    /// In the body, before the side effect.
    BeforeEffect,
    /// The crash window: the side effect happened, idem has not stored the result.
    AfterEffect,
    /// After the outcome was recorded, before the call returned.
    AfterComplete,
    /// Killed by the driver after a random delay.
    Random,
    /// The agent stops waiting for the call in the body, before the side effect.
    CancelBeforeEffect,
    /// The agent stops waiting for the call after the side effect, before completion.
    CancelAfterEffect,
    /// The body panics before the side effect.
    PanicBeforeEffect,
    /// The body panics after the side effect, before completion.
    PanicAfterEffect,
}

impl Phase {
    /// Whether the process dies here (otherwise it lives on, and the agent retries).
    fn kills(self) -> bool {
        !matches!(
            self,
            Phase::CancelBeforeEffect
                | Phase::CancelAfterEffect
                | Phase::PanicBeforeEffect
                | Phase::PanicAfterEffect
        )
    }
}

const PHASES: [Phase; 10] = [
    Phase::BeforeClaim,
    Phase::AfterClaim,
    Phase::BeforeEffect,
    Phase::AfterEffect,
    Phase::AfterComplete,
    Phase::Random,
    Phase::CancelBeforeEffect,
    Phase::CancelAfterEffect,
    Phase::PanicBeforeEffect,
    Phase::PanicAfterEffect,
];

/// A worker's configuration.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct WorkerConfig {
    store: StoreKind,
    /// A sled directory, or a server URL.
    location: String,
    policy: Policy,
    run_id: String,
    ops: u32,
    /// The worker stops (exits normally) after this many ops: the agent loop pauses
    /// right after a planned kill point that was not reached.
    until: u32,
    dir: PathBuf,
    /// `(op, phase)` at which to die, stop waiting or panic, if anywhere.
    kill: Option<(u32, Phase)>,
    /// The verification pass: its answers go to `verify`, not `returned`.
    verify: bool,
}

// ---------------------------------------------------------------------------------
// The worker
// ---------------------------------------------------------------------------------

static CURRENT_OP: AtomicU32 = AtomicU32::new(u32::MAX);
static KILL: OnceLock<(u32, Phase)> = OnceLock::new();
/// Whether the planned cancel or panic happened (it happens once: not in the retry).
static FIRED: AtomicBool = AtomicBool::new(false);
/// The agent's signal to stop waiting for the call in flight.
static STOP_WAITING: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// Whether this is the planned point, the first time it is reached.
fn planned(phase: Phase) -> bool {
    KILL.get() == Some(&(CURRENT_OP.load(Ordering::SeqCst), phase))
        && (phase.kills() || !FIRED.swap(true, Ordering::SeqCst))
}

/// Dies here if this is the configured kill point.
fn kill_point(phase: Phase) {
    if planned(phase) {
        // SAFETY: kill(2) on our own pid with a valid signal number.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
        loop {
            std::thread::park();
        }
    }
}

/// A point in the body: dies, makes the agent stop waiting, or panics, if planned here.
async fn fault_point(kill: Phase, cancel: Phase, panic: Phase) {
    kill_point(kill);
    if planned(cancel) {
        STOP_WAITING.notify_one();
        // Let the agent's `select!` see it: the call is dropped at this `.await`.
        tokio::task::yield_now().await;
    }
    if planned(panic) {
        panic!("campaign: the body panics at {panic:?}");
    }
}

/// A store that passes every operation through and dies at the kill points around
/// claiming and completing.
struct Killing(Arc<dyn Store>);

#[async_trait]
impl Store for Killing {
    async fn claim(&self, key: &Key, request: &ClaimRequest) -> Result<Claim, Error> {
        kill_point(Phase::BeforeClaim);
        let claim = self.0.claim(key, request).await;
        kill_point(Phase::AfterClaim);
        claim
    }
    async fn complete(
        &self,
        key: &Key,
        token: Token,
        outcome: Outcome<'_>,
        ttl: Duration,
    ) -> Result<Fenced, Error> {
        let fenced = self.0.complete(key, token, outcome, ttl).await;
        kill_point(Phase::AfterComplete);
        fenced
    }
    async fn release(&self, key: &Key, token: Token) -> Result<Fenced, Error> {
        self.0.release(key, token).await
    }
    async fn renew(
        &self,
        key: &Key,
        token: Token,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Fenced, Error> {
        self.0.renew(key, token, lease, ttl).await
    }
    async fn get(&self, key: &Key) -> Result<Option<Record>, Error> {
        self.0.get(key).await
    }
    async fn delete(&self, key: &Key) -> Result<bool, Error> {
        self.0.delete(key).await
    }
    async fn purge_expired(&self) -> Result<u64, Error> {
        self.0.purge_expired().await
    }
}

/// Appends one line to `path` and makes it durable before returning.
fn append_durably(path: &Path, line: &str) -> std::io::Result<()> {
    let mut file = OpenOptions::new().create(true).append(true).open(path)?;
    file.write_all(format!("{line}\n").as_bytes())?;
    file.sync_data()
}

fn lines(path: &Path) -> Vec<String> {
    match File::open(path) {
        Ok(file) => BufReader::new(file).lines().map_while(Result::ok).collect(),
        Err(_) => Vec::new(),
    }
}

/// A tool call's error: idem's, or the ledger's.
#[derive(Debug, thiserror::Error)]
enum OpError {
    #[error(transparent)]
    Idem(#[from] Error),
    #[error("ledger: {0}")]
    Ledger(#[from] std::io::Error),
}

/// A fresh value per execution: a re-execution is visible in what callers get.
fn nonce() -> String {
    static SEQ: AtomicU32 = AtomicU32::new(0);
    format!(
        "{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::SeqCst)
    )
}

/// Before the side effect: a kill, cancel or panic point.
async fn before_effect() {
    fault_point(
        Phase::BeforeEffect,
        Phase::CancelBeforeEffect,
        Phase::PanicBeforeEffect,
    )
    .await;
}

/// After the side effect, before completion: a kill, cancel or panic point.
async fn after_effect() {
    fault_point(
        Phase::AfterEffect,
        Phase::CancelAfterEffect,
        Phase::PanicAfterEffect,
    )
    .await;
}

/// The side effect: one durable ledger line per execution.
fn effect(ledger: &Path, op: u32) -> Result<String, OpError> {
    let nonce = nonce();
    append_durably(ledger, &format!("{op} {nonce}"))?;
    Ok(format!("op{op}-{nonce}"))
}

/// The side effect through a downstream that deduplicates by idem's key: a second
/// request with the same key gets the first one's answer and changes nothing.
fn effect_downstream(ledger: &Path, op: u32) -> Result<String, OpError> {
    let key = idem::current_key().ok_or_else(|| std::io::Error::other("no key in the body"))?;
    let replayed = lines(ledger).into_iter().find_map(|line| {
        let mut parts = line.split(' ');
        let (_op, nonce, k) = (parts.next()?, parts.next()?, parts.next()?);
        (k == key.as_str()).then(|| nonce.to_owned())
    });
    let nonce = match replayed {
        Some(nonce) => nonce,
        None => {
            let nonce = nonce();
            append_durably(ledger, &format!("{op} {nonce} {}", key.as_str()))?;
            nonce
        }
    };
    Ok(format!("op{op}-{nonce}"))
}

// The tools own their inputs, so a call the agent stops waiting for finishes alone.

#[idempotent(name = "campaign_op", lease = "300ms", ttl = "1h")]
async fn at_least_once(ledger: PathBuf, op: u32) -> Result<String, OpError> {
    before_effect().await;
    let value = effect(&ledger, op)?;
    after_effect().await;
    Ok(value)
}

#[idempotent(name = "campaign_op", lease = "300ms", ttl = "1h", at_most_once)]
async fn at_most_once(ledger: PathBuf, op: u32) -> Result<String, OpError> {
    before_effect().await;
    let value = effect(&ledger, op)?;
    after_effect().await;
    Ok(value)
}

#[idempotent(name = "campaign_op", lease = "300ms", ttl = "1h")]
async fn downstream(ledger: PathBuf, op: u32) -> Result<String, OpError> {
    before_effect().await;
    let value = effect_downstream(&ledger, op)?;
    after_effect().await;
    Ok(value)
}

/// How one attempt at a call ended.
enum Attempt {
    Answered(Result<String, OpError>),
    /// The agent stopped waiting (a cancel point).
    StoppedWaiting,
    /// The body panicked, and the panic reached the agent.
    Panicked,
}

/// One attempt at `op`, as the agent makes it: in a task of its own (a panic in the
/// body reaches the agent as the task's), and given up when the body asks it to.
async fn attempt(run: &Run, policy: Policy, ledger: &Path, op: u32) -> Attempt {
    let (run, ledger) = (run.clone(), ledger.to_owned());
    let task = tokio::spawn(async move {
        let call = run.scope(async move {
            match policy {
                Policy::AtLeastOnce => at_least_once(ledger, op).await,
                Policy::AtMostOnce => at_most_once(ledger, op).await,
                Policy::Downstream => downstream(ledger, op).await,
            }
        });
        tokio::select! {
            biased;
            () = STOP_WAITING.notified() => None,
            answer = call => Some(answer),
        }
    });
    match task.await {
        Ok(Some(answer)) => Attempt::Answered(answer),
        Ok(None) => Attempt::StoppedWaiting,
        Err(e) if e.is_panic() => Attempt::Panicked,
        Err(e) => Attempt::Answered(Err(OpError::Ledger(std::io::Error::other(e.to_string())))),
    }
}

/// Runs this process as a campaign worker if `IDEM_CAMPAIGN_WORKER` says so; returns
/// `false` otherwise. Exits the process when it was a worker.
pub fn run_worker_if_asked() -> bool {
    let Ok(config) = std::env::var(WORKER_ENV) else {
        return false;
    };
    let config: WorkerConfig = match serde_json::from_str(&config) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("bad worker configuration: {e}");
            std::process::exit(2);
        }
    };
    // Planned panics are part of the run: keep them out of the output.
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let planned = info
            .payload()
            .downcast_ref::<String>()
            .is_some_and(|m| m.starts_with("campaign: "));
        if !planned {
            report(info);
        }
    }));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let code = runtime.block_on(worker(config));
    std::process::exit(code);
}

async fn open(config: &WorkerConfig) -> Result<Arc<dyn Store>, Error> {
    match config.store {
        #[cfg(feature = "sled")]
        StoreKind::Sled => Ok(Arc::new(idem::SledStore::open(&config.location)?)),
        #[cfg(feature = "sqlite")]
        StoreKind::Sqlite => Ok(Arc::new(idem::SqliteStore::open(&config.location)?)),
        #[cfg(feature = "postgres")]
        StoreKind::Postgres => Ok(Arc::new(
            idem::PostgresStore::builder(&config.location)
                .table("idem_campaign")
                .connect()
                .await?,
        )),
        #[cfg(feature = "redis")]
        StoreKind::Redis => Ok(Arc::new(
            idem::RedisStore::builder(&config.location)
                .prefix("idem-campaign:")
                .connect()
                .await?,
        )),
        #[allow(unreachable_patterns)]
        other => Err(Error::Store {
            store: "campaign",
            source: format!("built without the {other} feature").into(),
        }),
    }
}

async fn worker(config: WorkerConfig) -> i32 {
    if let Some(kill) = config.kill {
        let _ = KILL.set(kill);
    }
    let store = match open(&config).await {
        Ok(store) => store,
        Err(e) => {
            eprintln!("store did not open: {e}");
            return REOPEN_FAILED;
        }
    };
    let run = Run::new(config.run_id.clone()).with_store(Killing(store));
    let ledger = config.dir.join("ledger");
    let answers = config
        .dir
        .join(if config.verify { "verify" } else { "returned" });
    let events = config.dir.join("events");
    // The agent loop: every op in order, from the start (earlier ops are replayed).
    for op in 0..config.until.min(config.ops) {
        CURRENT_OP.store(op, Ordering::SeqCst);
        // A cancel or panic: the agent retries at once, and notes how long the retry
        // took to answer.
        let mut fault: Option<(&str, Instant)> = None;
        let result = loop {
            match attempt(&run, config.policy, &ledger, op).await {
                Attempt::Answered(result) => break result,
                Attempt::StoppedWaiting => fault = Some(("cancel", Instant::now())),
                Attempt::Panicked => fault = Some(("panic", Instant::now())),
            }
        };
        if let Some((what, at)) = fault {
            let waited = at.elapsed().as_micros();
            if let Err(e) = append_durably(&events, &format!("{what} {op} {waited}")) {
                eprintln!("op {op}: cannot record the {what}: {e}");
                return CALL_FAILED;
            }
        }
        let answer = match result {
            Ok(value) => value,
            // The agent records the unknown outcome and moves on (it reconciles later).
            Err(OpError::Idem(Error::OutcomeUnknown { .. })) => "unknown".to_owned(),
            Err(e) => {
                eprintln!("op {op}: {e}");
                return CALL_FAILED;
            }
        };
        if let Err(e) = append_durably(&answers, &format!("{op} {answer}")) {
            eprintln!("op {op}: cannot record the answer: {e}");
            return CALL_FAILED;
        }
    }
    0
}

// ---------------------------------------------------------------------------------
// The driver
// ---------------------------------------------------------------------------------

/// One cell of the campaign: a store, a policy, how many faults (kills, cancels and
/// panics, cycling through every kind of point).
#[derive(Debug, Clone)]
pub struct Cell {
    /// The store the workers keep their records in.
    pub store: StoreKind,
    /// Where it is: a directory or file (sled, SQLite), or a URL (Postgres, Redis).
    pub location: String,
    /// What the tool does with a call whose owner died after its side effect.
    pub policy: Policy,
    /// How many faults to inject.
    pub faults: u32,
    /// Seeds the random kill points and delays.
    pub seed: u64,
}

/// What a cell measured.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// The cell's store.
    pub store: String,
    /// The cell's policy.
    pub policy: String,
    /// Worker processes started, the verification pass included.
    pub runs: u32,
    /// Workers killed with SIGKILL.
    pub kills: u32,
    /// Cancel points the agent stopped waiting at (the call then retried at once).
    pub cancels: u32,
    /// Panic points the body panicked at (the call then retried at once).
    pub panics: u32,
    /// The longest a retry after a cancel or a panic took to answer, in milliseconds.
    pub max_retry_ms: f64,
    /// Faults by where they landed: kills, cancels and panics.
    pub kills_by_phase: BTreeMap<String, u32>,
    /// Tool calls the agent loop makes, each once intended.
    pub ops: u32,
    /// Executions of a side effect, from the ledger.
    pub executions: u32,
    /// Extra executions of ops killed, or whose body panicked, in the crash window.
    pub duplicates_in_window: u32,
    /// Extra executions of any other op: must be zero.
    pub duplicates_elsewhere: u32,
    /// Ops whose caller got `OutcomeUnknown` (at-most-once).
    pub unknown: u32,
    /// Ops that returned a value whose record was later gone or different: must be zero.
    pub lost_completions: u32,
    /// Ops whose callers saw different values: must be zero.
    pub inconsistent_answers: u32,
    /// Workers whose store did not open: must be zero.
    pub reopen_failures: u32,
    /// Workers that failed otherwise, or hung: must be zero.
    pub worker_failures: u32,
    /// How long the cell took.
    pub seconds: f64,
}

/// A small deterministic generator (xorshift64*), so a campaign is reproducible from
/// its seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n.max(1)
    }
}

/// How a worker process ended.
#[derive(Debug)]
enum Exit {
    Done,
    Killed,
    ReopenFailed,
    Failed,
}

/// Runs one cell. `worker` gives the command that starts this program as a worker (the
/// driver adds the configuration to its environment).
pub fn run_cell(cell: &Cell, worker: &dyn Fn() -> Command) -> Report {
    let started = Instant::now();
    let dir = tempfile::tempdir().expect("a temporary directory");
    let location = match cell.store {
        StoreKind::Sled => dir.path().join("store").display().to_string(),
        StoreKind::Sqlite => dir.path().join("store.sqlite").display().to_string(),
        _ => cell.location.clone(),
    };
    let mut ops = cell.faults * 3 + 6;
    let mut config = WorkerConfig {
        store: cell.store,
        location,
        policy: cell.policy,
        run_id: format!(
            "campaign-{}-{}-{:?}-{}",
            cell.seed,
            std::process::id(),
            cell.policy,
            cell.store
        ),
        ops,
        until: ops,
        dir: dir.path().to_owned(),
        kill: None,
        verify: false,
    };
    let mut report = Report {
        store: cell.store.to_string(),
        policy: cell.policy.to_string(),
        ops,
        ..Report::default()
    };
    let mut rng = Rng(cell.seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    // Ops killed (or whose body panicked) in the crash window: their duplicates are
    // expected (at-least-once).
    let mut window_ops = Vec::new();
    let mut faults_done = 0;
    let mut typical_run = Duration::from_millis(50);

    let returned = dir.path().join("returned");
    let ledger = dir.path().join("ledger");
    let events = dir.path().join("events");
    for _ in 0..cell.faults * 8 + 16 {
        let progress = answered_ops(&returned);
        if progress >= ops {
            if faults_done >= cell.faults {
                break;
            }
            // Fault points that were not reached (a random delay past the run's end, a
            // body that does not run again under at-most-once) used the ops up: add
            // some, so every planned fault lands.
            ops += 3;
            config.ops = ops;
        }
        let phase = PHASES[(faults_done % PHASES.len() as u32) as usize];
        let planned = (faults_done < cell.faults).then(|| {
            let op = (progress + rng.below(3) as u32).min(ops - 1);
            (op, phase)
        });
        config.kill = planned.filter(|(_, phase)| *phase != Phase::Random);
        // The worker pauses after the planned op (or a few ops, for a random kill), so
        // a kill point that is not reached costs one short run, not the whole loop.
        config.until = match planned {
            Some((op, Phase::Random)) => (op + 3).min(ops),
            Some((op, _)) => op + 1,
            None => ops,
        };
        // A random kill lands anywhere in a run like the last one that finished.
        let random_delay = planned
            .filter(|(_, phase)| *phase == Phase::Random)
            .map(|_| Duration::from_micros(rng.below(typical_run.as_micros() as u64)));

        let executed_before = ledger_ops(&ledger);
        let events_before = lines(&events).len();
        report.runs += 1;
        let run_started = Instant::now();
        let exit = spawn_and_wait(worker, &config, random_delay);
        if std::env::var_os("IDEM_CAMPAIGN_TRACE").is_some() {
            eprintln!(
                "progress {progress} planned {planned:?} until {} -> {:?}",
                config.until, exit
            );
        }
        if let Exit::Done = exit {
            typical_run = run_started.elapsed();
        }
        // A cancel or panic the worker lived through, and the retry after it.
        let lived = lines(&events).into_iter().skip(events_before).next_back();
        if let (Exit::Done, Some(event), Some((op, phase))) = (&exit, lived, planned) {
            faults_done += 1;
            let retry_ms = event
                .rsplit(' ')
                .next()
                .and_then(|us| us.parse::<f64>().ok())
                .unwrap_or(f64::MAX)
                / 1000.0;
            report.max_retry_ms = report.max_retry_ms.max(retry_ms);
            match phase {
                Phase::CancelBeforeEffect | Phase::CancelAfterEffect => report.cancels += 1,
                _ => report.panics += 1,
            }
            *report
                .kills_by_phase
                .entry(format!("{phase:?}"))
                .or_default() += 1;
            if phase == Phase::PanicAfterEffect {
                window_ops.push(op);
            }
        }
        match exit {
            Exit::Killed => {
                faults_done += 1;
                report.kills += 1;
                let (op, phase) = match planned {
                    // Where a random kill landed: the first op without an answer.
                    Some((_, Phase::Random)) | None => (answered_ops(&returned), Phase::Random),
                    Some(kill) => kill,
                };
                *report
                    .kills_by_phase
                    .entry(format!("{phase:?}"))
                    .or_default() += 1;
                let in_window = match phase {
                    Phase::AfterEffect => true,
                    // A random kill after this worker ran the op's effect, before its answer.
                    Phase::Random => ledger_ops(&ledger).get(&op) > executed_before.get(&op),
                    _ => false,
                };
                if in_window {
                    window_ops.push(op);
                }
            }
            Exit::Done => {}
            Exit::ReopenFailed => report.reopen_failures += 1,
            Exit::Failed => report.worker_failures += 1,
        }
        if report.worker_failures + report.reopen_failures > 5 {
            break;
        }
    }

    report.ops = ops;

    // The verification pass: a clean worker replays every op; nothing may run again.
    config.kill = None;
    config.verify = true;
    report.runs += 1;
    let executions_before = ledger_lines(&ledger);
    match spawn_and_wait(worker, &config, None) {
        Exit::Done => {}
        Exit::ReopenFailed => report.reopen_failures += 1,
        _ => report.worker_failures += 1,
    }
    let executions_after = ledger_lines(&ledger);

    // Tally.
    let executed = ledger_ops(&ledger);
    report.executions = executed.values().sum();
    for (op, count) in &executed {
        let extra = count.saturating_sub(1);
        if window_ops.contains(op) {
            report.duplicates_in_window += extra;
        } else {
            report.duplicates_elsewhere += extra;
        }
    }
    // The verification pass must not have run anything (counted above too).
    if executions_after != executions_before {
        report.lost_completions += (executions_after - executions_before) as u32;
    }
    let returned = answers(&returned);
    let verified = answers(&dir.path().join("verify"));
    for op in 0..ops {
        let seen = returned.get(&op).cloned().unwrap_or_default();
        let mut values: Vec<&String> = seen.iter().filter(|v| *v != "unknown").collect();
        values.dedup();
        if values.len() > 1 {
            report.inconsistent_answers += 1;
        }
        if seen.iter().any(|v| v == "unknown") {
            report.unknown += 1;
        }
        let final_answer = verified.get(&op).and_then(|v| v.first());
        if let (Some(value), Some(last)) = (values.first(), final_answer) {
            if *value != last {
                report.lost_completions += 1;
            }
        }
    }
    report.seconds = started.elapsed().as_secs_f64();
    report
}

fn spawn_and_wait(
    worker: &dyn Fn() -> Command,
    config: &WorkerConfig,
    random_kill: Option<Duration>,
) -> Exit {
    let mut child = match worker()
        .env(
            WORKER_ENV,
            serde_json::to_string(config).unwrap_or_default(),
        )
        .stdout(Stdio::null())
        .spawn()
    {
        Ok(child) => child,
        Err(_) => return Exit::Failed,
    };
    if let Some(delay) = random_kill {
        std::thread::sleep(delay);
        let _ = child.kill();
    }
    // A worker that hangs is a failure: the lease is 300 ms, so 60 s is generous.
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() > deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Exit::Failed;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(2)),
            Err(_) => return Exit::Failed,
        }
    };
    match (status.code(), status.signal()) {
        (Some(0), _) => Exit::Done,
        (_, Some(libc::SIGKILL)) => Exit::Killed,
        (Some(REOPEN_FAILED), _) => Exit::ReopenFailed,
        _ => Exit::Failed,
    }
}

fn ledger_lines(path: &Path) -> usize {
    lines(path).len()
}

/// Executions per op, from the ledger.
fn ledger_ops(path: &Path) -> BTreeMap<u32, u32> {
    let mut ops = BTreeMap::new();
    for line in lines(path) {
        if let Some(op) = line.split(' ').next().and_then(|op| op.parse().ok()) {
            *ops.entry(op).or_default() += 1;
        }
    }
    ops
}

/// Every answer callers got, per op, in order.
fn answers(path: &Path) -> BTreeMap<u32, Vec<String>> {
    let mut answers: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    for line in lines(path) {
        if let Some((op, value)) = line.split_once(' ') {
            if let Ok(op) = op.parse() {
                answers.entry(op).or_default().push(value.to_owned());
            }
        }
    }
    answers
}

/// How many ops, from the first, have an answer (the op the loop is at).
fn answered_ops(path: &Path) -> u32 {
    let answers = answers(path);
    (0..).find(|op| !answers.contains_key(op)).unwrap_or(0)
}

/// The report as a Markdown table.
pub fn table(reports: &[Report]) -> String {
    let mut out = String::from(
        "| store | policy | runs | kills | cancels | panics | slowest retry after a cancel or panic (ms) | ops | executions | dup. in crash window | dup. elsewhere | unknown | lost completions | inconsistent answers | reopen failures | worker failures | seconds |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in reports {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {:.1} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1} |\n",
            r.store,
            r.policy,
            r.runs,
            r.kills,
            r.cancels,
            r.panics,
            r.max_retry_ms,
            r.ops,
            r.executions,
            r.duplicates_in_window,
            r.duplicates_elsewhere,
            r.unknown,
            r.lost_completions,
            r.inconsistent_answers,
            r.reopen_failures,
            r.worker_failures,
            r.seconds
        ));
    }
    out
}
