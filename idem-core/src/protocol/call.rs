//! A call: its run, its key and input fingerprint, its options, and its telemetry.
//! Made once, before anything touches the store; every other part of the protocol
//! reads from it.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use serde::Serialize;

use crate::error::Error;
use crate::key::{Fingerprint, KeyInput, KeyParts};
use crate::key_text::Key;
use crate::options::Options;
use crate::run::Run;
use crate::telemetry::{self, Handover, Report, Tally};

/// A tool's name as a call holds it: the attribute's, which lives as long as the
/// program, or a dynamic tool's, shared. Preparing a call copies neither. Where a
/// store keeps the name (a claim's [`Origin`](crate::store::Origin)), it gets a shared
/// copy: a dynamic tool's own, or for a name that lives as long as the program, the
/// one copy this thread made of it.
#[derive(Clone)]
pub struct ToolName(Name);

#[derive(Clone)]
enum Name {
    Static(&'static str),
    Shared(Arc<str>),
}

impl ToolName {
    /// A name that may not live as long as the program (the attribute's `name = ...`
    /// given as an expression, such as `&self.name`): copied, once for the call.
    pub fn copied(name: &str) -> ToolName {
        ToolName(Name::Shared(Arc::from(name)))
    }

    /// The name, if it lives as long as the program.
    #[cfg(feature = "metrics")]
    pub(crate) fn as_static(&self) -> Option<&'static str> {
        match self.0 {
            Name::Static(name) => Some(name),
            Name::Shared(_) => None,
        }
    }

    /// The name as a store keeps it.
    pub(crate) fn to_shared(&self) -> Arc<str> {
        match &self.0 {
            Name::Static(name) => shared_static(name),
            Name::Shared(name) => Arc::clone(name),
        }
    }
}

/// A shared copy of a name that lives as long as the program: made once per thread and
/// name, and cloned for every claim after. A copy made at each claim cost every miss an
/// allocation that the store keeps (the claim's origin), and cost the allocator more
/// than the copy: a miss whose input is owned took 40% longer on the memory store
/// (`docs/performance.md`). Names are told apart by where their text is: a program has
/// as many as it has tools (and instantiations of generic ones), so each thread's table
/// stays that small.
fn shared_static(name: &'static str) -> Arc<str> {
    type Names = HashMap<(usize, usize), Arc<str>, foldhash::fast::RandomState>;
    thread_local! {
        static NAMES: RefCell<Names> = RefCell::new(Names::default());
    }
    let at = (name.as_ptr() as usize, name.len());
    NAMES
        .try_with(|names| {
            Arc::clone(
                names
                    .borrow_mut()
                    .entry(at)
                    .or_insert_with(|| Arc::from(name)),
            )
        })
        // A claim made while this thread's locals are torn down.
        .unwrap_or_else(|_| Arc::from(name))
}

impl Deref for ToolName {
    type Target = str;
    fn deref(&self) -> &str {
        match &self.0 {
            Name::Static(name) => name,
            Name::Shared(name) => name,
        }
    }
}

impl From<&'static str> for ToolName {
    fn from(name: &'static str) -> Self {
        ToolName(Name::Static(name))
    }
}

impl From<Arc<str>> for ToolName {
    fn from(name: Arc<str>) -> Self {
        ToolName(Name::Shared(name))
    }
}

impl From<&Arc<str>> for ToolName {
    fn from(name: &Arc<str>) -> Self {
        ToolName(Name::Shared(Arc::clone(name)))
    }
}

impl fmt::Display for ToolName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self)
    }
}

impl fmt::Debug for ToolName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&**self, f)
    }
}

/// One idempotent call, ready to execute: its run, key and input fingerprint.
#[derive(Debug, Clone)]
pub struct Call {
    pub(super) run: Run,
    pub(super) tool: ToolName,
    pub(super) key: Key,
    pub(super) fingerprint: Fingerprint,
    pub(super) options: Options,
    /// Its span, and what the protocol learns on the way (see [`telemetry`]).
    pub(super) tally: Tally,
}

impl Call {
    /// Prepares a call of `tool` whose key covers the whole `input`.
    ///
    /// `run` is the explicit run, if the tool takes one; otherwise the ambient run
    /// ([`Run::current`]) is used, and without one the call is [`Error::NoRun`].
    pub fn new<I: Serialize + ?Sized>(
        run: Option<&Run>,
        tool: impl Into<ToolName>,
        options: Options,
        input: &I,
    ) -> Result<Call, Error> {
        Self::build(run, tool.into(), options, |parts| {
            let fingerprint = Fingerprint::of(parts, input)?;
            Ok((fingerprint, fingerprint))
        })
    }

    /// Prepares a call of `tool` whose key covers only `key_input` (a part of `input`).
    /// The fingerprint still covers all of `input`: reusing the key with another input
    /// is an [`Error::PayloadMismatch`].
    pub fn with_key<I: Serialize + ?Sized, K: Serialize + ?Sized>(
        run: Option<&Run>,
        tool: impl Into<ToolName>,
        options: Options,
        input: &I,
        key_input: &K,
    ) -> Result<Call, Error> {
        Self::build(run, tool.into(), options, |parts| {
            Ok((
                Fingerprint::of(parts, input)?,
                Fingerprint::of(parts, key_input)?,
            ))
        })
    }

    /// Prepares a call from the function's arguments, as the attribute does: `args` are
    /// the arguments (hashed as a JSON array), `key` the ones that form the key, if not
    /// all of them.
    pub fn from_args(
        run: Option<&Run>,
        tool: impl Into<ToolName>,
        options: Options,
        args: &[&dyn KeyInput],
        key: Option<&[&dyn KeyInput]>,
    ) -> Result<Call, Error> {
        Self::build(run, tool.into(), options, |parts| of_args(parts, args, key))
    }

