//! How many instructions an idempotent call costs, counted by callgrind:
//!
//! ```sh
//! cargo run --release --manifest-path benches/instructions/Cargo.toml
//! ```
//!
//! (needs `valgrind` on the `PATH`). Instruction counts do not depend on the machine's
//! load, so a change to the hot path can be priced to a fraction of a percent, where a
//! wall-clock benchmark on a shared machine cannot.
//!
//! The program runs itself under `valgrind --tool=callgrind` once per path and count:
//! 1,000 and 3,000 calls of one path on a `MemoryStore`, on a current-thread runtime,
//! after one call that fills the store. The difference of the two totals over 2,000 is
//! the cost of one call, the process's start and end cancelled out; the same for a loop
//! that builds the inputs and makes no call is subtracted. The paths:
//!
//! - `hit`: an attribute tool taking `Input` whose key completed, replayed;
//! - `hit, input borrowed`: the same of a tool taking `&Input`;
//! - `miss, input borrowed`: an attribute tool taking `&Input` (its body cannot finish
//!   alone: the call runs it in place), on a new key each call;
//! - `miss, input owned`: an attribute tool taking `Input` (its body finishes alone if
//!   its caller stops waiting), on a new key each call;
//! - `Tool hit` and `Tool miss`: the same through the dynamic API, `idem::Tool`.
//!
//! The result is a 3-field struct that derives `PartialEq`, so the read-back check
//! compares by it.
//!
//! `--calls N` changes the smaller count (the larger is 3 N). With `--store postgres`
//! (and `IDEM_POSTGRES_URL`), the same paths run on a `PostgresStore` (a table of each
//! child's own), with two more rows beside them: the floor's `SELECT` by primary key
//! and two commits (an `INSERT`, an `UPDATE`) on the store's own pool. Only this
//! process's instructions are counted, the client's: the server's work is not in them.
//! With `--store redis` (and `IDEM_REDIS_URL`), the same on a `RedisStore` (under a
//! prefix of each child's own), beside a `GET` of a 168-byte value (a hit's record) and
//! a fenced miss done by hand: `SET NX GET`, then a script that writes the record
//! while the claim is still there.

use std::process::Command;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Input {
    to: String,
    subject: String,
    count: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    id: String,
    accepted: bool,
    count: u64,
}

#[derive(Debug)]
struct ToolError;

impl From<idem::Error> for ToolError {
    fn from(_: idem::Error) -> Self {
        ToolError
    }
}

fn receipt(input: &Input) -> Receipt {
    Receipt {
        id: input.to.clone(),
        accepted: true,
        count: input.count,
    }
}

#[idem::idempotent(ttl = "24h")]
async fn owned(input: Input) -> Result<Receipt, ToolError> {
    Ok(receipt(&input))
}

#[idem::idempotent(ttl = "24h")]
async fn borrowed(input: &Input) -> Result<Receipt, ToolError> {
    Ok(receipt(input))
}

fn input(count: u64) -> Input {
    Input {
        to: "ada@example.com".into(),
        subject: "hello".into(),
        count,
    }
}

/// The paths measured: the argument the child takes, and the row's label.
const PATHS: [(&str, &str); 6] = [
    ("hit", "hit"),
    ("borrowed-hit", "hit, input borrowed"),
    ("borrowed", "miss, input borrowed"),
    ("owned", "miss, input owned"),
    ("tool-hit", "Tool hit"),
    ("tool-miss", "Tool miss"),
];

/// A call of `tool`, whose body makes what `owned` makes.
async fn dynamic(tool: &idem::Tool, run: &idem::Run, count: u64) -> Result<Receipt, ToolError> {
    let input = input(count);
    tool.call(run, &input, move |_| async move {
        Ok(Receipt {
            id: "ada@example.com".into(),
            accepted: true,
            count,
        })
    })
    .await
}

/// One call of `path` (`None`: the loop alone).
async fn call(path: Option<&str>, tool: &idem::Tool, run: &idem::Run, i: u64) -> Receipt {
    let result = match path {
        Some("hit") => owned(input(u64::MAX)).await,
        Some("owned") => owned(input(i)).await,
        Some("borrowed-hit") => borrowed(&input(u64::MAX)).await,
        Some("borrowed") => borrowed(&input(i)).await,
        Some("tool-hit") => dynamic(tool, run, u64::MAX).await,
        Some("tool-miss") => dynamic(tool, run, i).await,
        _ => Ok(receipt(&input(i))),
    };
    result.unwrap_or_else(|_| panic!("the call failed"))
}

