//! The workload both the `bench` example and the criterion benches measure: a
//! 513-byte email in, a 114-byte message id out, and the hand-written floors to compare
//! against: key derivation, and for the network stores one round trip, one query and
//! two commits on the same server.

use std::collections::HashMap;
use std::io::Write;

use idem::store::{Fingerprint, KeyParts};
use idem::{idempotent, Error, Key, Run, SledStore};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The tool's input: an email, 513 bytes of JSON with the usual body.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SendEmail {
    /// Recipient.
    pub to: String,
    /// Copies.
    pub cc: Vec<String>,
    /// Subject line.
    pub subject: String,
    /// Plain-text body.
    pub body: String,
    /// Tags, a map (which the key hashes in sorted order).
    pub tags: HashMap<String, String>,
}

/// The tool's result: 114 bytes of JSON.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MessageId {
    /// The provider's id of the message.
    pub id: String,
    /// Which provider took it.
    pub provider: String,
    /// When, in milliseconds since the epoch.
    pub accepted_at: u64,
    /// Its queue.
    pub queue: String,
}

/// The usual body length: the email is then 513 bytes of JSON.
pub const BODY: usize = 338;

/// Email number `n`, with a body of `body_len` characters.
pub fn email(n: u64, body_len: usize) -> SendEmail {
    let mut tags = HashMap::new();
    tags.insert("campaign".to_string(), "winter-sale".to_string());
    tags.insert("n".to_string(), format!("{n:07}"));
    SendEmail {
        to: "ada.lovelace@example.com".into(),
        cc: vec!["charles.babbage@example.com".into()],
        subject: "Your order #4711 has shipped today".into(),
        body: {
            let text = "Hello Ada, your order is on its way. ";
            let mut body = text.repeat(body_len / text.len() + 1);
            body.truncate(body_len);
            body
        },
        tags,
    }
}

/// The message id every send returns.
pub fn message_id() -> MessageId {
    MessageId {
        id: "msg_01HZX3V6Q8R1N4KJ7T2W9Y5B0C".into(),
        provider: "mailer-eu-1".into(),
        accepted_at: 1_764_681_600_000,
        queue: "transaction".into(),
    }
}

/// The tool body: cheap, so measurements show idem's own cost.
pub fn send(_input: &SendEmail) -> MessageId {
    message_id()
}

/// The tool, made idempotent.
#[idempotent(name = "send_email")]
pub async fn send_email(run: &Run, input: &SendEmail) -> Result<MessageId, Error> {
    Ok(send(input))
}

/// The same tool taking its input by value, as most tools do: a call its caller stops
/// waiting for finishes alone (`execute_finishing`, which boxes the body on a miss).
#[idempotent(name = "send_email_owned")]
pub async fn send_email_owned(run: &Run, input: SendEmail) -> Result<MessageId, Error> {
    Ok(send(&input))
}

/// The fingerprint and key of `send_email(&run, &email(i, BODY))` in run `bench-size`,
/// as the attribute derives them: the tool's one argument, as a one-element array.
fn filled_key(i: u64) -> (Fingerprint, Key) {
    let parts = KeyParts {
        tenant: None,
        run_id: "bench-size",
        call_id: None,
        tool: "send_email",
    };
    let fingerprint = Fingerprint::of(&parts, &[email(i, BODY)]).expect("an email serializes");
    (fingerprint, Key::of(parts.tool, &fingerprint))
}

