//! The `#[idempotent]` attribute of [idem](https://docs.rs/idem). Depend on `idem` and
//! use `idem::idempotent`; this crate only parses, checks and emits code, and all
//! decisions are made at run time by `idem-core`.
//!
//! - `attr.rs` parses and checks the options (a bad one is a compile error at its token),
//! - `duration.rs` parses duration literals (`"24h"`, `"1h30m"`),
//! - `cancel.rs` decides what a call dropped by its caller does (finish or settle),
//! - `expand.rs` emits the wrapped function.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod attr;
mod cancel;
mod duration;
mod expand;

use proc_macro::TokenStream;

/// Makes a tool function safe to retry: a call whose run, tool and input already
/// completed returns the stored result without running the body again.
///
/// # Options
///
/// | option | meaning | default |
/// |---|---|---|
/// | `ttl = "24h"` | how long a result is kept and replayed, from completion (`ms`, `s`, `m`, `h`, `d`, combinable: `"1h30m"`) | 24 hours |
/// | `lease = "15s"` | how long a claim holds without a heartbeat: how soon a dead process's claim is taken over | 15 seconds, renewed every 5 |
/// | `max_run = "10m"` | the longest a body may run: its claim is renewed until then; an async body still running is stopped (`Error::MaxRunExceeded`) | 10 minutes |
/// | `on_cancel = "finish"` | a call its caller stops waiting for (a timeout, `select!`): `"finish"` runs the body on to its end in a task of its own and records its outcome; `"abort"` drops it and settles its claim at once | `"finish"` when the body uses nothing borrowed from its caller, else `"abort"` |
/// | `wait = "10s"` | how long a concurrent duplicate waits for the first call's result | `max_run` + `lease` |
/// | `fail_fast` | a concurrent duplicate gets `Error::InProgress` at once | off |
/// | `at_most_once` | a claim given up without an outcome (a crash, a dropped call, a panic) is `Error::OutcomeUnknown` instead of running again (payments) | at-least-once |
/// | `reconcile = check` | with `at_most_once`, async tools: before a call answers `OutcomeUnknown`, `check(&key, &arg, ..)` (every argument but the run, by reference) asks the downstream system what happened, and returns `idem::Reconciled`: `Happened(value)` (recorded, and returned to this call and every retry, if it reads back as itself, as a body's result must; otherwise it counts as `Unknown`, with a warning), `NeverHappened` (the call runs now, under a fresh claim) or `Unknown` (`OutcomeUnknown`). Costs one read of the key per call | no hook |
/// | `reconcile_timeout = "10s"` | with `reconcile`: the longest the hook may take to answer; past it, it is dropped and its answer counts as `Unknown`, with a warning naming the tool and the key | 10 seconds |
/// | `cache_errors` | store `Err` values and replay them too (needs `E: Serialize + Deserialize`) | errors release the key |
/// | `name = "send_email"` | the tool name in the key: a string literal, or an expression giving `&str` (`name = Self::NAME`) | the function's path: module, and for a method the type and the trait, with this call's generic arguments (`key::default_tool_name`) |
/// | `key = [input.to]` | the arguments or fields that form the key; the whole input is still fingerprinted, so the same key with another input is `Error::PayloadMismatch` | all arguments |
/// | `scope = [self.account]` | methods: fields of `self` that join the key (and the fingerprint), so two receivers with different configuration are two callers | the receiver is not in the key |
/// | `skip = [client]` | arguments that are context, not input (clients, connections) | none |
/// | `run = ctx.run()` | where the run comes from: an expression giving a `Run`, `&Run`, `Arc<Run>` or an `Option` of one (`None`: the ambient run) | a `Run` argument, else the ambient run |
/// | `map_error = path` | a function `idem::Error -> E`, when `E` has no `From<idem::Error>` | `From::from` |
/// | `crate = "my::idem"` | where the `idem` crate is, if you re-export it | `::idem` |
///
/// **Two tools never share a key by default**: the default name is the function's path
/// as `std::any::type_name` writes it, so `notify` in two modules, `send` of two
/// traits on one type, and a generic tool at two types are separate tools. **Keep
/// `name` stable where keys must live long**: moving or renaming the function changes
/// its keys (calls made before run again), and the Rust project does not promise to
/// spell `type_name` alike in every compiler version; set `name` on tools whose keys
/// must outlive refactors or toolchain upgrades.
///
/// **Methods: the receiver is not part of the key unless you say so.** A tool object
/// that carries its own configuration (two mail accounts, two tenants' clients) names
/// the fields that tell receivers apart: `#[idempotent(scope = [self.account])]`.
/// Without it, `alice.pay(500)` then `bob.pay(500)` in one run is one call.
///
/// **Sets.** A `HashSet` argument is keyed as a set (sorted), since its own order is the
/// hash's and differs in every process; a `HashSet` elsewhere in an argument's type is
/// a compile error; inside an input struct, use `#[serde(serialize_with =
/// "idem::key::sorted")]` (`key::sorted`) or a `BTreeSet`.
///
/// Durations over 100 years (`Options::LONGEST`) are compile errors at the literal.
///
/// # What the attribute accepts
///
/// Async and sync functions, methods (`&self`, `&mut self`; the receiver joins the key
/// only through `scope`), generic functions, `impl Trait` and reference arguments (serialized, not
/// moved), destructured arguments (`Parameters(input): Parameters<T>`: the names they bind
/// are the input). An argument whose type is written `Run`, `&Run` or `idem::Run` is the
/// call's run (not part of the input; another crate's `Run` written by its path, like
/// `workflow::Run`, is an input);
/// otherwise the ambient run of `Run::scope` / `Run::sync_scope` is used, and with
/// neither the call is `Error::NoRun` (as it is for a run whose id is blank: empty, or
/// only whitespace and invisible characters). The function must return `Result<T, E>` with
/// `T: Serialize + DeserializeOwned` and `E: From<idem::Error>` (or `map_error`).
///
/// **A result is stored only if its retry reads it back as the same value**: its JSON
/// is read back into `T` and written again, and where `T` implements `PartialEq` (the
/// attribute finds out where the return type is written, a `Result` or an alias of
/// one), the value read back must also equal it. A result that fails is
/// `Error::Unreplayable` at the call that ran, and is not stored. Without `PartialEq`
/// a field its JSON never holds (`#[serde(skip_serializing, default)]`) comes back to
/// every retry as its default: derive `PartialEq`, or serialize every field. With
/// `cache_errors`, errors get the same check (by `PartialEq` where `E` has it).
///
/// An async tool that finishes when its caller stops waiting (the default for one whose
/// body uses nothing borrowed from its caller, or `on_cancel = "finish"`) must have a
/// `Send + 'static` body, with `T` and `E` `Send + 'static` too. With `on_cancel =
/// "finish"`, a method that uses `&self` runs on a clone of `self` (`Self: Clone`), and a
/// `&T` argument it uses on an owned copy (`T: ToOwned`).
///
/// In `#[async_trait]` impls, put `#[idempotent]` on the method as usual: the impl's
/// `#[async_trait]` expands first and `#[idempotent]` wraps the boxed future it emits.
///
/// # TTL guidance
///
/// The TTL must exceed the longest a run plus its retries can take: payments and
/// transactional emails 24 hours; notifications and record updates 1 hour; document
/// generation and exports 7 days. Reads (`get_customer`, `search_products`), logs and
/// analytics need no idempotency: leave them undecorated and save the store round trip.
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    let original = proc_macro2::TokenStream::from(item.clone());
    let result = syn::parse::<attr::Args>(args).and_then(|args| {
        let func = syn::parse::<syn::ItemFn>(item).map_err(|e| {
            syn::Error::new(
                e.span(),
                "`#[idempotent]` goes on a function with a body (a free function or a method)",
            )
        })?;
        expand::expand(args, func)
    });
    match result {
        Ok(tokens) => tokens.into(),
        Err(err) => {
            // One clear error, and the item unchanged so no follow-on errors pile up.
            let mut tokens = err.to_compile_error();
            tokens.extend(original);
            tokens.into()
        }
    }
}