/// The child: `calls` calls of `path` on `store` after one that fills it.
fn child(store: &str, path: Option<&str>, calls: u64) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async move {
        let (run, floor) = match store {
            "postgres" => {
                let url = std::env::var("IDEM_POSTGRES_URL").expect("IDEM_POSTGRES_URL");
                let table = format!("idem_instructions_{}", std::process::id());
                let store = idem::PostgresStore::builder(&url)
                    .table(&table)
                    .connect()
                    .await
                    .expect("a Postgres store");
                let floor = Floor::Postgres(PostgresFloor::new(&store, &table).await);
                (idem::Run::new("run").with_store(store), Some(floor))
            }
            "redis" => {
                let url = std::env::var("IDEM_REDIS_URL").expect("IDEM_REDIS_URL");
                let prefix = format!("idem-instructions-{}:", std::process::id());
                let store = idem::RedisStore::builder(&url)
                    .prefix(&prefix)
                    .connect()
                    .await
                    .expect("a Redis store");
                let floor = Floor::Redis(RedisFloor::new(&url, prefix).await);
                (idem::Run::new("run").with_store(store), Some(floor))
            }
            "sqlite" => {
                let dir =
                    std::env::temp_dir().join(format!("idem-instructions-{}", std::process::id()));
                let store =
                    idem::SqliteStore::open(dir.join("idem.sqlite")).expect("a SQLite store");
                let floor = Floor::Sqlite(SqliteFloor::new(dir));
                (idem::Run::new("run").with_store(store), Some(floor))
            }
            _ => (
                idem::Run::new("run").with_store(idem::MemoryStore::new()),
                None,
            ),
        };
        let tool = idem::Tool::new("owned").ttl(std::time::Duration::from_secs(86_400));
        run.clone()
            .scope(async {
                call(Some("hit"), &tool, &run, u64::MAX).await;
                call(Some("borrowed-hit"), &tool, &run, u64::MAX).await;
                call(Some("tool-hit"), &tool, &run, u64::MAX).await;
                for i in 0..calls {
                    match (path, &floor) {
                        (Some("floor-hit"), Some(floor)) => floor.hit().await,
                        (Some("floor-miss"), Some(floor)) => floor.miss(i).await,
                        _ => drop(std::hint::black_box(call(path, &tool, &run, i).await)),
                    }
                }
            })
            .await;
        if let Some(floor) = floor {
            floor.clean().await;
        }
    });
}

/// A network store's floors: the least a hand-written hit and miss do on it.
enum Floor {
    Postgres(PostgresFloor),
    Redis(RedisFloor),
    Sqlite(SqliteFloor),
}

impl Floor {
    async fn hit(&self) {
        match self {
            Floor::Postgres(floor) => floor.select(-1).await,
            Floor::Redis(floor) => floor.get().await,
            Floor::Sqlite(floor) => floor.select(),
        }
    }

    async fn miss(&self, i: u64) {
        match self {
            Floor::Postgres(floor) => floor.two_commits(i as i64).await,
            Floor::Redis(floor) => floor.fenced_miss(i).await,
            Floor::Sqlite(floor) => floor.two_transactions(i),
        }
    }

    async fn clean(self) {
        match self {
            Floor::Postgres(floor) => floor.drop_tables().await,
            Floor::Redis(floor) => floor.clean().await,
            Floor::Sqlite(floor) => floor.clean(),
        }
    }
}

/// The SQLite floors, on a file beside the store's with the store's settings (WAL,
/// `synchronous = NORMAL`): a `SELECT` by key and a decode; two write transactions.
struct SqliteFloor {
    dir: std::path::PathBuf,
    conn: rusqlite::Connection,
}

impl SqliteFloor {
    fn new(dir: std::path::PathBuf) -> Self {
        let conn = rusqlite::Connection::open(dir.join("floor.sqlite")).expect("the floor's file");
        conn.execute_batch(
            "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; \
             CREATE TABLE floor (key TEXT PRIMARY KEY NOT NULL, value);",
        )
        .expect("the floor's table");
        let value = serde_json::to_string(&receipt(&input(u64::MAX))).unwrap();
        conn.execute("INSERT INTO floor VALUES ('hit', ?1)", [value])
            .expect("the hit's row");
        SqliteFloor { dir, conn }
    }

