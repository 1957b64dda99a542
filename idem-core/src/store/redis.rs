//! `RedisStore`: records in Redis, for fleets of workers (its docs give the layout, the
//! scripts, the clock and the timeouts).

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::Script;

use crate::error::{Error, StoreErrorKind};
use crate::key::Fingerprint;
use crate::key_text::Key;
use crate::record::{
    millis, Meta, Record, State, Timestamp, Token, CLAIMED_AT, COMPLETED_AT, FINGERPRINT_AT,
    HEADER, IN_PROGRESS_TAG, TOKEN_AT,
};
use crate::store::net::{self, in_local_clock, First};
use crate::store::{
    decide_claim, decide_resolution, Claim, ClaimRequest, Cursor, Fenced, Filter, Listed, Outcome,
    Page, Resolution, StateKind, Store, Unreadable, WALK_PAGE,
};

mod held;

use held::{splice, Held};

const STORE: &str = "redis";

/// How many times a claim reads again when the record it meant to replace changed
/// under it. Each retry means another call moved the record on, so this bounds a race,
/// not a wait.
const CLAIM_ATTEMPTS: usize = 8;

/// The longest TTL the store sets, in milliseconds (about 35,000 years): Redis
/// refuses an expiry past the end of its clock.
const MAX_PX: u64 = 1 << 50;

/// A script that writes as a claim's owner: it reads the record under KEYS[1] and
/// returns 0 unless the record is in progress with the token ARGV[1]; otherwise it
/// runs `then` and returns 1. The offsets are those of [`Record::encode`].
fn as_owner(then: &str) -> Lua {
    let tag: String = IN_PROGRESS_TAG.iter().map(|b| format!("\\{b}")).collect();
    Lua::new(format!(
        "local v = redis.call('GET', KEYS[1])
if not v or #v < {len} or string.sub(v, 1, {tag_len}) ~= '{tag}'
  or string.sub(v, {t0}, {t1}) ~= ARGV[1] then return 0 end
{then}
return 1",
        len = HEADER,
        tag_len = IN_PROGRESS_TAG.len(),
        t0 = TOKEN_AT + 1,
        t1 = TOKEN_AT + 16,
    ))
}

/// The owner's write where the store does not hold the claim's bytes ([`held`]).
/// KEYS[1] key; ARGV token, the new record's header (`Record::encode` of the outcome
/// with an empty payload, or of the renewed claim), payload (empty for a renewal), ttl
/// ms, split. Writes the header with the claim's fingerprint and, from offset `split`
/// on, the claim's own metadata (its history and origin: [`COMPLETED_AT`] + 8 for a
/// completion, which keeps the last renewal, [`CLAIMED_AT`] for a renewal), then the
/// payload. Returns 1 if applied.
static COMPLETE: LazyLock<Lua> = LazyLock::new(|| {
    as_owner(&format!(
        "redis.call('SET', KEYS[1], string.sub(ARGV[2], 1, {f0}) .. string.sub(v, {f1}, {f2})
  .. string.sub(ARGV[2], {f3}, tonumber(ARGV[5])) .. string.sub(v, tonumber(ARGV[5]) + 1)
  .. ARGV[3], 'PX', ARGV[4])",
        f0 = FINGERPRINT_AT,
        f1 = FINGERPRINT_AT + 1,
        f2 = FINGERPRINT_AT + 32,
        f3 = FINGERPRINT_AT + 33,
    ))
});

/// KEYS[1] key; ARGV the record read. Deletes the key only if it still holds exactly
/// that record. Returns 1 if applied.
static REMOVE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(
        "if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1"
            .to_owned(),
    )
});