    /// The key [`Call::from_args`] would give a call of `tool` in `run`, derived without
    /// making the call: no span, and an error is returned, not reported as a refused
    /// call. What [`Tool::key_of`](crate::Tool::key_of) answers.
    pub(crate) fn key_of_args(
        run: &Run,
        tool: &str,
        args: &[&dyn KeyInput],
        key: Option<&[&dyn KeyInput]>,
    ) -> Result<Key, Error> {
        let (_, _, key) = derive(Some(run), tool, Refusal::Returned, |parts| {
            of_args(parts, args, key)
        })?;
        Ok(key)
    }

    /// Derives the call's run, fingerprint and key (see [`derive`]), then makes the
    /// call, with its span.
    fn build(
        run: Option<&Run>,
        tool: ToolName,
        options: Options,
        fingerprints: impl FnOnce(&KeyParts<'_>) -> Result<(Fingerprint, Fingerprint), Error>,
    ) -> Result<Call, Error> {
        let (run, fingerprint, key) = derive(run, &tool, Refusal::Reported, fingerprints)?;
        Ok(Call {
            tally: Tally::new(&tool, &key, &run),
            key,
            run,
            tool,
            fingerprint,
            options: options.clamped(),
        })
    }

    /// The call's idempotency key.
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// The fingerprint of the call's whole input (with its key parts).
    pub fn fingerprint(&self) -> &Fingerprint {
        &self.fingerprint
    }

    pub(crate) fn run(&self) -> &Run {
        &self.run
    }

    pub(crate) fn options(&self) -> &Options {
        &self.options
    }

    pub(crate) fn tool(&self) -> &str {
        &self.tool
    }

    pub(crate) fn span(&self) -> &tracing::Span {
        self.tally.span()
    }

    /// Starts reporting the call's outcome.
    pub(super) fn report(&self) -> Report<'_> {
        Report::start(&self.tool, &self.key, &self.run, &self.tally)
    }

    /// Goes on reporting the call's outcome, in the part of the call that owns it now.
    pub(super) fn resume(&self, handover: Handover) -> Report<'_> {
        Report::resume(&self.tool, &self.key, &self.run, &self.tally, handover)
    }
}

/// The fingerprints of a call made of `args`: of them all, and of those that form the
/// key (`key`, or all of them).
fn of_args(
    parts: &KeyParts<'_>,
    args: &[&dyn KeyInput],
    key: Option<&[&dyn KeyInput]>,
) -> Result<(Fingerprint, Fingerprint), Error> {
    let fingerprint = Fingerprint::of_args(parts, args)?;
    let key_fingerprint = match key {
        Some(key) => Fingerprint::of_args(parts, key)?,
        None => fingerprint,
    };
    Ok((fingerprint, key_fingerprint))
}

/// What [`derive`] does with a call it refuses: reports it (a call about to be made),
/// or only returns the error (a key asked for, no call made).
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Refusal {
    Reported,
    Returned,
}

/// Resolves the run (the explicit one, else the ambient one), then takes the
/// fingerprints with the call's parts (`fingerprints` gives the key's, and what else it
/// takes: the whole input's, for a call), and makes the key's text.
fn derive<T>(
    run: Option<&Run>,
    tool: &str,
    refusal: Refusal,
    fingerprints: impl FnOnce(&KeyParts<'_>) -> Result<(T, Fingerprint), Error>,
) -> Result<(Run, T, Key), Error> {
    let refused = |call_id: Option<&str>, error: &Error| {
        if refusal == Refusal::Reported {
            telemetry::rejected(tool, call_id, error);
        }
    };
    let run = match run.cloned().or_else(Run::current) {
        // A blank id would make every such caller one run.
        Some(run) if !crate::run::is_blank(run.id()) => run,
        run => {
            let error = Error::NoRun {
                tool: tool.to_owned(),
                blank_id: run.as_ref().map(|run| run.id().to_owned()),
            };
            refused(run.as_ref().and_then(Run::call_id), &error);
            return Err(error);
        }
    };
    let parts = KeyParts {
        tenant: run.tenant(),
        run_id: run.id(),
        call_id: run.call_id(),
        tool,
    };
    let (other, key_fingerprint) =
        fingerprints(&parts).inspect_err(|error| refused(run.call_id(), error))?;
    let key = Key::of(tool, &key_fingerprint);
    Ok((run, other, key))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::ToolName;

    #[test]
    fn a_static_name_is_copied_once_per_thread_and_told_apart_by_its_length() {
        const TEXT: &str = "send_email::{{closure}}";
        let name = ToolName::from(TEXT);
        let (first, second) = (name.to_shared(), name.to_shared());
        assert_eq!(&*first, TEXT);
        assert!(
            Arc::ptr_eq(&first, &second),
            "one copy, shared by the claims"
        );
        // A name that starts where another does (the default name is a prefix of the
        // compiler's type name) is a name of its own.
        let shorter = ToolName::from(&TEXT[..10]);
        assert_eq!(&*shorter.to_shared(), "send_email");
        // Another thread makes its own copy, of the same text.
        let there = std::thread::spawn(move || name.to_shared()).join().unwrap();
        assert_eq!(&*there, TEXT);
        assert!(!Arc::ptr_eq(&first, &there));
        // A dynamic tool's name is its own Arc.
        let dynamic: Arc<str> = Arc::from("search");
        assert!(Arc::ptr_eq(&ToolName::from(&dynamic).to_shared(), &dynamic));
    }
}
