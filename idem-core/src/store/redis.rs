//! `RedisStore`: records in Redis, shared by a fleet of workers (feature `redis`).
//!
//! Each record is a hash under `<prefix><key>` (prefix `idem:` by default) with the
//! fields `fp` (input fingerprint), `state` (0 in progress, 1 completed, 2 failed),
//! `token` (fencing token), `lease` (in progress: lease end; empty once completed or
//! failed), `payload` (result or error, JSON), `created` and `exp` (milliseconds since
//! the Unix epoch).
//!
//! Claim, complete, release, get and delete are each one Lua script, so each is one
//! atomic step and one round trip. Every time comes from the **Redis server clock**
//! (`TIME`), so workers with skewed clocks agree on leases and expiry. Redis removes a
//! record itself at its expiry (`PEXPIREAT`); the scripts still treat a record past
//! `exp` as absent, except that a claim that finds a completed record replays it
//! without reading the clock (Redis would not have returned it past its expiry).
//! [`Store::purge_expired`] has nothing to do and returns 0.
//!
//! The connection is a `redis::aio::ConnectionManager`: it reconnects after a server
//! restart. Every operation is bounded by the store's timeout (5 seconds by default):
//! an unreachable or stopped server is an [`Error::Store`] within that time, and the
//! operation is not run.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use async_trait::async_trait;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::Script;

use crate::record::{millis, Record, State, Timestamp, Token};
use crate::store::{Claim, ClaimRequest, Fenced, Outcome, Store};
use crate::{Error, Fingerprint, Key};

const STORE: &str = "redis";

/// The server time in milliseconds, as every script starts.
const NOW: &str = "local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function int(x) return string.format('%.0f', x) end
";

/// KEYS[1] key; ARGV fingerprint, token, lease ms, ttl ms, take over (0/1), retry
/// failed (0/1). Returns {code, payload, number}: 0 acquired (number: 1 if taken
/// over), 1 completed, 2 failed, 3 busy (number: lease end), 4 abandoned, 5 mismatch.
/// The same rule as `decide_claim`. A hit returns before reading the clock: Redis
/// removes a record at its `exp` (`PEXPIREAT`), so a completed record it still returns
/// is live (to within the millisecond Redis rounds expiry to), and the hit costs the
/// server one `HMGET` and no `TIME`.
static CLAIM: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "local r = redis.call('HMGET', KEYS[1], 'fp', 'state', 'lease', 'payload', 'exp')
if r[1] == ARGV[1] and r[2] == '1' then return {{1, r[4] or '', 0}} end
{NOW}
local function acquire(took_over)
  local exp = now + tonumber(ARGV[4])
  -- A record was there: clear it, or its payload would outlive the HSET.
  if r[1] or r[2] or r[3] or r[4] or r[5] then redis.call('DEL', KEYS[1]) end
  redis.call('HSET', KEYS[1], 'fp', ARGV[1], 'state', '0', 'token', ARGV[2],
    'lease', int(now + tonumber(ARGV[3])), 'created', int(now), 'exp', int(exp))
  redis.call('PEXPIREAT', KEYS[1], int(exp))
  return {{0, '', took_over}}
end
if not r[1] or not r[5] or tonumber(r[5]) <= now then return acquire(0) end
if r[1] ~= ARGV[1] then return {{5, '', 0}} end
if r[2] == '1' then return {{1, r[4] or '', 0}} end
if r[2] == '2' then
  if ARGV[6] == '1' then return acquire(0) end
  return {{2, r[4] or '', 0}}
end
if tonumber(r[3]) > now then return {{3, '', tonumber(r[3])}} end
if ARGV[5] == '1' then return acquire(1) end
return {{4, '', 0}}"
    ))
});

/// KEYS[1] key; ARGV token, state (1/2), payload, ttl ms. Returns 1 if applied.
static COMPLETE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{NOW}
local r = redis.call('HMGET', KEYS[1], 'state', 'token', 'exp')
if r[1] ~= '0' or r[2] ~= ARGV[1] or not r[3] or tonumber(r[3]) <= now then return 0 end
local exp = now + tonumber(ARGV[4])
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'lease', '', 'payload', ARGV[3], 'created', int(now), 'exp', int(exp))
redis.call('PEXPIREAT', KEYS[1], int(exp))
return 1"
    ))
});