/// KEYS the keys of a listed page. Returns, for each key, its value if it is a string
/// (else false) and its time left (`PTTL`), then the server time (`TIME`).
static FETCH: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(
        "local out = {}
for _, k in ipairs(KEYS) do
  if redis.call('TYPE', k)['ok'] == 'string' then
    out[#out + 1] = redis.call('GET', k)
  else
    out[#out + 1] = false
  end
  out[#out + 1] = redis.call('PTTL', k)
end
local t = redis.call('TIME')
out[#out + 1] = t[1]
out[#out + 1] = t[2]
return out"
            .to_owned(),
    )
});

/// KEYS[1] key; ARGV token. Deletes the claim. Returns 1 if applied.
static RELEASE: LazyLock<Lua> = LazyLock::new(|| as_owner("redis.call('DEL', KEYS[1])"));

/// KEYS[1] key; ARGV the record a claim read, the record to write, ttl ms. Writes only
/// if the key still holds exactly the record read. Returns 1 if applied.
static REPLACE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(
        "if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1"
            .to_owned(),
    )
});

/// A script of the store's: its text, and the SHA-1 the server knows it by.
struct Lua {
    code: String,
    hash: String,
}

impl Lua {
    fn new(code: String) -> Self {
        let hash = Script::new(&code).get_hash().to_owned();
        Lua { code, hash }
    }
}

/// A record as Redis returned it, decoded, and the time to decide on it by.
struct Found {
    /// The stored bytes, which a claim that replaces the record compares against.
    bytes: Vec<u8>,
    /// The decoded record, its times in the clock of `now`.
    record: Record,
    /// The server clock when the record was read; or 0, the record's own time, when it
    /// was read without the clock (see [`RedisStore::set_if_absent`]).
    now: Timestamp,
}

/// Decodes a record read from Redis. Every record idem stores there lives at least
/// 1 ms from the moment it was stored, which is what lets a claim decide on a record at
/// its own time 0; bytes that say otherwise are corrupt.
fn decode(key: &Key, bytes: &[u8]) -> Result<Record, Error> {
    let record = Record::decode(key.as_str(), bytes)?;
    if record.expires_at <= record.created_at {
        return Err(Error::CorruptRecord {
            key: key.clone(),
            reason: "the record expires when it is stored".to_owned(),
        });
    }
    Ok(record)
}

impl Found {
    /// A record read with the key's time left (`PTTL`) and the server time: its times,
    /// which count from the moment Redis stored it, are placed in the server's clock.
    /// It was stored at *now + time left − expires at*.
    fn in_time(key: &Key, bytes: Vec<u8>, left: i64, now: Timestamp) -> Result<Found, Error> {
        let mut record = decode(key, &bytes)?;
        let left = u64::try_from(left).map_err(|_| Error::CorruptRecord {
            key: key.clone(),
            reason: "the Redis key has no expiry; idem sets one on every record".to_owned(),
        })?;
        let expires_at = now.0.saturating_add(left);
        let stored_at = expires_at.saturating_sub(record.expires_at.0);
        let shift = |t: Timestamp| Timestamp(t.0.saturating_add(stored_at));
        record.created_at = shift(record.created_at);
        record.expires_at = Timestamp(expires_at);
        if let State::InProgress { lease_until, .. } = &mut record.state {
            *lease_until = shift(*lease_until);
        }
        if bytes.get(4) == Some(&1) {
            // Format 1 kept no metadata: its times are the header's, counted from 0.
            let meta = &mut record.meta;
            meta.claimed_at = shift(meta.claimed_at);
            meta.completed_at = meta.completed_at.map(shift);
        }
        Ok(Found { bytes, record, now })
    }
}

/// A TTL as Redis takes it: whole milliseconds, at least 1, at most [`MAX_PX`].
fn px(ttl: Duration) -> u64 {
    millis(ttl).clamp(1, MAX_PX)
}

/// A store in Redis, for workers on many machines. Cheap to clone.
///
/// ```no_run
/// # async fn demo() -> Result<(), idem_core::Error> {
/// use idem_core::{RedisStore, Run};
///
/// let store = RedisStore::connect("redis://cache.internal:6379").await?;
/// let run = Run::new("run-42").with_store(store);
/// # Ok(()) }
/// ```
///
/// `RedisStore`: records in Redis, shared by a fleet of workers (feature `redis`).
///
/// # Layout
///
/// Each record is a Redis string under `<prefix><key>` (prefix `idem:` by default)
/// holding the record encoding every store shares ([`Record::encode`]), with one
/// difference: its times count from 0, the moment Redis stored it. Redis expires the
/// key itself (`PX`) at the record's expiry.
///
/// # Round trips
///
/// - **Claim**: one native command, `SET key claim NX GET PX ttl`. It claims an
///   absent key, or returns the record there unchanged. Redis returns only live keys,
///   and only a lease needs a clock, so a completed, failed or other-input record is
///   decided on those bytes alone, at the record's own time 0: a hit is read in place
///   ([`Record::replayable_result`], as sled's hit path reads it), anything else by
///   [`decide_claim`]. A hit is one round trip, runs no script, writes nothing and
///   copies nothing. A record in progress is
///   read again in one transaction, `GET`, `PTTL`, `TIME`, which places it in the
///   server's time (stored at *now + time left − expires at*) so its lease can be
///   compared with the server clock. Taking over an abandoned claim or retrying a
///   cached error is one more step: a script that replaces the record only if it is
///   still, byte for byte, the one read; otherwise the claim starts again.
///
///   While hits come in a streak (the last 16 claims on the store each found a record
///   and wrote nothing, as a run being replayed makes them), a claim sends a plain
///   `GET` first and decides a completed, failed or other-input record on its bytes
///   in the same way: the hit then builds and sends no claim, and the server writes
///   nothing; a claim in progress is read again in time, as above, so a call polling
///   a running key pays two round trips either way. No record, or a record to claim,
///   goes on to the `SET` above and ends the streak, so a miss right after a streak
///   pays one more round trip.
/// - **Complete**, **renew** and **release**: one Lua script each, fenced by the
///   owner's token. A renewal rewrites the claim as if stored now (its times count from
///   0 again), with the claim's own fingerprint. A completion and a renewal keep parts
///   of the claim they replace (its fingerprint, history and origin); the store keeps
///   the bytes of each claim this process wrote, builds the whole new record itself,
///   and writes it only if the key still holds exactly those bytes, so the server
///   only compares and sets. Where the key holds anything else (a renewal whose answer
///   was lost, a claim taken over), a second script splices the parts in on the
///   server and decides as the owner's token says.
///   A miss is the claim plus a completion: two round trips, one of them a script.
/// - **Get** is that `GET`, `PTTL`, `TIME` transaction; **delete** is `DEL`.
///
/// Every time is the **Redis server clock** (`TIME`, and the key's TTL), so workers
/// with skewed clocks agree on leases and expiry, except [`Claim::Busy`]'s
/// `lease_until`, which is converted to this process's clock, the one a waiting call
/// sleeps by. [`Store::purge_expired`] has nothing to do and returns 0. Needs Redis
/// 7.0 or later (`SET` with both `NX` and `GET`).
///
/// A value under a key that is not such a record (another program's key, a Redis
/// type other than string) is an [`Error::CorruptRecord`] and is left as it is.
///
/// The connection is a `redis::aio::ConnectionManager`: it reconnects after a server
/// restart. Every operation is bounded by the store's timeout (5 seconds by default):
/// an unreachable or stopped server is an [`Error::Store`] within that time, and the
/// operation is not run.
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    connection: ConnectionManager,
    prefix: String,
    timeout: Duration,
    /// The claims this process holds, as written: see [`held`].
    held: Held,
    /// Whether claims read first (see [`net::Streak`]).
    streak: net::Streak,
}

/// Configures a [`RedisStore`]: key prefix and timeout.
#[derive(Debug, Clone)]
pub struct RedisStoreBuilder {
    url: String,
    prefix: String,
    timeout: Duration,
}