/// A sled store in `dir` holding the completed records of emails `0..records`
/// (written directly, for speed), expiring after `ttl`.
pub fn filled_store(dir: &std::path::Path, records: u64, ttl: std::time::Duration) -> SledStore {
    let result = serde_json::to_vec(&message_id()).unwrap();
    let now = idem::store::Timestamp::now();
    {
        let db = sled::open(dir).unwrap();
        fill(&db.open_tree(SledStore::TREE).unwrap(), records, |i| {
            let (fingerprint, key) = filled_key(i);
            let record = idem::store::Record {
                fingerprint,
                created_at: now,
                expires_at: now.after(ttl),
                state: idem::store::State::Completed {
                    result: result.clone(),
                },
                meta: idem::store::Meta {
                    origin: Some(idem::store::Origin::new("bench-size", "send_email")),
                    claimed_at: now,
                    completed_at: Some(now),
                    renewed_at: None,
                    attempts: 1,
                    takeovers: 0,
                },
            };
            (key.as_str().as_bytes().to_vec(), record.encode())
        });
    }
    // sled lets go of the directory's lock from a thread of its own, a moment after its
    // last handle is dropped: until then the store finds it held elsewhere.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match SledStore::open(dir) {
            Ok(store) => return store,
            Err(e)
                if e.store_kind() == Some(idem::StoreErrorKind::HeldElsewhere)
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(std::time::Duration::from_millis(10))
            }
            Err(e) => panic!("the filled store does not open: {e}"),
        }
    }
}

/// The floor's sled database in `dir`, holding what [`filled_store`] holds the plain
/// way: the result of email `i` under `floor_key` of it, and `probe`'s under its key.
///
/// `floor_key` is not canonical: two equal emails can hash their `tags` map in
/// different orders, so the probe's record is written from the probe itself.
pub fn filled_floor(dir: &std::path::Path, records: u64, probe: &SendEmail) -> sled::Db {
    let result = serde_json::to_vec(&message_id()).unwrap();
    let db = sled::open(dir).unwrap();
    fill(&db, records, |i| {
        (floor_key(&email(i, BODY)).to_vec(), result.clone())
    });
    db.insert(floor_key(probe), result).unwrap();
    db
}

/// The floor of a durable sled miss, the plain way: what a miss writes (a claim-sized
/// value, then a result-sized one, under a key as long as idem's), each made durable by
/// a flush, and in fsync mode also an `fdatasync` of the database's log file `log`.
pub fn sled_two_flushes(raw: &sled::Db, k: u64, log: Option<&std::fs::File>) {
    let key = format!("send_email.{k:064}");
    for value in [&[0u8; 78][..], &[0u8; 170][..]] {
        raw.insert(&key, value).unwrap();
        raw.flush().unwrap();
        if let Some(log) = log {
            log.sync_data().unwrap();
        }
    }
}

/// Writes `records` entries made by `entry` into `tree`, one insert each (as a store
/// fills), in key order, then flushes. Key order: random keys make sled copy a
/// different node on every insert, and a 10⁶-record fill took 1.8 times as long. Not
/// `apply_batch`: sled 0.34 leaves a tree filled by large batches with nodes it does
/// not split, and a get there takes 8 to 15 µs from 3·10⁵ records on, where a tree
/// filled one insert at a time answers in under 1 µs at 10⁶.
fn fill(tree: &sled::Tree, records: u64, entry: impl Fn(u64) -> (Vec<u8>, Vec<u8>)) {
    let mut entries: Vec<_> = (0..records).map(entry).collect();
    entries.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    for (k, v) in entries {
        tree.insert(k, v).unwrap();
    }
    tree.flush().unwrap();
}

struct HashWriter(Sha256);

impl Write for HashWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The floor of key derivation: JSON streamed into SHA-256 (no key sorting), hex into
/// a stack buffer.
pub fn floor_key(input: &SendEmail) -> [u8; 64] {
    let mut h = HashWriter(Sha256::new());
    serde_json::to_writer(&mut h, input).unwrap();
    let digest = h.0.finalize();
    let mut hex = [0u8; 64];
    for (i, b) in digest.iter().enumerate() {
        hex[2 * i] = b"0123456789abcdef"[usize::from(b >> 4)];
        hex[2 * i + 1] = b"0123456789abcdef"[usize::from(b & 15)];
    }
    hex
}

/// The text a hand-written floor keys `input` by: the tool's name and [`floor_key`].
pub fn keyed(input: &SendEmail) -> String {
    let hex = floor_key(input);
    format!("send_email.{}", std::str::from_utf8(&hex).unwrap())
}