/// KEYS[1] key; ARGV token. Returns 1 if applied.
static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{NOW}
local r = redis.call('HMGET', KEYS[1], 'state', 'token', 'exp')
if r[1] ~= '0' or r[2] ~= ARGV[1] or not r[3] or tonumber(r[3]) <= now then return 0 end
redis.call('DEL', KEYS[1])
return 1"
    ))
});

/// KEYS[1] key. Returns the live record's fields (missing ones as ''), or an empty
/// array.
static GET: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{NOW}
local r = redis.call('HMGET', KEYS[1], 'fp', 'state', 'token', 'lease', 'payload', 'created', 'exp')
if not r[1] or not r[7] or tonumber(r[7]) <= now then return {{}} end
for i = 1, 7 do if not r[i] then r[i] = '' end end
return r"
    ))
});

/// KEYS[1] key. Deletes it; returns 1 if it was live.
static DELETE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(&format!(
        "{NOW}
local exp = redis.call('HGET', KEYS[1], 'exp')
local existed = redis.call('DEL', KEYS[1])
if existed == 1 and (not exp or tonumber(exp) == nil or tonumber(exp) > now) then return 1 end
return 0"
    ))
});

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
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    connection: ConnectionManager,
    prefix: String,
    timeout: Duration,
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

    /// The bound on every operation, connecting included (5 seconds by default).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Builds the store without connecting: the connection opens on first use. Must be
    /// called inside a tokio runtime (the connection manager lives on it); elsewhere it
    /// is an [`Error::Store`].
    pub fn build(self) -> Result<RedisStore, Error> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(redis_error(
                "a RedisStore must be built inside a tokio runtime, which drives its connection",
            ));
        }
        let client = redis::Client::open(self.url.as_str()).map_err(redis_error)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout))
            .set_number_of_retries(2);
        let connection =
            ConnectionManager::new_lazy_with_config(client, config).map_err(redis_error)?;
        Ok(RedisStore {
            inner: Arc::new(Inner {
                connection,
                prefix: self.prefix,
                timeout: self.timeout,
            }),
        })
    }

    /// Builds the store and checks the server answers (`PING`).
    pub async fn connect(self) -> Result<RedisStore, Error> {
        let store = self.build()?;
        store
            .bounded(async {
                let mut c = store.inner.connection.clone();
                redis::cmd("PING")
                    .query_async::<String>(&mut c)
                    .await
                    .map_err(redis_error)
            })
            .await?;
        Ok(store)
    }
}

fn redis_error(e: impl std::fmt::Display) -> Error {
    Error::store(STORE, e.to_string())
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

    fn redis_key(&self, key: &Key) -> String {
        format!("{}{}", self.inner.prefix, key)
    }

    async fn bounded<T>(
        &self,
        f: impl std::future::Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        crate::store::bounded(STORE, self.inner.timeout, f).await
    }

    /// Runs a script on `key` with `args`.
    async fn script<T: redis::FromRedisValue>(
        &self,
        script: &Script,
        key: &Key,
        args: &[&[u8]],
    ) -> Result<T, Error> {
        let mut invocation = script.key(self.redis_key(key));
        for arg in args {
            invocation.arg(*arg);
        }
        let mut connection = self.inner.connection.clone();
        self.bounded(async {
            invocation
                .invoke_async(&mut connection)
                .await
                .map_err(redis_error)
        })
        .await
    }
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.inner.prefix)
            .finish()
    }
}

fn flag(b: bool) -> &'static [u8] {
    if b {
        b"1"
    } else {
        b"0"
    }
}

