//! The `idem` binary, run as an operator runs it, against each store: sled in a
//! directory, Postgres (`IDEM_POSTGRES_URL`) and Redis (`IDEM_REDIS_URL`). Without a
//! server's variable its tests say they skipped and check nothing.
//!
//! Records are made through the store API as calls make them; what is checked is what
//! the command prints, its exit code, and what the store holds after it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use assert_cmd::Command;
use idem_core::store::{
    Claim, ClaimRequest, Fingerprint, Meta, Origin, Outcome, Record, State, Timestamp, Token,
};
use idem_core::{Key, PostgresStore, RedisStore, SledStore, SqliteStore, Store};
use serde_json::Value;

fn env(name: &str) -> Option<String> {
    let url = std::env::var(name).ok().filter(|u| !u.is_empty());
    if url.is_none() {
        eprintln!("SKIPPED: {name} is not set; this test checked nothing");
    }
    url
}

fn unique(prefix: &str) -> String {
    let t = Token::generate().unwrap().to_bits();
    format!(
        "{prefix}_{}_{:012x}",
        std::process::id(),
        t & 0xffff_ffff_ffff
    )
}

/// The `idem` command with the arguments that name a store.
fn idem(store: &[String]) -> Command {
    let mut command = Command::cargo_bin("idem").unwrap();
    command
        .args(store)
        .env_remove("IDEM_STORE")
        .env_remove("IDEM_DIR");
    command
}