/// The Redis floor: one `GET` round trip on a plain multiplexed connection, of a value
/// as long as a hit's record (168 bytes: the 54-byte header and the 114-byte result),
/// as the Postgres floor reads a row that exists.
#[cfg(feature = "redis")]
pub struct RedisFloor {
    connection: redis::aio::MultiplexedConnection,
    key: String,
}

#[cfg(feature = "redis")]
impl RedisFloor {
    /// Connects to Redis at `url` and writes the value the floor reads.
    pub async fn connect(url: &str) -> RedisFloor {
        let client = redis::Client::open(url).unwrap();
        let mut connection = client.get_multiplexed_async_connection().await.unwrap();
        let key = format!("idem-bench-floor:{}", std::process::id());
        let _: () = redis::cmd("SET")
            .arg(&key)
            .arg(&[7u8; 168][..])
            .arg("PX")
            .arg(600_000)
            .query_async(&mut connection)
            .await
            .unwrap();
        RedisFloor { connection, key }
    }

    /// One round trip: `GET` of the floor's value.
    pub async fn round_trip(&self) {
        let mut c = self.connection.clone();
        let value: Option<Vec<u8>> = redis::cmd("GET")
            .arg(&self.key)
            .query_async(&mut c)
            .await
            .unwrap();
        std::hint::black_box(value.unwrap());
    }

    /// Writes a value of `len` bytes under `key`, for ten minutes.
    pub async fn write(&self, key: &str, len: usize) {
        let mut c = self.connection.clone();
        let _: () = redis::cmd("SET")
            .arg(key)
            .arg(vec![7u8; len])
            .arg("PX")
            .arg(600_000)
            .query_async(&mut c)
            .await
            .unwrap();
    }

    /// A hit's command alone, as the store sends it: `SET key claim NX GET PX` with a
    /// 150-byte claim (a claim with its origin), on a `key` that holds a record (see
    /// [`RedisFloor::write`]), which comes back and stays.
    pub async fn claim_command(&self, key: &str) {
        let found = self.set_if_absent(key, &[1u8; 150]).await;
        std::hint::black_box(found.expect("the record is there"));
    }

    /// `SET key claim NX GET PX` (ten minutes): what was there, if anything.
    async fn set_if_absent(&self, key: &str, claim: &[u8]) -> Option<Vec<u8>> {
        let mut c = self.connection.clone();
        redis::cmd("SET")
            .arg(key)
            .arg(claim)
            .arg("NX")
            .arg("GET")
            .arg("PX")
            .arg(600_000)
            .query_async(&mut c)
            .await
            .unwrap()
    }

    /// A fenced miss done the plain way on Redis 7, on a new key `<prefix>floor-<k>`: a
    /// claim (`SET key claim NX GET PX`, a 78-byte claim), then a 168-byte record
    /// written only while the claim is still there, which on Redis 7 takes a script
    /// (`GET`, compare, `SET`): two round trips, the second of them a script.
    pub async fn fenced_miss(&self, prefix: &str, k: u64) {
        self.fenced_write(&format!("{prefix}floor-{k}"), &[7u8; 168])
            .await;
    }

