//! The run context: who is calling (run id, tenant, call id) and which store keeps the
//! records; ambient for a future or a closure, or passed as an argument.

use std::borrow::Cow;
use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use crate::error::Error;
use crate::key_text::Key;
use crate::store::Store;

tokio::task_local! {
    static CURRENT_RUN: Run;
    pub(crate) static CURRENT_KEY: Key;
}

/// Whether a run id is blank: empty, or nothing but whitespace, control characters and
/// characters that show nothing (Unicode's default-ignorable code points, such as
/// zero-width spaces and joiners, the byte order mark, direction marks, variation
/// selectors and tag characters; fillers and the blank braille pattern). Such an id is
/// no run ([`Error::NoRun`]): every caller that sent one would share it.
pub(crate) fn is_blank(id: &str) -> bool {
    // A printable ASCII character (most ids start with one) settles it at once.
    id.chars()
        .all(|c| !c.is_ascii_graphic() && (c.is_whitespace() || c.is_control() || shows_nothing(c)))
}

/// Whether `c` shows nothing: a default-ignorable code point (Unicode's
/// `Default_Ignorable_Code_Point`, with the unassigned ones in its ranges), a filler, or
/// the blank braille pattern.
fn shows_nothing(c: char) -> bool {
    matches!(c, '\u{00ad}' | '\u{034f}' | '\u{061c}' | '\u{115f}' | '\u{1160}'
        | '\u{17b4}' | '\u{17b5}' | '\u{180b}'..='\u{180f}' | '\u{200b}'..='\u{200f}'
        | '\u{202a}'..='\u{202e}' | '\u{2060}'..='\u{206f}' | '\u{2800}' | '\u{3164}'
        | '\u{fe00}'..='\u{fe0f}' | '\u{feff}' | '\u{ffa0}' | '\u{fff0}'..='\u{fffb}'
        | '\u{13430}'..='\u{1343f}' | '\u{16fe4}' | '\u{1bca0}'..='\u{1bca3}'
        | '\u{1d173}'..='\u{1d17a}' | '\u{e0000}'..='\u{e0fff}')
}

/// One agent run: the "who" of every idempotency key, and the store that keeps them.
///
/// Cheap to clone (`Arc` inside), `Send + Sync`. Make one per agent run (a conversation,
/// a job, a workflow execution) with an id that stays the same across that run's
/// retries, restarts included: retries of the same tool call with the same input inside
/// one run are deduplicated; another run id runs again.
///
/// ```
/// # async fn demo() {
/// use idem_core::{MemoryStore, Run};
///
/// let run = Run::new("run-42").with_store(MemoryStore::new());
/// let answer = run.scope(async { /* call idempotent tools here */ 42 }).await;
/// # }
/// ```
#[derive(Clone)]
pub struct Run {
    inner: Arc<Inner>,
}

#[derive(Clone)]
struct Inner {
    id: Arc<str>,
    tenant: Option<Arc<str>>,
    call_id: Option<Arc<str>>,
    store: Option<Arc<dyn Store>>,
}

impl Run {
    /// A run with this id, on the default store (see [`default_store`]).
    pub fn new(id: impl Into<String>) -> Self {
        Run {
            inner: Arc::new(Inner {
                id: id.into().into(),
                tenant: None,
                call_id: None,
                store: None,
            }),
        }
    }

    /// This run on another store. Stores are cheap handles, taken by value.
    pub fn with_store(self, store: impl Store) -> Self {
        self.with_shared_store(Arc::new(store))
    }

    /// This run on a store already behind an `Arc`.
    pub fn with_shared_store(self, store: Arc<dyn Store>) -> Self {
        self.map(|i| i.store = Some(store))
    }

    /// This run for one tenant (or user). Keys of different tenants never meet, so a
    /// caller in one tenant never receives a result stored for another, even with the
    /// same run id, tool and input.
    pub fn with_tenant(self, tenant: impl Into<String>) -> Self {
        self.map(|i| i.tenant = Some(tenant.into().into()))
    }

    /// This run, for one intentional call: calls under different call ids are distinct
    /// even with the same tool and input, and retries under the same call id are
    /// deduplicated.
    ///
    /// Use it when the same tool with the same input may rightly run twice in one run
    /// ("send the reminder again"): pass the model's tool-call id, which stays the same
    /// when your agent framework retries a call and changes when the model asks again.
    pub fn with_call_id(self, call_id: impl Into<String>) -> Self {
        self.map(|i| i.call_id = Some(call_id.into().into()))
    }

    fn map(mut self, f: impl FnOnce(&mut Inner)) -> Self {
        f(Arc::make_mut(&mut self.inner));
        self
    }

    /// The run id.
    pub fn id(&self) -> &str {
        &self.inner.id
    }

    /// The tenant, if set.
    pub fn tenant(&self) -> Option<&str> {
        self.inner.tenant.as_deref()
    }

    /// The call id, if set.
    pub fn call_id(&self) -> Option<&str> {
        self.inner.call_id.as_deref()
    }

    /// Who calls `tool` in this run, as a record keeps it.
    pub(crate) fn origin(&self, tool: Arc<str>) -> crate::store::Origin {
        crate::store::Origin {
            tenant: self.inner.tenant.clone(),
            run_id: Arc::clone(&self.inner.id),
            call_id: self.inner.call_id.clone(),
            tool,
        }
    }