impl RedisStoreBuilder {
    /// The prefix of every Redis key the store writes (`idem:` by default).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The bound on every operation, connecting included (5 seconds by default): more
    /// than zero, or building the store fails with a [`StoreErrorKind::Config`] error.
    /// `Duration::MAX` bounds nothing.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Builds the store without connecting: the connection opens on first use. Must be
    /// called inside a tokio runtime (the connection manager lives on it); elsewhere it
    /// is an [`Error::Store`].
    pub fn build(self) -> Result<RedisStore, Error> {
        crate::store::check_timeout(STORE, self.timeout, Duration::from_nanos(1), Duration::MAX)?;
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(redis_error(
                "a RedisStore must be built inside a tokio runtime, which drives its connection",
            ));
        }
        // Opening a client only reads its URL: a failure is a bad setting.
        let client = redis::Client::open(self.url.as_str())
            .map_err(|e| net::failure(STORE, e, |_, _| StoreErrorKind::Config))?;
        // Every operation is bounded by the store's timeout around it (`bounded`), which
        // also covers a reconnection; a response timeout of redis' own would be a
        // second timer on every command, and never the first to fire. (Neither makes
        // the connection manager reconnect: a timeout is not a dropped connection.)
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(None)
            .set_number_of_retries(2);
        let connection =
            ConnectionManager::new_lazy_with_config(client, config).map_err(redis_error)?;
        Ok(RedisStore {
            inner: Arc::new(Inner {
                connection,
                prefix: self.prefix,
                timeout: self.timeout,
                held: Held::default(),
                streak: net::Streak::default(),
            }),
        })
    }

    /// Builds the store and checks the server answers, and that it is Redis 7.0 or
    /// later (`SET` with both `NX` and `GET`), as `INFO server` tells. A server that
    /// refuses `INFO` (an ACL) is not checked; an older one is an [`Error::Store`].
    pub async fn connect(self) -> Result<RedisStore, Error> {
        let store = self.build()?;
        let info = store
            .bounded(async {
                let mut c = store.inner.connection.clone();
                match redis::cmd("INFO")
                    .arg("server")
                    .query_async::<String>(&mut c)
                    .await
                {
                    Ok(info) => Ok(Some(info)),
                    // The server answered, with an error: it is up, and says no.
                    Err(e) if e.code().is_some() => Ok(None),
                    Err(e) => Err(redis_error(e)),
                }
            })
            .await?;
        if let Some((major, minor)) = info.as_deref().and_then(server_version) {
            if major < 7 {
                return Err(redis_error(format!(
                    "Redis {major}.{minor} is too old: idem needs 7.0 or later (SET with NX and GET)"
                )));
            }
        }
        Ok(store)
    }
}

/// The `redis_version` line of `INFO server`, as (major, minor).
fn server_version(info: &str) -> Option<(u32, u32)> {
    let version = info
        .lines()
        .find_map(|line| line.trim().strip_prefix("redis_version:"))?;
    let mut parts = version.split('.').map(str::parse::<u32>);
    Some((parts.next()?.ok()?, parts.next()?.ok()?))
}

/// A key of the store as Redis names it, written straight into a command's buffer:
/// no `String` is built for it on each call.
#[derive(Clone, Copy)]
struct RedisKey<'a> {
    prefix: &'a str,
    key: &'a Key,
}

impl RedisKey<'_> {
    fn len(&self) -> usize {
        self.prefix.len() + self.key.as_str().len()
    }
}

impl redis::ToRedisArgs for RedisKey<'_> {
    fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
        use std::io::Write as _;
        let mut arg = out.writer_for_next_arg();
        // Writes into a `Vec`: they cannot fail.
        let _ = arg.write_all(self.prefix.as_bytes());
        let _ = arg.write_all(self.key.as_str().as_bytes());
    }
}