    /// A 78-byte claim of the new `key`, then `record` written while it is there.
    async fn fenced_write(&self, key: &str, record: &[u8]) {
        static FENCED: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
            redis::Script::new(
                "if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1",
            )
        });
        let claim = [1u8; 78];
        let found = self.set_if_absent(key, &claim).await;
        assert!(found.is_none(), "the floor's key {key} was not new");
        let mut c = self.connection.clone();
        let applied: i64 = FENCED
            .key(key)
            .arg(&claim[..])
            .arg(record)
            .arg(600_000)
            .invoke_async(&mut c)
            .await
            .unwrap();
        assert_eq!(applied, 1);
    }

    /// A hit done by hand: the key of `input`, one `GET` of it under `prefix`, and the
    /// result decoded from the value's tail (past a 54-byte header, as a record's).
    /// False if the key is missing.
    pub async fn keyed_hit(&self, prefix: &str, input: &SendEmail) -> bool {
        let key = format!("{prefix}{}", keyed(input));
        let mut c = self.connection.clone();
        let value: Option<Vec<u8>> = redis::cmd("GET")
            .arg(&key)
            .query_async(&mut c)
            .await
            .unwrap();
        let Some(value) = value else {
            return false;
        };
        let id: MessageId = serde_json::from_slice(&value[54..]).unwrap();
        std::hint::black_box(id);
        true
    }

    /// A fenced miss done by hand: the key of `input`, its claim (`SET NX GET PX`, 78
    /// bytes), and the result encoded behind a 54-byte header and written by the
    /// script while the claim is there.
    pub async fn keyed_miss(&self, prefix: &str, input: &SendEmail) {
        let key = format!("{prefix}{}", keyed(input));
        let mut record = vec![7u8; 54];
        serde_json::to_writer(&mut record, &message_id()).unwrap();
        self.fenced_write(&key, &record).await;
    }

    /// Deletes every key under `prefix` (what a benchmark's store wrote).
    pub async fn clean(&self, prefix: &str) {
        let mut c = self.connection.clone();
        let _: () = redis::cmd("DEL")
            .arg(&self.key)
            .query_async(&mut c)
            .await
            .unwrap();
        // In batches, so that hundreds of thousands of keys stay within a command's
        // timeout.
        let mut cursor = 0u64;
        loop {
            let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(format!("{prefix}*"))
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut c)
                .await
                .unwrap();
            if !keys.is_empty() {
                let _: () = redis::cmd("UNLINK")
                    .arg(&keys)
                    .query_async(&mut c)
                    .await
                    .unwrap();
            }
            if next == 0 {
                break;
            }
            cursor = next;
        }
    }
}

/// A run on a `RedisStore` under `prefix`; with `local_cache`, behind a `LocalCache`.
#[cfg(feature = "redis")]
pub async fn redis_run(url: &str, prefix: &str, local_cache: bool) -> Run {
    let store = idem::RedisStore::builder(url)
        .prefix(prefix)
        .connect()
        .await
        .unwrap();
    let run = Run::new("bench-redis");
    if local_cache {
        run.with_store(idem::LocalCache::new(store))
    } else {
        run.with_store(store)
    }
}

/// The Postgres floors, on a table `<table>_floor (k int8 PRIMARY KEY, v bytea)`: one
/// `SELECT` by primary key, and two commits (an `INSERT`, then an `UPDATE`), as a
/// claim and a completion are. They run on the store's own pool, as idem's statements
/// do: a pooled connection checked out per operation, prepared statements cached. On
/// another connection they would talk to another server process, which the scheduler
/// may place on another CPU, and a loopback round trip here differs between CPU
/// placements by up to 80 µs.
#[cfg(feature = "postgres")]
pub struct PostgresFloor {
    pool: deadpool_postgres::Pool,
    table: String,
    select: String,
    insert: String,
    update: String,
    /// The same three on the `text`-keyed table.
    keyed_select: String,
    keyed_insert: String,
    keyed_update: String,
}

#[cfg(feature = "postgres")]
impl PostgresFloor {
    /// Creates the floor's table next to `store`'s.
    pub async fn new(store: &idem::PostgresStore, table: &str) -> PostgresFloor {
        let pool = store.pool().clone();
        let table = format!("{table}_floor");
        pool.get()
            .await
            .unwrap()
            .batch_execute(&format!(
                "CREATE TABLE {table} (k int8 PRIMARY KEY, v bytea); \
                 CREATE TABLE {table}_keyed (k text PRIMARY KEY, v bytea)"
            ))
            .await
            .unwrap();
        PostgresFloor {
            pool,
            select: format!("SELECT v FROM {table} WHERE k = $1"),
            insert: format!("INSERT INTO {table} (k, v) VALUES ($1, $2)"),
            update: format!("UPDATE {table} SET v = $2 WHERE k = $1"),
            keyed_select: format!("SELECT v FROM {table}_keyed WHERE k = $1"),
            keyed_insert: format!("INSERT INTO {table}_keyed (k, v) VALUES ($1, $2)"),
            keyed_update: format!("UPDATE {table}_keyed SET v = $2 WHERE k = $1"),
            table,
        }
    }