    fn select(&self) {
        let text: String = self
            .conn
            .prepare_cached("SELECT value FROM floor WHERE key = 'hit'")
            .and_then(|mut s| s.query_row([], |r| r.get(0)))
            .expect("the hit's row");
        std::hint::black_box(serde_json::from_str::<Receipt>(&text).unwrap());
    }

    fn two_transactions(&self, i: u64) {
        let key = format!("owned.{i:064}");
        let value = serde_json::to_string(&receipt(&input(i))).unwrap();
        for (sql, value) in [
            ("INSERT INTO floor VALUES (?1, ?2)", "claim"),
            ("UPDATE floor SET value = ?2 WHERE key = ?1", value.as_str()),
        ] {
            let tx = self.conn.unchecked_transaction().unwrap();
            tx.prepare_cached(sql)
                .unwrap()
                .execute([&key, value])
                .unwrap();
            tx.commit().unwrap();
        }
    }

    fn clean(self) {
        drop(self.conn);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The Postgres floors, on a table beside the store's, on the store's pool.
struct PostgresFloor {
    store: idem::PostgresStore,
    store_table: String,
    table: String,
}

impl PostgresFloor {
    /// Makes the floor's table, with row `-1` for the hits to read.
    async fn new(store: &idem::PostgresStore, store_table: &str) -> PostgresFloor {
        let table = format!("{store_table}_floor");
        let client = store.pool().get().await.expect("a connection");
        client
            .batch_execute(&format!(
                "CREATE TABLE {table} (k int8 PRIMARY KEY, v bytea)"
            ))
            .await
            .expect("the floor's table");
        let floor = PostgresFloor {
            store: store.clone(),
            store_table: store_table.to_owned(),
            table,
        };
        floor.two_commits(-1).await;
        floor
    }

    /// One `SELECT` by primary key.
    async fn select(&self, k: i64) {
        let client = self.store.pool().get().await.expect("a connection");
        let sql = format!("SELECT v FROM {} WHERE k = $1", self.table);
        let stmt = client.prepare_cached(&sql).await.expect("prepared");
        std::hint::black_box(client.query_opt(&stmt, &[&k]).await.expect("a row"));
    }

    /// Two commits on a new row `k`: an `INSERT`, then an `UPDATE`.
    async fn two_commits(&self, k: i64) {
        for (sql, v) in [
            (
                format!("INSERT INTO {} (k, v) VALUES ($1, $2)", self.table),
                &b"claim"[..],
            ),
            (
                format!("UPDATE {} SET v = $2 WHERE k = $1", self.table),
                &b"result"[..],
            ),
        ] {
            let client = self.store.pool().get().await.expect("a connection");
            let stmt = client.prepare_cached(&sql).await.expect("prepared");
            client.execute(&stmt, &[&k, &v]).await.expect("written");
        }
    }

    async fn drop_tables(self) {
        let client = self.store.pool().get().await.expect("a connection");
        let sql = format!("DROP TABLE {}; DROP TABLE {}", self.table, self.store_table);
        client.batch_execute(&sql).await.expect("dropped");
    }
}

/// The Redis floors, on a multiplexed connection of their own, under the store's prefix.
struct RedisFloor {
    connection: redis::aio::MultiplexedConnection,
    prefix: String,
    script: redis::Script,
}

impl RedisFloor {
    /// Connects, and writes the 168-byte value the hits read.
    async fn new(url: &str, prefix: String) -> RedisFloor {
        let client = redis::Client::open(url).expect("a Redis URL");
        let mut connection = client
            .get_multiplexed_async_connection()
            .await
            .expect("a Redis connection");
        let _: () = redis::cmd("SET")
            .arg(format!("{prefix}floor"))
            .arg(&[7u8; 168][..])
            .query_async(&mut connection)
            .await
            .expect("written");
        let script = redis::Script::new(
            "if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1",
        );
        RedisFloor {
            connection,
            prefix,
            script,
        }
    }

    /// One `GET` of the floor's value.
    async fn get(&self) {
        let mut c = self.connection.clone();
        let value: Option<Vec<u8>> = redis::cmd("GET")
            .arg(format!("{}floor", self.prefix))
            .query_async(&mut c)
            .await
            .expect("read");
        std::hint::black_box(value.expect("the floor's value"));
    }

    /// A claim (`SET NX GET PX`, 78 bytes) of a new key, then the 168-byte record
    /// written by a script while the claim is still there.
    async fn fenced_miss(&self, i: u64) {
        let key = format!("{}floor-{i}", self.prefix);
        let claim = [1u8; 78];
        let mut c = self.connection.clone();
        let found: Option<Vec<u8>> = redis::cmd("SET")
            .arg(&key)
            .arg(&claim[..])
            .arg("NX")
            .arg("GET")
            .arg("PX")
            .arg(600_000)
            .query_async(&mut c)
            .await
            .expect("claimed");
        assert!(found.is_none(), "the floor's key {key} was not new");
        let applied: i64 = self
            .script
            .key(&key)
            .arg(&claim[..])
            .arg(&[7u8; 168][..])
            .arg(600_000)
            .invoke_async(&mut c)
            .await
            .expect("written");
        assert_eq!(applied, 1);
    }

    /// Deletes every key under the prefix.
    async fn clean(self) {
        let mut c = self.connection.clone();
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}*", self.prefix))
            .query_async(&mut c)
            .await
            .expect("listed");
        for chunk in keys.chunks(1000) {
            let _: () = redis::cmd("UNLINK")
                .arg(chunk)
                .query_async(&mut c)
                .await
                .expect("deleted");
        }
    }
}

/// The instructions callgrind counts for the child running `path` `calls` times on
/// `store`.
fn instructions(store: &str, path: &str, calls: u64) -> u64 {
    let me = std::env::current_exe().expect("this program's path");
    let output = Command::new("valgrind")
        .args(["--tool=callgrind", "--callgrind-out-file=/dev/null"])
        .arg(me)
        .args(["--child", store, path, &calls.to_string()])
        .output()
        .expect("run valgrind (is it installed?)");
    let text = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "valgrind failed: {text}");
    text.lines()
        .find_map(|line| line.split("Collected : ").nth(1))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no instruction count in valgrind's output: {text}"))
}