    /// The store of this run: the one given with [`Run::with_store`], else the default
    /// store (opened on first use; opening can fail, hence the `Result`).
    pub fn store(&self) -> Result<Arc<dyn Store>, Error> {
        self.store_ref().map(Cow::into_owned)
    }

    /// [`Run::store`] without touching the `Arc`'s count when the run has its own store:
    /// every thread's hits would contend on that one counter.
    pub(crate) fn store_ref(&self) -> Result<Cow<'_, Arc<dyn Store>>, Error> {
        match &self.inner.store {
            Some(store) => Ok(Cow::Borrowed(store)),
            None => default_store().map(Cow::Owned),
        }
    }

    /// The name of this run's store ([`Store::name`]), `none` if it has none (yet),
    /// without opening the default store or touching its `Arc`.
    pub(crate) fn store_name(&self) -> &'static str {
        match &self.inner.store {
            Some(store) => store.name(),
            None => crate::sync::read(&DEFAULT_STORE)
                .as_ref()
                .map_or("none", |store| store.name()),
        }
    }

    /// Runs `future` with this run as the ambient run: idempotent tools called inside
    /// it (at any depth, in this task) use it.
    pub fn scope<F: Future>(&self, future: F) -> impl Future<Output = F::Output> {
        CURRENT_RUN.scope(self.clone(), future)
    }

    /// Runs `f` with this run as the ambient run (for sync tools).
    pub fn sync_scope<R>(&self, f: impl FnOnce() -> R) -> R {
        CURRENT_RUN.sync_scope(self.clone(), f)
    }

    /// The ambient run, if the caller is inside [`Run::scope`] or [`Run::sync_scope`].
    pub fn current() -> Option<Run> {
        CURRENT_RUN.try_with(Run::clone).ok()
    }
}

impl std::fmt::Debug for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Run")
            .field("id", &self.inner.id)
            .field("tenant", &self.inner.tenant)
            .field("call_id", &self.inner.call_id)
            .field("default_store", &self.inner.store.is_none())
            .finish()
    }
}

/// `future` with `run` as its ambient run, if there is one: for a body that may go on
/// in a task of its own after its caller stopped waiting.
pub(crate) fn in_scope<F: Future>(run: Option<Run>, future: F) -> InScope<F> {
    match run {
        Some(run) => InScope::Run {
            future: CURRENT_RUN.scope(run, future),
        },
        None => InScope::Plain { future },
    }
}

pin_project_lite::pin_project! {
    /// The future of [`in_scope`]: a future of its own, not an `async fn`, which would
    /// hold `future` twice (its argument, and the future it awaits), and a miss's
    /// owner part is most of a kilobyte.
    #[project = InScopeProjection]
    pub(crate) enum InScope<F: Future> {
        Run { #[pin] future: tokio::task::futures::TaskLocalFuture<Run, F> },
        Plain { #[pin] future: F },
    }
}

impl<F: Future> Future for InScope<F> {
    type Output = F::Output;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        match self.project() {
            InScopeProjection::Run { future } => future.poll(cx),
            InScopeProjection::Plain { future } => future.poll(cx),
        }
    }
}

/// The idempotency key of the call whose body is running, or `None` outside one.
///
/// Forward it downstream, so the other side can deduplicate too (Stripe's
/// `Idempotency-Key` header, an email provider's dedup id). That closes the one window
/// no client-side record can: a crash after the side effect and before the result is
/// stored.
pub fn current_key() -> Option<Key> {
    CURRENT_KEY.try_with(Key::clone).ok()
}

/// The environment variable naming the default store's directory.
pub const DIR_ENV: &str = "IDEM_DIR";

static DEFAULT_STORE: RwLock<Option<Arc<dyn Store>>> = RwLock::new(None);

/// The directory of the default store: `$IDEM_DIR`, else `.idem` in the working
/// directory (so two projects never share records by accident).
pub fn default_store_dir() -> PathBuf {
    std::env::var_os(DIR_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(".idem"))
}

/// The store used by runs made without [`Run::with_store`]: the one set with
/// [`set_default_store`], else a `SledStore` in [`default_store_dir`], opened on first
/// use. An open that fails is an error now and is tried again next time. Built without
/// the `sled` feature, there is no such fallback: without a store set, a call is
/// [`Error::NoStore`], and nothing runs.
pub fn default_store() -> Result<Arc<dyn Store>, Error> {
    if let Some(store) = crate::sync::read(&DEFAULT_STORE).as_ref() {
        return Ok(store.clone());
    }
    #[cfg_attr(not(feature = "sled"), allow(unused_mut))]
    let mut slot = crate::sync::write(&DEFAULT_STORE);
    if let Some(store) = slot.as_ref() {
        return Ok(store.clone());
    }
    #[cfg(feature = "sled")]
    {
        let store: Arc<dyn Store> = Arc::new(crate::SledStore::open(default_store_dir())?);
        *slot = Some(store.clone());
        Ok(store)
    }
    #[cfg(not(feature = "sled"))]
    Err(Error::NoStore)
}

/// Replaces the process-wide default store (for runs made without
/// [`Run::with_store`]).
pub fn set_default_store(store: impl Store) {
    *crate::sync::write(&DEFAULT_STORE) = Some(Arc::new(store));
}
