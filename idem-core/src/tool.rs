//! The dynamic API: a tool made idempotent at run time, without the attribute.
//!
//! [`Tool`] is the same protocol as `#[idempotent]`, with the same keys and records:
//! a tool registered at run time, a tool whose input is a `serde_json::Value` (an MCP
//! server that forwards calls, a plugin host, a binding from another language), or one
//! whose name is only known from a request.
//!
//! ```
//! # async fn demo() -> Result<(), idem_core::Error> {
//! use std::time::Duration;
//! use idem_core::{MemoryStore, Run, Tool};
//! use serde_json::{json, Value};
//!
//! let send_email = Tool::new("send_email").ttl(Duration::from_secs(24 * 60 * 60));
//! let run = Run::new("run-1").with_store(MemoryStore::new());
//! let input = json!({ "to": "ada@example.com", "subject": "hi" });
//!
//! let sent: Value = send_email
//!     .call(&run, &input, |key| async move {
//!         // the side effect, once per (run, tool, input); `key` goes downstream
//!         Ok::<_, idem_core::Error>(json!({ "message_id": format!("msg-for-{key}") }))
//!     })
//!     .await?;
//! // A retry of the same call replays the first value; the body does not run.
//! let again: Value = send_email
//!     .call(&run, &input, |_| async { unreachable!("replayed") })
//!     .await?;
//! assert_eq!(sent, again);
//! # Ok(()) }
//! ```
//!
//! # The same keys as the attribute
//!
//! A call of `Tool::new("send_email")` with input `x` has the key of an
//! `#[idempotent(name = "send_email")]` function whose one argument is `x`: the input
//! is hashed as a list of one argument, with the run's id, tenant and call id, and the
//! tool's name (see `docs/dynamic.md`). [`Tool::key`] is the attribute's
//! `key = [input.field, ..]`, and [`Tool::scope`] its `scope = [..]`. So a record
//! written through one replays through the other, and a process can move a tool from
//! one to the other without losing its records.
//!
//! # Results, errors and options
//!
//! A body returns `Result<T, E>`: `T` is stored and replayed, and is a
//! `serde_json::Value` for a tool that speaks JSON, or any type that serializes. An
//! `Err` releases the key by default (a retry runs again); [`Tool::cache_errors`]
//! stores it too, for an `E` that serializes. When idem cannot run the call safely
//! (the store is down, another input used the key, ...), the call returns
//! `E::from(idem::Error)`, as the attribute does.
//!
//! Every option of the attribute is a method here: [`ttl`](Tool::ttl),
//! [`lease`](Tool::lease), [`max_run`](Tool::max_run), [`wait`](Tool::wait),
//! [`fail_fast`](Tool::fail_fast), [`at_most_once`](Tool::at_most_once),
//! [`reconcile`](Tool::reconcile) (with [`reconcile_timeout`](Tool::reconcile_timeout)),
//! [`cache_errors`](Tool::cache_errors), [`key`](Tool::key), [`scope`](Tool::scope) and
//! [`on_cancel`](Tool::on_cancel). The tenant is the run's ([`Run::with_tenant`]).

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use crate::error::Error;
use crate::key::KeyInput;
use crate::key_text::Key;
use crate::options::{OnCancel, Options};
use crate::protocol::{
    execute, execute_finishing, from_idem_error, Call, Checked, Compare, Refusal,
};
pub use crate::protocol::{CacheErrors, ErrorPolicy, ReleaseErrors};
use crate::read_back::Equality;
use crate::reconcile::{reconcile, Reconciled};
use crate::run::Run;
use crate::telemetry;

/// A reconcile hook, as [`Tool::reconcile`] keeps it.
type Hook = Arc<
    dyn Fn(Key, Value) -> Pin<Box<dyn Future<Output = Reconciled<Value>> + Send>> + Send + Sync,
>;

/// A tool made idempotent at run time: its name and options, and [`Tool::call`] to
/// run it (see the [module docs](self)).
///
/// Cheap to clone (its parts are shared); build it once, call it many times. `Errors`
/// is what happens to a body's `Err`: [`ReleaseErrors`] (the default) or, after
/// [`Tool::cache_errors`], [`CacheErrors`].
pub struct Tool<Errors = ReleaseErrors> {
    name: Arc<str>,
    options: Options,
    on_cancel: OnCancel,
    /// JSON pointers into the input, for a key made of some of its fields.
    key: Option<Arc<[String]>>,
    scope: Option<Arc<Value>>,
    reconcile: Option<Hook>,
    errors: PhantomData<fn() -> Errors>,
}

impl Tool {
    /// A tool named `name`, with the default options (see [`Options`]). The name is
    /// part of every key: two tools never share one.
    pub fn new(name: impl Into<Arc<str>>) -> Self {
        Tool {
            name: name.into(),
            options: Options::new(),
            on_cancel: OnCancel::Finish,
            key: None,
            scope: None,
            reconcile: None,
            errors: PhantomData,
        }
    }