/// Parses a decimal field of a stored hash.
fn number(key: &Key, field: &str, bytes: &[u8]) -> Result<Timestamp, Error> {
    std::str::from_utf8(bytes)
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .map(Timestamp)
        .ok_or_else(|| Error::CorruptRecord {
            key: key.to_string(),
            reason: format!("field `{field}` is not a number"),
        })
}

#[async_trait]
impl Store for RedisStore {
    async fn claim(&self, key: &Key, request: &ClaimRequest) -> Result<Claim, Error> {
        let token = request.token.0.to_be_bytes();
        let lease = millis(request.lease).to_string();
        let ttl = millis(request.ttl).to_string();
        let (code, payload, number): (i64, Vec<u8>, i64) = self
            .script(
                &CLAIM,
                key,
                &[
                    request.fingerprint.as_bytes(),
                    &token,
                    lease.as_bytes(),
                    ttl.as_bytes(),
                    flag(request.take_over_expired),
                    flag(request.retry_failed),
                ],
            )
            .await?;
        Ok(match code {
            0 => Claim::Acquired {
                took_over: number == 1,
            },
            1 => Claim::Completed(payload),
            2 => Claim::Failed(payload),
            3 => Claim::Busy {
                lease_until: Timestamp(number.max(0) as u64),
            },
            4 => Claim::Abandoned,
            5 => Claim::Mismatch,
            other => return Err(redis_error(format!("claim script returned code {other}"))),
        })
    }

    async fn complete(
        &self,
        key: &Key,
        token: Token,
        outcome: Outcome<'_>,
        ttl: Duration,
    ) -> Result<Fenced, Error> {
        let (state, payload): (&[u8], &[u8]) = match outcome {
            Outcome::Completed(b) => (b"1", b),
            Outcome::Failed(b) => (b"2", b),
        };
        let ttl = millis(ttl).to_string();
        let token = token.0.to_be_bytes();
        let applied: i64 = self
            .script(&COMPLETE, key, &[&token, state, payload, ttl.as_bytes()])
            .await?;
        Ok(if applied == 1 {
            Fenced::Applied
        } else {
            Fenced::LostLease
        })
    }

    async fn release(&self, key: &Key, token: Token) -> Result<Fenced, Error> {
        let token = token.0.to_be_bytes();
        let applied: i64 = self.script(&RELEASE, key, &[&token]).await?;
        Ok(if applied == 1 {
            Fenced::Applied
        } else {
            Fenced::LostLease
        })
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>, Error> {
        let fields: Vec<Vec<u8>> = self.script(&GET, key, &[]).await?;
        let [fp, state, token, lease, payload, created, exp] =
            match <[Vec<u8>; 7]>::try_from(fields) {
                Ok(fields) => fields,
                Err(fields) if fields.is_empty() => return Ok(None),
                Err(_) => return Err(redis_error("get script returned a malformed record")),
            };
        let corrupt = |reason: &str| Error::CorruptRecord {
            key: key.to_string(),
            reason: reason.to_owned(),
        };
        let fingerprint: [u8; 32] = fp
            .try_into()
            .map_err(|_| corrupt("fingerprint is not 32 bytes"))?;
        let state = match state.as_slice() {
            b"0" => State::InProgress {
                token: Token(u128::from_be_bytes(
                    token
                        .try_into()
                        .map_err(|_| corrupt("token is not 16 bytes"))?,
                )),
                lease_until: number(key, "lease", &lease)?,
            },
            b"1" => State::Completed { result: payload },
            b"2" => State::Failed { error: payload },
            _ => return Err(corrupt("unknown state")),
        };
        Ok(Some(Record {
            fingerprint: Fingerprint::from_bytes(fingerprint),
            created_at: number(key, "created", &created)?,
            expires_at: number(key, "exp", &exp)?,
            state,
        }))
    }

    async fn delete(&self, key: &Key) -> Result<bool, Error> {
        let live: i64 = self.script(&DELETE, key, &[]).await?;
        Ok(live == 1)
    }

    /// Redis expires records itself (`PEXPIREAT`): nothing to purge.
    async fn purge_expired(&self) -> Result<u64, Error> {
        Ok(0)
    }
}
