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

/// Makes a tool function safe to retry. See the `idem` crate's documentation for the
/// options and examples.
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