/// A Redis failure with its whole cause (the server's reply, the connection's OS
/// error); the original error stays its source.
fn redis_error(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Error {
    net::failure(STORE, e, |_, _| StoreErrorKind::Other)
}

impl RedisStore {
    /// Connects to `url` (`redis://host:port/db`) with the defaults.
    pub async fn connect(url: &str) -> Result<Self, Error> {
        Self::builder(url).connect().await
    }

    /// A builder, to choose the key prefix or the timeout.
    pub fn builder(url: &str) -> RedisStoreBuilder {
        RedisStoreBuilder {
            url: url.to_owned(),
            prefix: "idem:".to_owned(),
            timeout: Duration::from_secs(5),
        }
    }

    /// The prefix of the store's Redis keys.
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// `key` as Redis names it: the prefix, then the key's text.
    fn redis_key<'a>(&'a self, key: &'a Key) -> RedisKey<'a> {
        RedisKey {
            prefix: &self.inner.prefix,
            key,
        }
    }

    /// The command `name` of the one key `key`, its buffer sized once: `redis::cmd`
    /// starts empty and grows it (a reallocation and a copy) when the key is written,
    /// on every hit.
    fn command_on(&self, name: &str, key: &Key) -> redis::Cmd {
        let redis_key = self.redis_key(key);
        let mut command = redis::Cmd::with_capacity(2, name.len() + redis_key.len());
        command.arg(name).arg(redis_key);
        command
    }

    /// Runs `f` within the store's timeout (a plain `fn`: an `async fn` would hold `f`
    /// twice, in every operation's future).
    fn bounded<F>(&self, f: F) -> net::Bounded<F> {
        net::bounded(STORE, self.inner.timeout, f)
    }

    /// Runs a script on `key` with `args` (see [`RedisStore::eval`]).
    async fn script<T: redis::FromRedisValue>(
        &self,
        script: &Lua,
        key: &Key,
        args: &[&[u8]],
    ) -> Result<T, Error> {
        self.eval(script, key, &[self.redis_key(key)], args).await
    }

    /// Runs a script on `keys` with `args` (errors name `label`): `EVALSHA`, and `EVAL`
    /// with the script's text if the server does not have it (lost to `SCRIPT FLUSH`
    /// or a restart without persistence). `EVAL` cannot miss the script, however often
    /// it is flushed, and leaves it cached for the next `EVALSHA`. The command is sized
    /// once and built here (redis' `ScriptInvocation` copies each argument into a
    /// buffer of its own first, then grows the command as it writes them).
    async fn eval<T: redis::FromRedisValue, K: redis::ToRedisArgs>(
        &self,
        script: &Lua,
        label: &Key,
        keys: &[K],
        args: &[&[u8]],
    ) -> Result<T, Error> {
        let command = |eval: &str, body: &str| {
            let size = 32
                + body.len()
                + keys.len() * 96
                + args.iter().map(|a| 16 + a.len()).sum::<usize>();
            let mut command = redis::Cmd::with_capacity(3 + keys.len() + args.len(), size);
            command.arg(eval).arg(body).arg(keys.len());
            for key in keys {
                command.arg(key);
            }
            for arg in args {
                command.arg(*arg);
            }
            command
        };
        let by_hash = command("EVALSHA", &script.hash);
        self.send(label, |mut c| async move {
            match by_hash.query_async(&mut c).await {
                Err(e)
                    if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
                {
                    command("EVAL", &script.code).query_async(&mut c).await
                }
                answer => answer,
            }
        })
        .await
    }

    /// The claim's first step, one native command: `SET key claim NX GET PX ttl`.
    /// Claims an absent key (`None`), or returns what is there, unchanged.
    ///
    /// Redis returns only live keys, and deciding on a completed or failed record
    /// needs no clock, so those are decided on these bytes alone, and a hit costs one
    /// command and writes nothing. Only a record in progress is read again, with
    /// [`RedisStore::read`], to compare its lease with the server clock.
    async fn set_if_absent(
        &self,
        key: &Key,
        claim: &[u8],
        ttl: u64,
    ) -> Result<Option<Vec<u8>>, Error> {
        let redis_key = self.redis_key(key);
        // Sized once: the command's buffer would otherwise grow (and copy) as each
        // argument is written, several times a call.
        let mut command = redis::Cmd::with_capacity(7, 24 + redis_key.len() + claim.len());
        command
            .arg("SET")
            .arg(redis_key)
            .arg(claim)
            .arg("NX")
            .arg("GET")
            .arg("PX")
            .arg(ttl);
        self.send(
            key,
            |mut c| async move { command.query_async(&mut c).await },
        )
        .await
    }

    /// The bytes under `key`, with a plain `GET`.
    async fn get_bytes(&self, key: &Key) -> Result<Option<Vec<u8>>, Error> {
        let command = self.command_on("GET", key);
        self.send(
            key,
            |mut c| async move { command.query_async(&mut c).await },
        )
        .await
    }

    /// A claim in a streak of hits (see [`net::Streak`]): the record under `key` with a
    /// plain `GET`, which writes nothing and sends no claim, decided as the claim's own
    /// `SET NX GET` decides a record it returns: a claim in progress is read again in
    /// time, as there, since its lease needs the server's clock (so a call polling a
    /// running key pays two round trips either way). `None` where the claim must go on:
    /// no record, or a record to claim.
    async fn read_first(&self, key: &Key, request: &ClaimRequest) -> Result<Option<Claim>, Error> {
        let Some(bytes) = self.get_bytes(key).await? else {
            return Ok(None);
        };
        let bytes = match replayed(bytes, &request.fingerprint) {
            Ok(result) => return Ok(Some(Claim::Completed(result))),
            Err(bytes) => bytes,
        };
        let record = decode(key, &bytes)?;
        let (record, now) = match record.state {
            // Boxed, as it is rare: the hit's future stays the size of its `GET`.
            State::InProgress { .. } => match Box::pin(self.read(key)).await? {
                Some(found) => (found.record, found.now),
                None => return Ok(None),
            },
            _ => (record, Timestamp(0)),
        };
        Ok(match decide_claim(Some(&record), request, now) {
            (decision, None) => Some(in_local_clock(decision, now)),
            (_, Some(_)) => None,
        })
    }

    /// The record under `key` placed in time: one atomic transaction of native
    /// commands, `GET key`, `PTTL key`, `TIME`.
    async fn read(&self, key: &Key) -> Result<Option<Found>, Error> {
        let redis_key = self.redis_key(key);
        let mut pipe = redis::pipe();
        pipe.atomic()
            .cmd("GET")
            .arg(redis_key)
            .cmd("PTTL")
            .arg(redis_key)
            .cmd("TIME");
        let (bytes, left, (secs, micros)): (Option<Vec<u8>>, i64, (u64, u64)) = self
            .send(key, |mut c| async move { pipe.query_async(&mut c).await })
            .await?;
        let now = Timestamp(secs.saturating_mul(1000).saturating_add(micros / 1000));
        bytes
            .map(|bytes| Found::in_time(key, bytes, left, now))
            .transpose()
    }

    /// Writes as the owner of the claim `token` holds: the record `header` (an outcome's
    /// or a renewed claim's, with no fingerprint) with the claim's fingerprint and its
    /// own bytes from `split` on, then `payload`, expiring in `px` ms. Where this
    /// process holds the claim's bytes ([`held`]), the whole record is built here and
    /// written only if the key still holds exactly them (`REPLACE`, no splicing on the
    /// server); otherwise, or if it does not, the splicing script (`COMPLETE`) decides.
    /// A renewal that keeps its claim passes the lease's new end as `until`: the claim
    /// written is kept in place of the old. Each script runs in a box of its own: in
    /// line, the two made the completion's future 1,328 bytes, past the 1,032 that
    /// glibc's per-thread cache serves (two boxes that fit cost less than one that
    /// does not).
    #[allow(clippy::too_many_arguments)]
    async fn owner_write(
        &self,
        key: &Key,
        token: Token,
        header: &[u8],
        split: usize,
        payload: &[u8],
        px: u64,
        until: Option<Timestamp>,
    ) -> Result<Fenced, Error> {
        let px = px.to_string();
        if let Some(claim) = self.inner.held.take(key, token) {
            if let Some(record) = splice(&claim, header, split, payload) {
                let args: [&[u8]; 3] = [&claim, &record, px.as_bytes()];
                let written: i64 = Box::pin(self.script(&REPLACE, key, &args)).await?;
                if written == 1 {
                    if let Some(until) = until {
                        self.inner.held.hold(key, record, until);
                    }
                    return Ok(Fenced::Applied);
                }
            }
        }
        let token = token.0.to_be_bytes();
        let split = split.to_string();
        let args: [&[u8]; 5] = [&token, header, payload, px.as_bytes(), split.as_bytes()];
        let applied: i64 = Box::pin(self.script(&COMPLETE, key, &args)).await?;
        Ok(net::fenced(applied as u64))
    }

    /// A page of the listing (see [`Store::list`]), with the bytes each listed record
    /// was read as.
    async fn page(
        &self,
        filter: &Filter,
        after: Option<&Cursor>,
        limit: usize,
    ) -> Result<(Page, Vec<Vec<u8>>), Error> {
        let cursor = after.map_or("0", |c| c.0.as_str()).to_owned();
        let pattern = format!("{}*", glob_escape(&self.inner.prefix));
        let mut scan = redis::cmd("SCAN");
        scan.arg(&cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(limit.max(1));
        let listing = Key::from_text(format!("{pattern} (listing)"));
        let (next, keys): (String, Vec<Vec<u8>>) = self
            .send(
                &listing,
                |mut c| async move { scan.query_async(&mut c).await },
            )
            .await?;
        let mut page = Page {
            next: (next != "0").then_some(Cursor(next)),
            now: Timestamp::now(),
            ..Page::default()
        };
        let mut bytes = Vec::new();
        if keys.is_empty() {
            return Ok((page, bytes));
        }
        let values: Vec<redis::Value> = self.eval(&FETCH, &listing, &keys, &[]).await?;
        let int = |v: Option<&redis::Value>| -> Option<i64> {
            match v? {
                redis::Value::Int(n) => Some(*n),
                redis::Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
                redis::Value::SimpleString(s) => s.parse().ok(),
                _ => None,
            }
        };
        let (secs, micros) = (
            int(values.get(keys.len() * 2)),
            int(values.get(keys.len() * 2 + 1)),
        );
        let (Some(secs), Some(micros)) = (secs, micros) else {
            return Err(redis_error("the listing script's reply has no server time"));
        };
        let now =
            Timestamp((secs.max(0) as u64).saturating_mul(1000) + micros.max(0) as u64 / 1000);
        page.now = now;
        for (i, redis_key) in keys.iter().enumerate() {
            let text = String::from_utf8_lossy(redis_key);
            let key = Key::from_text(text.strip_prefix(&*self.inner.prefix).unwrap_or(&text));
            let left = int(values.get(2 * i + 1)).unwrap_or(-2);
            let corrupt = |reason: &str| Error::CorruptRecord {
                key: key.clone(),
                reason: reason.to_owned(),
            };
            let found = match values.get(2 * i) {
                // Gone since the scan.
                _ if left == -2 => continue,
                // Not a key idem wrote: it could not be read or removed by this name.
                _ if std::str::from_utf8(redis_key).is_err() => {
                    Err(corrupt("the Redis key's name is not UTF-8"))
                }
                Some(redis::Value::BulkString(bytes)) => {
                    Found::in_time(&key, bytes.clone(), left, now)
                }
                _ => Err(corrupt("the Redis key holds another type than a string")),
            };
            match found {
                Ok(found) if found.record.is_expired(now) => {}
                Ok(found) if filter.matches(&key, &found.record, now) => {
                    page.records.push(Listed {
                        key,
                        record: found.record,
                    });
                    bytes.push(found.bytes);
                }
                Ok(_) => {}
                Err(error) => page.unreadable.push(Unreadable { key, error }),
            }
        }
        Ok((page, bytes))
    }

    /// The rest of a claim whose `SET NX GET` found `bytes`, a record it does not
    /// replay (see [`Store::claim`]): decided, or `None` if the record changed under
    /// it (the claim tries again). `fresh` is the claim it sent, `claim` its bytes.
    async fn contend(
        &self,
        key: &Key,
        request: &ClaimRequest,
        fresh: &Record,
        claim: &[u8],
        bytes: Vec<u8>,
    ) -> Result<Option<Claim>, Error> {
        let streak = &self.inner.streak;
        let ttl = fresh.expires_at.0;
        let record = decode(key, &bytes)?;
        let found = if matches!(record.state, State::InProgress { .. }) {
            // Only a lease needs the clock: read the record again, in time.
            match self.read(key).await? {
                Some(found) => found,
                None => return Ok(None),
            }
        } else {
            // Redis returned it, so it is live; decided at its own time 0.
            Found {
                bytes,
                record,
                now: Timestamp(0),
            }
        };
        let (decision, write) = decide_claim(Some(&found.record), request, found.now);
        let Some(write) = write else {
            streak.found();
            return Ok(Some(in_local_clock(decision, found.now)));
        };
        // A takeover or a retry goes on with the record's history; a record that
        // expired meanwhile starts a new one.
        let next = match found.record.is_expired(found.now) {
            true => claim.to_vec(),
            false => Record {
                meta: write.meta,
                ..fresh.clone()
            }
            .encode(),
        };
        let px = ttl.to_string();
        let replaced: i64 = self
            .script(&REPLACE, key, &[&found.bytes, &next, px.as_bytes()])
            .await?;
        if replaced == 1 {
            if matches!(decision, Claim::Acquired { .. }) {
                let until = fresh.meta.claimed_at.after(request.lease);
                self.inner.held.hold(key, next, until);
            }
            streak.broken();
            return Ok(Some(decision));
        }
        Ok(None)
    }

    /// Sends a request about `key` on a handle of the connection, within the store's
    /// timeout.
    async fn send<T, F>(
        &self,
        key: &Key,
        send: impl FnOnce(ConnectionManager) -> F,
    ) -> Result<T, Error>
    where
        F: std::future::Future<Output = redis::RedisResult<T>>,
    {
        let connection = self.inner.connection.clone();
        self.bounded(async { send(connection).await.map_err(|e| command_error(key, e)) })
            .await
    }
}

/// The result of a completed record Redis returned, for a claim of `fingerprint`: the
/// tail of its bytes, handed on without a copy; or the bytes back if it replays
/// nothing. The record is live (Redis returned it), so it is read at its own time 0.
fn replayed(mut bytes: Vec<u8>, fingerprint: &Fingerprint) -> Result<Vec<u8>, Vec<u8>> {
    match Record::replayable_result(&bytes, fingerprint, Timestamp(0)).map(<[u8]>::len) {
        Some(len) => {
            bytes.drain(..bytes.len() - len);
            Ok(bytes)
        }
        None => Err(bytes),
    }
}

/// A Redis error of a command on `key`: a key of another Redis type (not an idem
/// record) is [`Error::CorruptRecord`], anything else [`Error::Store`].
fn command_error(key: &Key, e: redis::RedisError) -> Error {
    let message = e.to_string();
    let wrong_type = e
        .into_server_errors()
        .is_some_and(|errors| errors.iter().any(|(_, e)| e.code() == "WRONGTYPE"));
    if wrong_type {
        return Error::CorruptRecord {
            key: key.clone(),
            reason: "the Redis key holds another type than a string: not a record this idem \
                     reads (earlier builds kept hashes; delete the key or let it expire)"
                .to_owned(),
        };
    }
    redis_error(message)
}

/// `text` with the characters a `SCAN MATCH` pattern gives a meaning to escaped.
fn glob_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.inner.prefix)
            .finish()
    }
}