    /// One query: `SELECT` by primary key.
    pub async fn query(&self, k: i64) {
        let client = self.pool.get().await.unwrap();
        let stmt = client.prepare_cached(&self.select).await.unwrap();
        client.query_opt(&stmt, &[&k]).await.unwrap();
    }

    /// A hit done by hand, as a caller would without idem: the key of `input` (its
    /// JSON streamed into SHA-256, as text beside the tool's name), one `SELECT` of it
    /// on a table keyed by text, and the result decoded. False if the row is missing.
    pub async fn keyed_hit(&self, input: &SendEmail) -> bool {
        let key = keyed(input);
        let client = self.pool.get().await.unwrap();
        let stmt = client.prepare_cached(&self.keyed_select).await.unwrap();
        let Some(row) = client.query_opt(&stmt, &[&key]).await.unwrap() else {
            return false;
        };
        let bytes: &[u8] = row.get(0);
        let id: MessageId = serde_json::from_slice(bytes).unwrap();
        std::hint::black_box(id);
        true
    }

    /// A miss done by hand on the text-keyed table: the key, a claim committed (a
    /// 78-byte `INSERT`), the result encoded and committed (an `UPDATE`).
    pub async fn keyed_miss(&self, input: &SendEmail) {
        let key = keyed(input);
        let result = serde_json::to_vec(&message_id()).unwrap();
        for (sql, v) in [
            (&self.keyed_insert, &[0u8; 78][..]),
            (&self.keyed_update, &result[..]),
        ] {
            let client = self.pool.get().await.unwrap();
            let stmt = client.prepare_cached(sql).await.unwrap();
            client.execute(&stmt, &[&key, &v]).await.unwrap();
        }
    }

    /// Two commits on row `k` (which must not exist yet).
    pub async fn two_commits(&self, k: i64) {
        for (sql, v) in [
            (&self.insert, &b"claim"[..]),
            (&self.update, &b"result"[..]),
        ] {
            let client = self.pool.get().await.unwrap();
            let stmt = client.prepare_cached(sql).await.unwrap();
            client.execute(&stmt, &[&k, &v]).await.unwrap();
        }
    }

    /// Drops the floor table and the store's table `store_table`.
    pub async fn drop_tables(&self, store_table: &str) {
        self.pool
            .get()
            .await
            .unwrap()
            .batch_execute(&format!(
                "DROP TABLE {store_table}; DROP TABLE {t}; DROP TABLE {t}_keyed",
                t = self.table
            ))
            .await
            .unwrap();
    }
}

/// A run on a `PostgresStore` with its own table, and the floors on its pool.
#[cfg(feature = "postgres")]
pub async fn postgres_run(url: &str, table: &str) -> (Run, PostgresFloor) {
    let store = idem::PostgresStore::builder(url)
        .table(table)
        .connect()
        .await
        .unwrap();
    let floor = PostgresFloor::new(&store, table).await;
    (Run::new("bench-pg").with_store(store), floor)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    /// [`filled_store`] writes each record under the key the attribute gives
    /// `send_email`, so that a benchmark's call of a filled email is a hit.
    #[tokio::test]
    async fn a_filled_record_is_under_the_key_the_attribute_derives() {
        let memory = Arc::new(idem::MemoryStore::new());
        let run = Run::new("bench-size").with_shared_store(memory.clone());
        send_email(&run, &email(2, BODY)).await.unwrap();
        let (_, key) = filled_key(2);
        let record = idem::Store::get(&*memory, &key).await.unwrap();
        assert!(record.is_some(), "no record under {key}");
    }
}