/// Runs `idem` with `args`; returns its exit code, stdout and stderr.
fn run(store: &[String], args: &[&str]) -> (i32, String, String) {
    let output = idem(store).args(args).output().unwrap();
    (
        output.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// Runs `idem` with `args`, expecting success; returns stdout.
fn ok(store: &[String], args: &[&str]) -> String {
    let (code, out, err) = run(store, args);
    assert_eq!(code, 0, "idem {args:?} failed: {err}");
    out
}

fn json_lines(text: &str) -> Vec<Value> {
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The keys of the records a test made, by what they are.
struct Made {
    completed: Vec<Key>,
    running: Key,
    abandoned: [Key; 2],
    failed: Key,
    other_run: Vec<Key>,
}

fn origin(run: &str, tool: &str) -> Origin {
    Origin {
        tenant: Some("acme".into()),
        run_id: run.into(),
        call_id: None,
        tool: tool.into(),
    }
}

fn request(origin: &Origin, n: u8, lease: Duration) -> ClaimRequest {
    ClaimRequest {
        origin: origin.clone(),
        fingerprint: Fingerprint::from_bytes([n; 32]),
        token: Token::generate().unwrap(),
        lease,
        ttl: Duration::from_secs(3600),
        take_over_expired: false,
        retry_failed: false,
    }
}

/// Claims `key` (and completes it with `outcome`, if any), as a call does.
async fn make(store: &dyn Store, key: &Key, req: &ClaimRequest, outcome: Option<Outcome<'_>>) {
    assert_eq!(
        store.claim(key, req).await.unwrap(),
        Claim::Acquired { took_over: false }
    );
    if let Some(outcome) = outcome {
        store
            .complete(key, req.token, outcome, req.ttl)
            .await
            .unwrap();
    }
}

/// A run `r1` with three sent emails, a running and two abandoned charges and a
/// declined one; a run `r2` with two sent emails.
async fn fill(store: &dyn Store, r1: &str, r2: &str) -> Made {
    let key = |tool: &str| Key::from_text(format!("{tool}.{}", unique("k")));
    let (email, charge) = (origin(r1, "send_email"), origin(r1, "charge_card"));
    let mut completed = Vec::new();
    for n in 0..3 {
        let k = key("send_email");
        let result = format!("{{\"message_id\":\"m-{n}\"}}");
        make(
            store,
            &k,
            &request(&email, n, Duration::from_secs(60)),
            Some(Outcome::Completed(result.as_bytes())),
        )
        .await;
        completed.push(k);
    }
    let running = key("charge_card");
    make(
        store,
        &running,
        &request(&charge, 10, Duration::from_secs(3600)),
        None,
    )
    .await;
    let abandoned = [key("charge_card"), key("charge_card")];
    for (i, k) in abandoned.iter().enumerate() {
        make(
            store,
            k,
            &request(&charge, 11 + i as u8, Duration::from_millis(100)),
            None,
        )
        .await;
    }
    let failed = key("charge_card");
    make(
        store,
        &failed,
        &request(&charge, 13, Duration::from_secs(60)),
        Some(Outcome::Failed(b"\"declined\"")),
    )
    .await;
    let mut other_run = Vec::new();
    for n in 0..2 {
        let k = key("send_email");
        make(
            store,
            &k,
            &request(&origin(r2, "send_email"), 20 + n, Duration::from_secs(60)),
            Some(Outcome::Completed(b"\"m\"")),
        )
        .await;
        other_run.push(k);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    Made {
        completed,
        running,
        abandoned,
        failed,
        other_run,
    }
}

/// Every command against a store holding [`fill`]'s records. `reopen` gives the test
/// the store again after the command ran (sled lets one process hold it at a time).
async fn every_command<F, Fut>(args: &[String], made: Made, r1: &str, r2: &str, reopen: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Arc<dyn Store>>,
{
    // ls: a header and one aligned row per record; filters; JSON lines; a limit.
    let text = ok(args, &["ls", "--run", r1]);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1 + 7, "{text}");
    assert!(
        lines[0].starts_with("STATE") && lines[0].ends_with("KEY"),
        "{text}"
    );
    let key_at = lines[0].find("KEY").unwrap();
    assert!(
        lines[1..]
            .iter()
            .all(|l| l.len() > key_at && l[key_at..].contains('.')),
        "columns are aligned: {text}"
    );
    let all = json_lines(&ok(args, &["ls", "--json", "--run", r1]));
    assert_eq!(all.len(), 7);
    assert!(
        all.iter()
            .all(|r| r["run_id"] == r1 && r["tenant"] == "acme"),
        "{all:?}"
    );
    let abandoned = json_lines(&ok(
        args,
        &["ls", "--json", "--run", r1, "--state", "abandoned"],
    ));
    let mut keys: Vec<&str> = abandoned
        .iter()
        .map(|r| r["key"].as_str().unwrap())
        .collect();
    keys.sort();
    let mut want = vec![made.abandoned[0].as_str(), made.abandoned[1].as_str()];
    want.sort();
    assert_eq!(keys, want);
    assert_eq!(
        json_lines(&ok(
            args,
            &["ls", "--json", "--run", r1, "--tool", "charge_card"]
        ))
        .len(),
        4
    );
    assert_eq!(
        json_lines(&ok(
            args,
            &["ls", "--json", "--run", r1, "--older-than", "1h"]
        ))
        .len(),
        0
    );
    assert_eq!(
        json_lines(&ok(args, &["ls", "--json", "--run", r1, "--limit", "2"])).len(),
        2
    );
    let (code, _, err) = run(args, &["ls", "--state", "stuck"]);
    assert_eq!(code, 2, "a bad state is a usage error: {err}");

    // stats
    let stats: Value = serde_json::from_str(&ok(args, &["stats", "--json", "--run", r1])).unwrap();
    assert_eq!(
        stats,
        serde_json::json!({"running": 1, "abandoned": 2, "completed": 3, "failed": 1, "unreadable": 0, "total": 7})
    );
    assert!(ok(args, &["stats", "--run", r1]).contains("abandoned           2"));

    // show: metadata and the result, pretty; a missing key is exit code 3.
    let shown = ok(args, &["show", made.completed[1].as_str()]);
    assert!(
        shown.contains("\"message_id\": \"m-1\"") && shown.contains(&format!("run          {r1}")),
        "{shown}"
    );
    let shown: Value =
        serde_json::from_str(&ok(args, &["show", "--json", made.failed.as_str()])).unwrap();
    assert_eq!(
        (&shown["state"], &shown["error"]),
        (&Value::from("failed"), &Value::from("declined"))
    );
    assert_eq!(run(args, &["show", "send_email.nope"]).0, 3);

    // resolve: refused for a running claim and a completed record; an abandoned one is
    // settled as completed (the next call replays it) or released (the next call runs).
    let (code, _, err) = run(args, &["resolve", made.running.as_str(), "--release"]);
    assert!(code == 4 && err.contains("running"), "{code} {err}");
    let (code, _, err) = run(
        args,
        &["resolve", made.completed[0].as_str(), "--completed", "1"],
    );
    assert!(code == 4 && err.contains("completed"), "{code} {err}");
    let (code, _, err) = run(
        args,
        &[
            "resolve",
            made.abandoned[0].as_str(),
            "--completed",
            "{oops",
        ],
    );
    assert!(code == 2 && err.contains("not JSON"), "{code} {err}");
    let (code, _, err) = run(args, &["resolve", made.abandoned[0].as_str()]);
    assert!(code == 2 && err.contains("--release"), "{code} {err}");
    ok(
        args,
        &[
            "resolve",
            made.abandoned[0].as_str(),
            "--completed",
            r#"{"charge":"ch_1"}"#,
        ],
    );
    ok(args, &["resolve", made.abandoned[1].as_str(), "--release"]);
    {
        let store = reopen().await;
        let retry = |n| request(&origin(r1, "charge_card"), n, Duration::from_secs(60));
        assert_eq!(
            store.claim(&made.abandoned[0], &retry(11)).await.unwrap(),
            Claim::Completed(br#"{"charge":"ch_1"}"#.to_vec()),
            "the call after a resolution replays the result given"
        );
        assert_eq!(
            store.claim(&made.abandoned[1], &retry(12)).await.unwrap(),
            Claim::Acquired { took_over: false },
            "the call after a release runs"
        );
    }

    // evict: refuses a running call's claim, whose owner would lose it (and a retry of
    // an at-most-once call would run it again), unless forced.
    let (code, _, err) = run(args, &["evict", made.running.as_str(), "--yes"]);
    assert!(
        code == 4 && err.contains("running") && err.contains("--force"),
        "{code} {err}"
    );
    assert_eq!(
        run(args, &["show", made.running.as_str()]).0,
        0,
        "still there"
    );

    // evict: asks (and refuses without a terminal), then removes; a run's at once.
    let (code, _, err) = run(args, &["evict", made.completed[2].as_str()]);
    assert!(code == 4 && err.contains("--yes"), "{code} {err}");
    assert_eq!(
        json_lines(&ok(args, &["ls", "--json", "--run", r1])).len(),
        7,
        "nothing evicted unasked"
    );
    ok(args, &["evict", made.completed[2].as_str(), "--yes"]);
    assert_eq!(run(args, &["show", made.completed[2].as_str()]).0, 3);
    let evicted: Value =
        serde_json::from_str(&ok(args, &["evict", "--json", "--run", r2, "--yes"])).unwrap();
    assert_eq!(evicted["count"], made.other_run.len());
    assert_eq!(
        json_lines(&ok(args, &["ls", "--json", "--run", r2])).len(),
        0
    );
    assert_eq!(
        json_lines(&ok(args, &["ls", "--json", "--run", r1])).len(),
        6
    );

    // A run's eviction leaves its running calls' claims (two now: the fill's, and the
    // call after the release), and removes the rest, an abandoned claim included.
    let abandoned = Key::from_text(format!("charge_card.{}", unique("abandoned")));
    {
        let store = reopen().await;
        let gone = request(&origin(r1, "charge_card"), 14, Duration::from_millis(1));
        make(&*store, &abandoned, &gone, None).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let evicted: Value =
        serde_json::from_str(&ok(args, &["evict", "--json", "--run", r1, "--yes"])).unwrap();
    assert_eq!(evicted["count"], 5, "{evicted}");
    assert!(
        evicted["done"]
            .as_str()
            .unwrap()
            .contains("2 left: running"),
        "{evicted}"
    );
    let left = json_lines(&ok(args, &["ls", "--json", "--run", r1]));
    assert_eq!(left.len(), 2, "{left:?}");
    assert!(left.iter().all(|r| r["state"] == "running"), "{left:?}");
    // Forced, they go too.
    ok(args, &["evict", made.running.as_str(), "--force", "--yes"]);
    assert_eq!(run(args, &["show", made.running.as_str()]).0, 3);
    let evicted: Value = serde_json::from_str(&ok(
        args,
        &["evict", "--json", "--run", r1, "--force", "--yes"],
    ))
    .unwrap();
    assert_eq!(evicted["count"], 1, "{evicted}");

    ok(args, &["purge"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_on_sled() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_owned();
    let made = {
        let store = SledStore::open(&path).unwrap();
        fill(&store, "r1", "r2").await
    };
    let args = vec!["--store".to_owned(), format!("sled:{}", path.display())];
    every_command(&args, made, "r1", "r2", || {
        let path = path.clone();
        async move { Arc::new(SledStore::open(path).unwrap()) as Arc<dyn Store> }
    })
    .await;
}

/// SQLite: every command runs while the store stays open in this process (an agent's,
/// in real life), which goes on reading the records the commands changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_on_sqlite_while_an_agent_has_it_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idem.sqlite");
    let agent = SqliteStore::open(&path).unwrap();
    let made = fill(&agent, "r1", "r2").await;
    let args = vec!["--store".to_owned(), format!("sqlite:{}", path.display())];
    every_command(&args, made, "r1", "r2", || {
        let agent = agent.clone();
        async move { Arc::new(agent) as Arc<dyn Store> }
    })
    .await;
    let missing = vec![
        "--store".to_owned(),
        format!("sqlite:{}", dir.path().join("none.sqlite").display()),
    ];
    let (code, out, err) = run(&missing, &["ls"]);
    assert_ne!(code, 0, "{out}");
    assert!(err.contains("no SQLite store"), "{err}");
    assert!(
        !dir.path().join("none.sqlite").exists(),
        "nothing was created"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_on_postgres() {
    let Some(url) = env("IDEM_POSTGRES_URL") else {
        return;
    };
    let table = unique("idem_cli");
    let store = PostgresStore::builder(&url)
        .table(&table)
        .connect()
        .await
        .unwrap();
    let made = fill(&store, "r1", "r2").await;
    let args = vec![
        "--store".to_owned(),
        url.clone(),
        "--table".to_owned(),
        table.clone(),
    ];
    let reopen = || {
        let store = store.clone();
        async move { Arc::new(store) as Arc<dyn Store> }
    };
    every_command(&args, made, "r1", "r2", reopen).await;
    drop_table(&url, &table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_on_redis() {
    let Some(url) = env("IDEM_REDIS_URL") else {
        return;
    };
    let prefix = format!("{}:", unique("idem-cli"));
    let store = RedisStore::builder(&url)
        .prefix(&prefix)
        .connect()
        .await
        .unwrap();
    let made = fill(&store, "r1", "r2").await;
    let args = vec![
        "--store".to_owned(),
        url.clone(),
        "--prefix".to_owned(),
        prefix,
    ];
    let reopen = || {
        let store = store.clone();
        async move { Arc::new(store) as Arc<dyn Store> }
    };
    every_command(&args, made, "r1", "r2", reopen).await;
}

/// A sled directory a running agent holds is a clear message and exit code 5, at once;
/// the copy it suggests can be inspected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sled_store_held_by_a_running_agent_is_a_clear_message_and_its_copy_reads() {
    let dir = tempfile::tempdir().unwrap();
    let agent = SledStore::open(dir.path()).unwrap();
    fill(&agent, "r1", "r2").await;
    let args = vec![
        "--store".to_owned(),
        format!("sled:{}", dir.path().display()),
    ];
    // The agent is a process of its own in real life: the held lock is a file lock
    // between processes, and `idem` is one.
    let started = Instant::now();
    let (code, out, err) = run(&args, &["ls"]);
    assert_eq!(code, 5, "{out}{err}");
    assert!(
        err.contains("open in a running process") && err.contains("cp -r"),
        "{err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
    let copy = tempfile::tempdir().unwrap();
    let status = std::process::Command::new("cp")
        .arg("-r")
        .arg(format!("{}/.", dir.path().display()))
        .arg(copy.path())
        .status()
        .unwrap();
    assert!(status.success());
    let args = vec![
        "--store".to_owned(),
        format!("sled:{}", copy.path().display()),
    ];
    assert_eq!(json_lines(&ok(&args, &["ls", "--json"])).len(), 9);
    drop(agent);
}

#[test]
fn no_store_and_a_bad_store_are_errors_that_say_so() {
    let empty = tempfile::tempdir().unwrap();
    let args = vec![
        "--store".to_owned(),
        format!("sled:{}", empty.path().join("none").display()),
    ];
    let (code, _, err) = run(&args, &["ls"]);
    assert!(code == 3 && err.contains("no sled store"), "{code} {err}");
    assert!(
        !empty.path().join("none").exists(),
        "looking created a store"
    );
    let args = vec!["--store".to_owned(), "mysql://x".to_owned()];
    let (code, _, err) = run(&args, &["ls"]);
    assert!(code == 2 && err.contains("unknown store"), "{code} {err}");
    let args = vec!["--store".to_owned(), "redis://127.0.0.1:1".to_owned()];
    let (code, _, err) = run(&args, &["stats"]);
    assert!(code == 1 && err.contains("redis"), "{code} {err}");
}

// ----- Listings of 10⁵ records ------------------------------------------------------

const MANY: u64 = 100_000;

/// A completed record of run `many` written now, expiring in an hour; its times from
/// `from` (0 for Redis, which counts from the moment it stores a record).
fn many_record(i: u64, from: u64) -> Record {
    let now = Timestamp::now();
    Record {
        fingerprint: Fingerprint::from_bytes([7; 32]),
        created_at: Timestamp::from_millis(from),
        expires_at: Timestamp::from_millis(from + 3_600_000),
        state: State::Completed {
            result: format!("{{\"message_id\":\"m-{i}\"}}").into_bytes(),
        },
        meta: Meta {
            origin: Some(origin("many", "send_email")),
            claimed_at: now,
            completed_at: Some(now),
            renewed_at: None,
            attempts: 1,
            takeovers: 0,
        },
    }
}

fn many_key(i: u64) -> String {
    format!("send_email.{i:064x}")
}

/// Lists every record as JSON lines and counts them; checks `stats` agrees.
fn lists_all(args: &[String], store: &str) {
    let started = Instant::now();
    let listed = ok(args, &["ls", "--json", "--run", "many"]);
    let took = started.elapsed();
    let lines = listed.lines().count() as u64;
    assert_eq!(lines, MANY);
    let rows = json_lines(&listed);
    let mut keys: Vec<&str> = rows.iter().map(|r| r["key"].as_str().unwrap()).collect();
    keys.sort_unstable();
    keys.dedup();
    assert_eq!(keys.len() as u64, MANY, "a record was listed twice");
    let stats: Value =
        serde_json::from_str(&ok(args, &["stats", "--json", "--run", "many"])).unwrap();
    assert_eq!(stats["completed"], MANY);
    eprintln!("{store}: listed {MANY} records in {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_of_a_hundred_thousand_records_on_sled() {
    let dir = tempfile::tempdir().unwrap();
    {
        // No flusher thread: the directory's lock goes with the last handle, before the
        // command (another process) opens it.
        let db = sled::Config::new()
            .path(dir.path())
            .flush_every_ms(None)
            .open()
            .unwrap();
        let tree = db.open_tree(SledStore::TREE).unwrap();
        let now = Timestamp::now().as_millis();
        for i in 0..MANY {
            tree.insert(many_key(i), many_record(i, now).encode())
                .unwrap();
        }
        db.flush().unwrap();
    }
    let args = vec![
        "--store".to_owned(),
        format!("sled:{}", dir.path().display()),
    ];
    lists_all(&args, "sled");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_of_a_hundred_thousand_records_on_postgres() {
    let Some(url) = env("IDEM_POSTGRES_URL") else {
        return;
    };
    let table = unique("idem_cli_many");
    PostgresStore::builder(&url)
        .table(&table)
        .connect()
        .await
        .unwrap();
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
        .batch_execute(&format!(
            "INSERT INTO {table} (key, fingerprint, state, token, payload, created_at, expires_at, \
                 run_id, tenant, tool, claimed_at, completed_at, attempts, takeovers, result) \
             SELECT 'send_email.' || lpad(to_hex(i), 64, '0'), decode(repeat('07', 32), 'hex'), 1, \
                 decode(repeat('00', 16), 'hex'), convert_to('{{\"message_id\":\"m-' || i || '\"}}', 'UTF8'), \
                 now(), now() + interval '1 hour', 'many', 'acme', 'send_email', now(), now(), 1, 0, \
                 ('{{\"message_id\":\"m-' || i || '\"}}')::jsonb \
             FROM generate_series(0, {}) AS i",
            MANY - 1
        ))
        .await
        .unwrap();
    let args = vec![
        "--store".to_owned(),
        url.clone(),
        "--table".to_owned(),
        table.clone(),
    ];
    lists_all(&args, "postgres");
    drop_table(&url, &table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listing_of_a_hundred_thousand_records_on_redis() {
    let Some(url) = env("IDEM_REDIS_URL") else {
        return;
    };
    let prefix = format!("{}:", unique("idem-cli-many"));
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    for chunk in (0..MANY).collect::<Vec<_>>().chunks(5_000) {
        let mut pipe = redis::pipe();
        for &i in chunk {
            pipe.cmd("SET")
                .arg(format!("{prefix}{}", many_key(i)))
                .arg(many_record(i, 0).encode())
                .arg("PX")
                .arg(3_600_000)
                .ignore();
        }
        let _: () = pipe.query_async(&mut conn).await.unwrap();
    }
    let args = vec![
        "--store".to_owned(),
        url.clone(),
        "--prefix".to_owned(),
        prefix.clone(),
    ];
    lists_all(&args, "redis");
    let removed: Value =
        serde_json::from_str(&ok(&args, &["evict", "--json", "--run", "many", "--yes"])).unwrap();
    assert_eq!(removed["count"], MANY);
}

async fn drop_table(url: &str, table: &str) {
    if let Ok((client, conn)) = tokio_postgres::connect(url, tokio_postgres::NoTls).await {
        tokio::spawn(conn);
        let _ = client
            .batch_execute(&format!("DROP TABLE IF EXISTS {table}"))
            .await;
    }
}

/// What a store holds that is not a record (another program's value, a damaged one)
/// is reported, not fatal: the listing goes on, `stats` counts it, `evict` removes it.
/// Text an agent chose (a run id with a newline, an escape sequence) cannot break a row
/// or reach the terminal raw. Output that cannot be written is an error, a reader that
/// went away is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_values_odd_text_and_closed_outputs() {
    let dir = tempfile::tempdir().unwrap();
    let odd_run = "run\n\u{1b}[31mred\tx";
    {
        let store = SledStore::open(dir.path()).unwrap();
        fill(&store, odd_run, "r2").await;
    }
    {
        // No flusher thread: the directory's lock goes with the last handle, before the
        // command (another process) opens it.
        let db = sled::Config::new()
            .path(dir.path())
            .flush_every_ms(None)
            .open()
            .unwrap();
        let tree = db.open_tree(SledStore::TREE).unwrap();
        tree.insert("foreign.key", &b"not a record"[..]).unwrap();
        db.flush().unwrap();
    }
    let args = vec![
        "--store".to_owned(),
        format!("sled:{}", dir.path().display()),
    ];
    let (code, out, err) = run(&args, &["ls"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.lines().count(), 1 + 9, "{out}");
    assert!(
        err.contains("foreign.key") && err.contains("evict"),
        "{err}"
    );
    assert!(
        !out.contains('\u{1b}') && out.contains("run\\n\\u{1b}[31mred\\tx"),
        "{out}"
    );
    let stats: Value = serde_json::from_str(&ok(&args, &["stats", "--json"])).unwrap();
    assert_eq!(
        (stats["unreadable"].as_u64(), stats["total"].as_u64()),
        (Some(1), Some(10))
    );
    // Only the records of the run, by its exact id.
    assert_eq!(
        json_lines(&ok(&args, &["ls", "--json", "--run", odd_run])).len(),
        7
    );
    ok(&args, &["evict", "foreign.key", "--yes"]);
    let (_, _, err) = run(&args, &["ls"]);
    assert!(!err.contains("foreign.key"), "{err}");
    // A full disk is an error; a reader that stops reading is not.
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let status = std::process::Command::new(assert_cmd::cargo::cargo_bin("idem"))
        .args(&args)
        .args(["stats"])
        .stdout(full)
        .output()
        .unwrap();
    assert_eq!(
        status.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin("idem"))
        .args(&args)
        .args(["ls"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let output = child.wait_with_output().unwrap();
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(!String::from_utf8_lossy(&output.stderr).contains("panicked"));
}

/// Exit codes come from the kind of the store's error, not from its message: a bad
/// setting is usage (2), a table that does not exist is "not found" (3).
#[test]
fn a_bad_setting_or_a_missing_table_has_its_own_exit_code() {
    let dir = tempfile::tempdir().unwrap();
    let sqlite = vec![
        "--store".to_owned(),
        format!("sqlite:{}", dir.path().join("idem.sqlite").display()),
    ];
    std::fs::write(dir.path().join("idem.sqlite"), b"").unwrap();
    let (code, _, err) = run(&sqlite, &["--table", "no good", "ls"]);
    assert_eq!(code, 2, "an invalid SQLite table name: {err}");
    assert!(err.contains("invalid table name"), "{err}");

    let (code, _, err) = run(&["--store".into(), "redis://[::1".into()], &["ls"]);
    assert_eq!(code, 2, "a Redis URL that does not parse: {err}");

    let Some(url) = env("IDEM_POSTGRES_URL") else {
        return;
    };
    let postgres = vec!["--store".to_owned(), url.clone()];
    let (code, _, err) = run(&postgres, &["--table", "no good", "ls"]);
    assert_eq!(code, 2, "an invalid Postgres table name: {err}");
    let (code, _, err) = run(
        &["--store".into(), format!("{url}?no_such_option=1")],
        &["ls"],
    );
    assert_eq!(code, 2, "a Postgres URL that does not parse: {err}");
    let missing = unique("idem_missing");
    let (code, _, err) = run(&postgres, &["--table", &missing, "ls"]);
    assert_eq!(code, 3, "a table that does not exist: {err}");
    assert!(err.contains("SQLSTATE 42P01"), "{err}");
}