#[async_trait]
impl Store for RedisStore {
    fn name(&self) -> &'static str {
        "redis"
    }

    /// A renewal is a script on the shared connection: it waits for the server, and
    /// never blocks a thread. The heartbeat runs as many at once as are due. (Run on
    /// threads, 32 at most at once, the renewals of many bodies started together fell
    /// behind their leases, and other workers took the claims over.)
    fn renewals_block(&self) -> bool {
        false
    }

    async fn claim(&self, key: &Key, request: &ClaimRequest) -> Result<Claim, Error> {
        // In a streak of hits, a `GET` first: a hit then builds and sends no claim, and
        // the server writes nothing (see `net::Streak`). A miss after a streak pays
        // one more round trip.
        let streak = &self.inner.streak;
        if streak.first() == First::Read {
            if let Some(claim) = self.read_first(key, request).await? {
                streak.found();
                return Ok(claim);
            }
            // The `SET` decides, and what it finds moves the streak.
        }
        // The record lives one TTL past the lease.
        let ttl = px(request.lease.saturating_add(request.ttl));
        // Times count from 0, the moment Redis stores the claim, except the
        // metadata's, which are this worker's clock.
        let fresh = Record {
            fingerprint: request.fingerprint,
            created_at: Timestamp(0),
            expires_at: Timestamp(ttl),
            state: State::InProgress {
                token: request.token,
                lease_until: Timestamp(millis(request.lease)),
            },
            meta: Meta {
                origin: Some(request.origin.clone()),
                claimed_at: Timestamp::now(),
                attempts: 1,
                ..Meta::default()
            },
        };
        let claim = fresh.encode();
        let until = fresh.meta.claimed_at.after(request.lease);
        for _ in 0..CLAIM_ATTEMPTS {
            let Some(bytes) = self.set_if_absent(key, &claim, ttl).await? else {
                self.inner.held.hold(key, claim, until);
                streak.inserted();
                return Ok(Claim::Acquired { took_over: false });
            };
            let bytes = match replayed(bytes, &request.fingerprint) {
                Ok(result) => {
                    streak.found();
                    return Ok(Claim::Completed(result));
                }
                Err(bytes) => bytes,
            };
            // Anything else is rare (a claim in progress, a record to take over, a
            // mismatch): decided in a future of its own, so that the claim's future,
            // moved whole into its box at every claim, stays the size of its commands.
            let contended = self.contend(key, request, &fresh, &claim, bytes);
            if let Some(decision) = Box::pin(contended).await? {
                return Ok(decision);
            }
            tracing::debug!(%key, "record changed between a claim's read and its write; reading again");
        }
        Err(redis_error(format!(
            "the record under `{key}` changed under each of {CLAIM_ATTEMPTS} claim attempts"
        )))
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        outcome: Outcome<'_>,
        ttl: Duration,
    ) -> Result<Fenced, Error> {
        let ttl = px(ttl);
        let (state, payload) = match outcome {
            Outcome::Completed(b) => (State::Completed { result: Vec::new() }, b),
            Outcome::Failed(b) => (State::Failed { error: Vec::new() }, b),
        };
        // The header only: the script puts the claim's fingerprint in it, then the payload.
        let header = Record {
            fingerprint: Fingerprint::from_bytes([0; 32]),
            created_at: Timestamp(0),
            expires_at: Timestamp(ttl),
            state,
            meta: Meta {
                completed_at: Some(Timestamp::now()),
                ..Meta::default()
            },
        }
        .encode();
        self.owner_write(key, token, &header, COMPLETED_AT + 8, payload, ttl, None)
            .await
    }

    async fn release(&self, key: &Key, token: Token) -> Result<Fenced, Error> {
        // Released, the claim is no longer this process's to complete.
        self.inner.held.take(key, token);
        let token = token.0.to_be_bytes();
        let applied: i64 = self.script(&RELEASE, key, &[&token]).await?;
        Ok(net::fenced(applied as u64))
    }

    async fn renew(
        &self,
        key: &Key,
        token: Token,
        lease: Duration,
        ttl: Duration,
    ) -> Result<Fenced, Error> {
        let px = px(lease.saturating_add(ttl));
        // The whole claim, as if stored now; the script puts the claim's fingerprint in.
        let claim = Record {
            fingerprint: Fingerprint::from_bytes([0; 32]),
            created_at: Timestamp(0),
            expires_at: Timestamp(px),
            state: State::InProgress {
                token,
                lease_until: Timestamp(millis(lease).min(px - 1)),
            },
            meta: Meta {
                renewed_at: Some(Timestamp::now()),
                ..Meta::default()
            },
        }
        .encode();
        // A claim given up is not this process's any more: it is not kept.
        let until = (!lease.is_zero()).then(|| Timestamp::now().after(lease));
        self.owner_write(key, token, &claim, CLAIMED_AT, b"", px, until)
            .await
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>, Error> {
        Ok(self
            .read(key)
            .await?
            .filter(|found| !found.record.is_expired(found.now))
            .map(|found| found.record))
    }

    async fn delete(&self, key: &Key) -> Result<bool, Error> {
        let command = self.command_on("DEL", key);
        let deleted: i64 = self
            .send(
                key,
                |mut c| async move { command.query_async(&mut c).await },
            )
            .await?;
        Ok(deleted == 1)
    }

    /// One `SCAN` of the store's prefix per page (the cursor is `SCAN`'s), then one
    /// script that reads the page's records and the server time. A page holds about
    /// `limit` records before filtering (`SCAN`'s `COUNT` is a hint), and pages are in
    /// no particular order.
    async fn list(
        &self,
        filter: &Filter,
        after: Option<&Cursor>,
        limit: usize,
    ) -> Result<Page, Error> {
        Ok(self.page(filter, after, limit).await?.0)
    }

    /// Decided on the record read, and removed only if the key still holds exactly it.
    async fn delete_settled(&self, key: &Key) -> Result<bool, Error> {
        let Some(found) = self.read(key).await? else {
            return Ok(false);
        };
        let (record, now) = (&found.record, found.now);
        if record.is_expired(now) || StateKind::of(record, now) == StateKind::Running {
            return Ok(false);
        }
        let removed: i64 = self.script(&REMOVE, key, &[&found.bytes]).await?;
        Ok(removed == 1)
    }

    /// Walks the listing; each record is removed only if its key still holds exactly
    /// the bytes the listing judged.
    async fn delete_matching(&self, filter: &Filter) -> Result<u64, Error> {
        let (mut removed, mut after) = (0, None);
        loop {
            let (page, bytes) = self.page(filter, after.as_ref(), WALK_PAGE).await?;
            for (listed, bytes) in page.records.iter().zip(&bytes) {
                let gone: i64 = self.script(&REMOVE, &listed.key, &[bytes]).await?;
                removed += u64::from(gone == 1);
            }
            match page.next {
                Some(next) => after = Some(next),
                None => return Ok(removed),
            }
        }
    }

    /// Reads the record in time, decides, and writes only if the key still holds
    /// exactly the record read.
    async fn resolve(
        &self,
        key: &Key,
        token: Token,
        resolution: Resolution<'_>,
    ) -> Result<Fenced, Error> {
        let Some(found) = self.read(key).await? else {
            return Ok(Fenced::LostLease);
        };
        let write = match decide_resolution(Some(&found.record), token, resolution, found.now) {
            Ok(write) => write,
            Err(lost) => return Ok(lost),
        };
        let applied: i64 = match (write, resolution) {
            (Some(record), Resolution::Completed { ttl, .. }) => {
                let ttl = px(ttl);
                let bytes = Record {
                    created_at: Timestamp(0),
                    expires_at: Timestamp(ttl),
                    meta: Meta {
                        completed_at: Some(Timestamp::now()),
                        ..record.meta
                    },
                    ..record
                }
                .encode();
                let ttl = ttl.to_string();
                self.script(&REPLACE, key, &[&found.bytes, &bytes, ttl.as_bytes()])
                    .await?
            }
            _ => self.script(&REMOVE, key, &[&found.bytes]).await?,
        };
        Ok(net::fenced(applied as u64))
    }

    /// Redis expires records itself (`PX`): nothing to purge.
    async fn purge_expired(&self) -> Result<u64, Error> {
        Ok(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_version_reads_the_info_line() {
        let info = "# Server\r\nredis_version:7.0.15\r\nredis_git_sha1:00000000\r\n";
        assert_eq!(server_version(info), Some((7, 0)));
        assert_eq!(server_version("redis_version:6.2.14\n"), Some((6, 2)));
        assert_eq!(server_version("redis_version:unknown\n"), None);
        assert_eq!(server_version("# Server\n"), None);
    }

    /// A store under a prefix of its own on `IDEM_REDIS_URL`, and a plain connection
    /// to read its keys behind its back; `None` (said loudly) without the variable.
    async fn store_and_connection() -> Option<(RedisStore, redis::aio::MultiplexedConnection)> {
        let url = net::test_server("IDEM_REDIS_URL")?;
        let prefix = format!("{}:", net::unique_name("idem-held-"));
        let store = RedisStore::builder(&url)
            .prefix(prefix)
            .connect()
            .await
            .unwrap();
        let client = redis::Client::open(url).unwrap();
        Some((
            store,
            client.get_multiplexed_async_connection().await.unwrap(),
        ))
    }

    async fn raw(
        c: &mut redis::aio::MultiplexedConnection,
        store: &RedisStore,
        key: &Key,
    ) -> Option<Vec<u8>> {
        redis::cmd("GET")
            .arg(store.redis_key(key))
            .query_async(c)
            .await
            .unwrap()
    }

    fn claim_request(lease: Duration) -> ClaimRequest {
        ClaimRequest {
            origin: crate::store::Origin::new("run-held", "send_email"),
            fingerprint: Fingerprint::from_bytes([9; 32]),
            token: Token::generate().unwrap(),
            lease,
            ttl: Duration::from_secs(60),
            take_over_expired: true,
            retry_failed: true,
        }
    }

    /// The whole record a completion (or a renewal) builds from the claim it holds is
    /// byte for byte the one the splicing script writes over the same claim: the same
    /// header, the same payload, on two keys holding the same claim.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_held_claim_is_overwritten_with_the_record_the_script_would_write() {
        let Some((store, mut c)) = store_and_connection().await else {
            return;
        };
        let (held, copy) = (Key::from_text("held"), Key::from_text("copy"));
        let request = claim_request(Duration::from_secs(30));
        assert!(matches!(
            store.claim(&held, &request).await.unwrap(),
            Claim::Acquired { .. }
        ));
        let token = request.token;
        let header = |split: usize| {
            let state = match split {
                CLAIMED_AT => State::InProgress {
                    token,
                    lease_until: Timestamp(30_000),
                },
                _ => State::Completed { result: Vec::new() },
            };
            let meta = Meta {
                renewed_at: (split == CLAIMED_AT).then_some(Timestamp(1_700_000_000_123)),
                completed_at: (split != CLAIMED_AT).then_some(Timestamp(1_700_000_000_456)),
                ..Meta::default()
            };
            let record = Record {
                fingerprint: Fingerprint::from_bytes([0; 32]),
                created_at: Timestamp(0),
                expires_at: Timestamp(90_000),
                state,
                meta,
            };
            record.encode()
        };
        for (split, payload, until) in [
            (
                CLAIMED_AT,
                &b""[..],
                Some(Timestamp::now().after(Duration::from_secs(30))),
            ),
            (COMPLETED_AT + 8, &br#"{"id":"msg_1"}"#[..], None),
        ] {
            // The same claim under `copy`, written by hand: this store holds no claim there.
            let stored = raw(&mut c, &store, &held).await.unwrap();
            assert_eq!(store.inner.held.len(), 1, "the claim is held");
            let _: () = redis::cmd("SET")
                .arg(store.redis_key(&copy))
                .arg(&stored)
                .arg("PX")
                .arg(60_000)
                .query_async(&mut c)
                .await
                .unwrap();
            let header = header(split);
            let fast = store
                .owner_write(&held, token, &header, split, payload, 90_000, until)
                .await
                .unwrap();
            let split_text = split.to_string();
            let scripted: i64 = store
                .script(
                    &COMPLETE,
                    &copy,
                    &[
                        &token.0.to_be_bytes(),
                        &header,
                        payload,
                        b"90000",
                        split_text.as_bytes(),
                    ],
                )
                .await
                .unwrap();
            assert_eq!((fast, scripted), (Fenced::Applied, 1));
            let (written, expected) = (
                raw(&mut c, &store, &held).await,
                raw(&mut c, &store, &copy).await,
            );
            assert_eq!(written, expected, "split at {split}");
        }
        let record = store.get(&held).await.unwrap().unwrap();
        assert_eq!(record.fingerprint, request.fingerprint);
        assert_eq!(
            record.state,
            State::Completed {
                result: br#"{"id":"msg_1"}"#.to_vec()
            }
        );
        assert_eq!(record.meta.renewed_at, Some(Timestamp(1_700_000_000_123)));
        assert_eq!(
            record.meta.origin.as_ref().map(|o| &*o.tool),
            Some("send_email")
        );
        assert_eq!(store.inner.held.len(), 0, "a completed claim is not held");
    }

    /// Completes the claim `token` holds under `key` with `result`, which must apply,
    /// and returns the record then stored.
    async fn completed(store: &RedisStore, key: &Key, token: Token, result: &[u8]) -> Record {
        let ttl = Duration::from_secs(60);
        let done = store
            .complete(key, token, Outcome::Completed(result), ttl)
            .await;
        assert_eq!(done.unwrap(), Fenced::Applied);
        let record = store.get(key).await.unwrap().unwrap();
        assert_eq!(
            record.state,
            State::Completed {
                result: result.to_vec()
            }
        );
        record
    }

    /// The held bytes are a shortcut, never the fence: a claim that changed behind this
    /// process's back (a renewal whose answer was lost, here made by another store) is
    /// still completed by its owner, through the script, with that renewal kept; a claim
    /// taken over is not completed by its old owner, whose completion leaves the new
    /// owner's claim held; a claim given up is no longer held.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_claim_that_changed_behind_its_back_is_decided_by_the_script() {
        let Some((store, _c)) = store_and_connection().await else {
            return;
        };
        let other = RedisStore {
            inner: Arc::new(Inner {
                connection: store.inner.connection.clone(),
                prefix: store.inner.prefix.clone(),
                timeout: store.inner.timeout,
                held: Held::default(),
                streak: net::Streak::default(),
            }),
        };
        let key = Key::from_text("changed");
        let request = claim_request(Duration::from_secs(30));
        store.claim(&key, &request).await.unwrap();
        let (lease, ttl) = (Duration::from_secs(30), Duration::from_secs(60));
        assert_eq!(
            other.renew(&key, request.token, lease, ttl).await.unwrap(),
            Fenced::Applied
        );
        let renewed_at = store.get(&key).await.unwrap().unwrap().meta.renewed_at;
        assert!(renewed_at.is_some());
        let record = completed(&store, &key, request.token, b"1").await;
        assert_eq!(
            record.meta.renewed_at, renewed_at,
            "the other store's renewal is kept"
        );
        assert_eq!(store.inner.held.len(), 0);

        // Taken over, in this same process: the old owner is fenced off.
        let key = Key::from_text("taken");
        let first = claim_request(Duration::from_millis(20));
        store.claim(&key, &first).await.unwrap();
        tokio::time::sleep(Duration::from_millis(60)).await;
        let second = claim_request(Duration::from_secs(30));
        let took = store.claim(&key, &second).await.unwrap();
        assert!(
            matches!(took, Claim::Acquired { took_over: true }),
            "{took:?}"
        );
        let late = store
            .complete(&key, first.token, Outcome::Completed(b"old"), ttl)
            .await;
        assert_eq!(late.unwrap(), Fenced::LostLease);
        assert_eq!(
            store.renew(&key, first.token, lease, ttl).await.unwrap(),
            Fenced::LostLease
        );
        assert_eq!(
            store.release(&key, first.token).await.unwrap(),
            Fenced::LostLease
        );
        assert_eq!(
            store.inner.held.len(),
            1,
            "the new owner's claim is still held"
        );
        let record = completed(&store, &key, second.token, b"new").await;
        assert_eq!((record.meta.attempts, record.meta.takeovers), (2, 1));

        // Given up (a zero lease): no longer held, and found abandoned.
        let key = Key::from_text("given up");
        let request = claim_request(Duration::from_secs(30));
        store.claim(&key, &request).await.unwrap();
        assert_eq!(
            store
                .renew(&key, request.token, Duration::ZERO, ttl)
                .await
                .unwrap(),
            Fenced::Applied
        );
        assert_eq!(store.inner.held.len(), 0);
        let _ = store.delete(&key).await;
    }

    /// A store under a prefix of its own whose claims send `fixed` first (or as the
    /// streak says, if `None`).
    async fn streak_store(fixed: Option<First>) -> Option<RedisStore> {
        let (mut store, _) = store_and_connection().await?;
        Arc::get_mut(&mut store.inner)
            .expect("a store not yet shared")
            .streak
            .fixed = fixed;
        Some(store)
    }

    /// Every claim of the conformance suite reads first: what it decides is what the
    /// claim's `SET NX GET` decides.
    #[cfg(feature = "testing")]
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn claims_that_read_first_conform() {
        let Some(store) = streak_store(Some(First::Read)).await else {
            return;
        };
        crate::testing::run_all(Arc::new(store)).await;
    }

    /// A streak of hits makes claims read first, answered as before; a new key ends it
    /// and is claimed once (see `net::a_streak_of_hits_reads_first`).
    #[tokio::test]
    async fn a_streak_of_hits_makes_claims_read_first_and_a_miss_ends_it() {
        let Some(store) = streak_store(None).await else {
            return;
        };
        let key = |name: &str| Key::from_text(format!("tool.{name}"));
        net::a_streak_of_hits_reads_first(&store, &store.inner.streak, key).await;
        for name in ["done", "busy", "fresh"] {
            store.delete(&key(name)).await.unwrap();
        }
    }
}