    /// Stores a body's `Err` and replays it to retries until the TTL ends, as the
    /// attribute's `cache_errors` (for errors retrying cannot fix, such as a declined
    /// card). The error type must serialize: `call` then requires
    /// `E: Serialize + DeserializeOwned`.
    pub fn cache_errors(self) -> Tool<CacheErrors> {
        Tool {
            name: self.name,
            options: self.options,
            on_cancel: self.on_cancel,
            key: self.key,
            scope: self.scope,
            reconcile: self.reconcile,
            errors: PhantomData,
        }
    }
}

impl<Errors> Tool<Errors> {
    /// The tool's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The tool's options.
    pub fn options(&self) -> &Options {
        &self.options
    }

    /// Sets all the options at once.
    pub fn with_options(mut self, options: Options) -> Self {
        self.options = options;
        self
    }

    /// How long a result is kept and replayed, from completion (see [`Options::ttl`]).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.options = self.options.ttl(ttl);
        self
    }

    /// How long a claim holds without a heartbeat (see [`Options::lease`]).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.options = self.options.lease(lease);
        self
    }

    /// The longest a body may run (see [`Options::max_run`]).
    pub fn max_run(mut self, max_run: Duration) -> Self {
        self.options = self.options.max_run(max_run);
        self
    }

    /// Waits at most `max` for a concurrent duplicate's outcome (see [`Options::wait`]).
    pub fn wait(mut self, max: Duration) -> Self {
        self.options = self.options.wait(max);
        self
    }

    /// Fails at once with `InProgress` when another call holds the key.
    pub fn fail_fast(mut self) -> Self {
        self.options = self.options.fail_fast();
        self
    }

    /// Reports `OutcomeUnknown` instead of running again after a claim was given up
    /// (payments; see [`Delivery::AtMostOnce`](crate::Delivery::AtMostOnce)).
    pub fn at_most_once(mut self) -> Self {
        self.options = self.options.at_most_once();
        self
    }

    /// The longest the reconcile hook may take to answer (10 seconds by default).
    pub fn reconcile_timeout(mut self, timeout: Duration) -> Self {
        self.options = self.options.reconcile_timeout(timeout);
        self
    }

    /// What a call does when its caller stops waiting while the body runs: finish the
    /// body on its own and record its outcome ([`OnCancel::Finish`], the default), or
    /// drop it and settle the claim at once ([`OnCancel::Abort`]).
    pub fn on_cancel(mut self, on_cancel: OnCancel) -> Self {
        self.on_cancel = on_cancel;
        self
    }

    /// Makes the key of only these fields of the input, as the attribute's
    /// `key = [input.to, ..]`; the fingerprint still covers the whole input, so the
    /// same key with another input is [`Error::PayloadMismatch`].
    ///
    /// Each entry is a field of the input's JSON object (`"to"`), or a JSON pointer
    /// into it (`"/address/city"`). A field the input does not have counts as `null`.
    pub fn key<S: AsRef<str>>(mut self, fields: impl IntoIterator<Item = S>) -> Self {
        let pointers: Vec<String> = fields
            .into_iter()
            .map(|field| {
                let field = field.as_ref();
                if field.starts_with('/') {
                    field.to_owned()
                } else {
                    format!("/{}", field.replace('~', "~0").replace('/', "~1"))
                }
            })
            .collect();
        self.key = Some(pointers.into());
        self
    }

    /// Adds `scope` to every call's key and fingerprint, after the input, as the
    /// attribute's `scope = [self.account]`: what tells two instances of the tool apart
    /// (an account, a workspace) when the run does not.
    pub fn scope(mut self, scope: Value) -> Self {
        self.scope = Some(Arc::new(scope));
        self
    }

    /// Before a call, settles an abandoned claim of it (its process stopped, or its
    /// caller dropped it, between claiming and recording) by asking downstream what
    /// happened: `hook(key, input)` answers [`Reconciled`] (see its docs, and
    /// `docs/operations.md`). A hook only concerns at-most-once calls, so this makes the
    /// tool [at-most-once](Tool::at_most_once).
    pub fn reconcile<H, Fut>(mut self, hook: H) -> Self
    where
        H: Fn(Key, Value) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Reconciled<Value>> + Send + 'static,
    {
        self.options = self.options.at_most_once();
        self.reconcile = Some(Arc::new(move |key, input| Box::pin(hook(key, input))));
        self
    }

    /// The key a call of this tool with `input` in `run` has.
    ///
    /// Only the key is derived: no call is made, so none is traced or counted (an
    /// input that does not serialize is an `Err` here, not a refused call).
    pub fn key_of<I: Serialize + ?Sized>(&self, run: &Run, input: &I) -> Result<Key, Error> {
        self.with_args(run, input, Refusal::Returned, |args, key| {
            Call::key_of_args(run, &self.name, args, key)
        })
    }

    /// Calls the tool: runs `body` at most once per key (the run, this tool and
    /// `input`) within the TTL, and returns its result, run now or replayed. `body`
    /// gets the call's key, to forward downstream (also
    /// [`current_key`](crate::current_key) inside it).
    ///
    /// The input is anything that serializes: a `serde_json::Value`, or a tool's own
    /// type. The body must own what it uses (`Send + 'static`), so that a call its
    /// caller stops waiting for can finish on its own (see [`Tool::on_cancel`]). When
    /// idem cannot run the call safely, it returns `E::from(error)`.
    ///
    /// Its result is checked before it is stored: its JSON must read back as the same
    /// value (see [`Error::Unreplayable`]), compared by JSON.
    pub async fn call<I, T, E, B, Fut>(&self, run: &Run, input: &I, body: B) -> Result<T, E>
    where
        I: Serialize + ?Sized,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: From<Error> + Send + 'static,
        Errors: ErrorPolicy<E> + 'static,
        B: FnOnce(Key) -> Fut + Send,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
    {
        let call = self.prepare(run, input);
        if let (Some(hook), Ok(_)) = (&self.reconcile, &call) {
            // The hook gets the input as JSON; one that serialized for its key does.
            let input = serde_json::to_value(input).unwrap_or(Value::Null);
            let tool = &*self.name;
            reconcile(&call, Equality::<Value>::JSON, |key| {
                let answer = hook(key, input.clone());
                async move {
                    match answer.await {
                        // Stored, it would answer every retry with an error for the TTL.
                        Reconciled::Happened(value) if T::deserialize(&value).is_err() => {
                            tracing::warn!(%tool, "idem: the reconcile hook's value does not read as the tool's result type; the outcome stays unknown");
                            Reconciled::Unknown
                        }
                        answer => answer,
                    }
                }
            })
            .await;
        }
        let call = match call {
            Ok(call) => call,
            Err(error) => return Err(E::from(error)),
        };
        let key = call.key().clone();
        let checked = Checked::new(Ok(call), Compare::JSON);
        let executed = match self.on_cancel {
            OnCancel::Finish => {
                execute_finishing::<Result<T, E>, Errors, _>(checked, move || body(key)).await
            }
            OnCancel::Abort => {
                let body = async move { body(key).await };
                execute::<Result<T, E>, Errors, _>(checked, body).await
            }
        };
        executed.unwrap_or_else(from_idem_error)
    }

    /// The call of this tool with `input` in `run`: its key and fingerprint, as the
    /// attribute makes them of a function with one argument.
    fn prepare<I: Serialize + ?Sized>(&self, run: &Run, input: &I) -> Result<Call, Error> {
        self.with_args(run, input, Refusal::Reported, |args, key| {
            Call::from_args(Some(run), &self.name, self.options, args, key)
        })
    }

    /// `make` of this tool's arguments for `input`: the input (and the scope), and the
    /// fields that form the key, if not all of it. An input that does not serialize
    /// for its key's fields is refused as `refusal` says.
    fn with_args<I: Serialize + ?Sized, T>(
        &self,
        run: &Run,
        input: &I,
        refusal: Refusal,
        make: impl FnOnce(&[&dyn KeyInput], Option<&[&dyn KeyInput]>) -> Result<T, Error>,
    ) -> Result<T, Error> {
        let name = &*self.name;
        let scope = self.scope.as_deref();
        let arg: &dyn KeyInput = &input;
        let args: &[&dyn KeyInput] = match scope {
            Some(scope) => &[arg, scope],
            None => &[arg],
        };
        let Some(pointers) = &self.key else {
            return make(args, None);
        };
        let json = serde_json::to_value(input).map_err(|source| {
            let error = Error::Input {
                tool: name.to_owned(),
                source,
            };
            if refusal == Refusal::Reported {
                telemetry::rejected(name, run.call_id(), &error);
            }
            error
        })?;
        let fields = pointers
            .iter()
            .map(|pointer| json.pointer(pointer).unwrap_or(&Value::Null));
        let key: Vec<&dyn KeyInput> = fields
            .map(|field| field as &dyn KeyInput)
            .chain(scope.map(|scope| scope as &dyn KeyInput))
            .collect();
        make(args, Some(&key))
    }
}

impl<Errors> Clone for Tool<Errors> {
    fn clone(&self) -> Self {
        Tool {
            name: Arc::clone(&self.name),
            options: self.options,
            on_cancel: self.on_cancel,
            key: self.key.clone(),
            scope: self.scope.clone(),
            reconcile: self.reconcile.clone(),
            errors: PhantomData,
        }
    }
}

impl<Errors> fmt::Debug for Tool<Errors> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tool")
            .field("name", &self.name)
            .field("options", &self.options)
            .field("on_cancel", &self.on_cancel)
            .field("key", &self.key)
            .field("scope", &self.scope)
            .field("reconcile", &self.reconcile.is_some())
            .field("errors", &std::any::type_name::<Errors>())
            .finish()
    }
}