/// Instructions per call of `path`: the difference of `3 calls` and `calls` calls.
fn per_call(store: &str, path: &str, calls: u64) -> f64 {
    let (few, many) = (
        instructions(store, path, calls),
        instructions(store, path, 3 * calls),
    );
    (many as f64 - few as f64) / (2 * calls) as f64
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mut calls, mut store) = (1_000, "memory".to_owned());
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--child" => {
                let mut next = || args.next().expect("--child STORE PATH CALLS");
                let (store, path, calls) = (next(), next(), next());
                let calls = calls.parse().expect("a number of calls");
                let known = PATHS.iter().chain(&FLOORS).any(|(p, _)| *p == path);
                return child(&store, known.then_some(path.as_str()), calls);
            }
            "--calls" => {
                calls = args
                    .next()
                    .and_then(|n| n.parse().ok())
                    .expect("--calls takes a number")
            }
            "--store" => {
                store = args
                    .next()
                    .expect("--store takes memory, sqlite, postgres or redis")
            }
            other => panic!(
                "unknown argument {other}; expected --calls N, --store memory|sqlite|postgres|redis"
            ),
        }
    }
    run(&store, calls);
}

/// The floors' paths, measured on a network store only.
const FLOORS: [(&str, &str); 2] = [("floor-hit", "floor: hit"), ("floor-miss", "floor: miss")];

fn run(store: &str, calls: u64) {
    let base = per_call(store, "loop", calls);
    println!(
        "instructions per call (callgrind; {calls} and {} calls, {store} store, current-thread runtime)\n",
        3 * calls
    );
    println!("{:<24} {:>12}", "path", "instructions");
    let floors = if store == "memory" {
        &[][..]
    } else {
        &FLOORS[..]
    };
    for (path, label) in PATHS.iter().chain(floors) {
        println!("{label:<24} {:>12.0}", per_call(store, path, calls) - base);
    }
    println!("\n(the loop alone, subtracted above: {base:.0})");
}
