//! Parsing and checking the attribute's options.

use proc_macro2::Span;
use syn::parse::{Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::{Expr, ExprLit, Ident, Lit, LitStr, Path, Token};

use crate::duration;

/// A duration option, checked: milliseconds, and the literal for error spans.
pub struct DurationArg {
    pub millis: u64,
}

/// What happens to a running body whose caller stops waiting.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum OnCancel {
    /// It runs on in a task of its own, and its outcome is recorded.
    Finish,
    /// It is dropped with the call, and its claim settled by the delivery policy.
    Abort,
}

/// The attribute's options, as written.
#[derive(Default)]
pub struct Args {
    pub ttl: Option<DurationArg>,
    pub lease: Option<DurationArg>,
    pub wait: Option<DurationArg>,
    pub max_run: Option<DurationArg>,
    /// `on_cancel = "finish" | "abort"`, with the literal for error spans.
    pub on_cancel: Option<(OnCancel, LitStr)>,
    pub fail_fast: Option<Span>,
    pub at_most_once: bool,
    pub cache_errors: bool,
    /// The tool name: a string literal, or an expression giving `&str` (`Self::NAME`).
    pub name: Option<Expr>,
    pub key: Option<Vec<Expr>>,
    /// `scope = [self.account, ..]`: fields of the receiver that join the key.
    pub scope: Vec<Expr>,
    pub skip: Vec<Ident>,
    pub krate: Option<Path>,
    pub map_error: Option<Path>,
    pub run: Option<Expr>,
    /// `reconcile = check`: the hook asked what happened to an abandoned call, with the
    /// option's name for error spans.
    pub reconcile: Option<(Path, Ident)>,
    /// `reconcile_timeout = "10s"`, with the option's name for error spans.
    pub reconcile_timeout: Option<(DurationArg, Ident)>,
}

const OPTIONS: &str = "ttl, lease, wait, max_run, on_cancel, fail_fast, at_most_once, \
                       reconcile, reconcile_timeout, cache_errors, name, key, scope, skip, run, \
                       map_error, crate";

impl Parse for Args {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let mut args = Args::default();
        let mut seen: Vec<String> = Vec::new();
        while !input.is_empty() {
            // `crate` is a keyword: accept it as an option name.
            let name: Ident = if input.peek(Token![crate]) {
                let kw: Token![crate] = input.parse()?;
                Ident::new("crate", kw.span)
            } else {
                input.parse()?
            };
            let text = name.to_string();
            if seen.contains(&text) {
                return Err(syn::Error::new(
                    name.span(),
                    format!("duplicate option `{text}`"),
                ));
            }
            seen.push(text.clone());
            match text.as_str() {
                "ttl" => args.ttl = Some(duration_value(input)?),
                "lease" => args.lease = Some(duration_value(input)?),
                "wait" => args.wait = Some(duration_value(input)?),
                "max_run" => args.max_run = Some(duration_value(input)?),
                "reconcile_timeout" => {
                    args.reconcile_timeout = Some((duration_value(input)?, name.clone()))
                }
                "on_cancel" => {
                    let lit: LitStr = value(input)?;
                    let choice = match lit.value().as_str() {
                        "finish" => OnCancel::Finish,
                        "abort" => OnCancel::Abort,
                        _ => {
                            return Err(syn::Error::new_spanned(
                                &lit,
                                "expected `on_cancel = \"finish\"` (the body runs on after its caller \
                                 stops waiting, and its outcome is recorded) or `on_cancel = \"abort\"` \
                                 (the body is dropped with the call, and its claim settled at once)",
                            ))
                        }
                    };
                    args.on_cancel = Some((choice, lit));
                }
                "fail_fast" => args.fail_fast = Some(name.span()),
                "at_most_once" => args.at_most_once = true,
                "cache_errors" => args.cache_errors = true,
                "name" => {
                    let name: Expr = value(input)?;
                    if let Expr::Lit(ExprLit {
                        lit: Lit::Str(lit), ..
                    }) = &name
                    {
                        if lit.value().is_empty() {
                            return Err(syn::Error::new_spanned(
                                lit,
                                "the tool name must not be empty",
                            ));
                        }
                    }
                    args.name = Some(name);
                }
                "key" => {
                    let exprs = bracketed(input, &name, "name the arguments (or fields, like `input.to`) that form the key, or leave `key` out to use all arguments")?;
                    args.key = Some(exprs);
                }
                "scope" => {
                    let exprs = bracketed(input, &name, "name the fields of `self` that tell two receivers apart, like `scope = [self.account]`")?;
                    for expr in &exprs {
                        self_field(expr)?;
                    }
                    args.scope = exprs;
                }
                "skip" => {
                    input.parse::<Token![=]>()?;
                    let content;
                    syn::bracketed!(content in input);
                    let idents = Punctuated::<Ident, Token![,]>::parse_terminated(&content)?;
                    args.skip = idents.into_iter().collect();
                }
                "crate" => {
                    let lit: LitStr = value(input)?;
                    args.krate = Some(lit.parse().map_err(|_| {
                        syn::Error::new_spanned(
                            &lit,
                            "expected a path, like `crate = \"my_crate::idem\"`",
                        )
                    })?);
                }
                "run" => {
                    input.parse::<Token![=]>()?;
                    args.run = Some(input.parse()?);
                }
                "map_error" => {
                    input.parse::<Token![=]>()?;
                    args.map_error = Some(input.parse()?);
                }
                "reconcile" => {
                    input.parse::<Token![=]>()?;
                    args.reconcile = Some((input.parse()?, name.clone()));
                }
                _ => {
                    return Err(syn::Error::new(
                        name.span(),
                        format!("unknown option `{text}`; expected one of: {OPTIONS}"),
                    ))
                }
            }
            if input.is_empty() {
                break;
            }
            input.parse::<Token![,]>()?;
        }
        if let (Some((_, option)), false) = (&args.reconcile, args.at_most_once) {
            return Err(syn::Error::new(
                option.span(),
                "`reconcile` asks what happened to a call whose outcome is unknown, and only an \
                 `at_most_once` tool has such calls (an at-least-once tool runs them again): \
                 add `at_most_once`",
            ));
        }
        if let (Some((_, option)), None) = (&args.reconcile_timeout, &args.reconcile) {
            return Err(syn::Error::new(
                option.span(),
                "`reconcile_timeout` bounds a reconcile hook, and this tool has none: add \
                 `reconcile = hook`, or leave `reconcile_timeout` out",
            ));
        }
        if let (Some(span), Some(_)) = (args.fail_fast, &args.wait) {
            return Err(syn::Error::new(
                span,
                "`fail_fast` and `wait` contradict each other: fail at once, or wait a bounded time",
            ));
        }
        Ok(args)
    }
}

/// `= [a, b, ..]`: a non-empty list of expressions; an empty one is an error at the
/// option's name, saying what to write instead (`hint`).
fn bracketed(input: ParseStream<'_>, option: &Ident, hint: &str) -> syn::Result<Vec<Expr>> {
    input.parse::<Token![=]>()?;
    let content;
    syn::bracketed!(content in input);
    let exprs = Punctuated::<Expr, Token![,]>::parse_terminated(&content)?;
    if exprs.is_empty() {
        return Err(syn::Error::new(
            option.span(),
            format!("`{option} = []` is empty: {hint}"),
        ));
    }
    Ok(exprs.into_iter().collect())
}

fn value<T: Parse>(input: ParseStream<'_>) -> syn::Result<T> {
    input.parse::<Token![=]>()?;
    input.parse()
}

fn duration_value(input: ParseStream<'_>) -> syn::Result<DurationArg> {
    let lit: LitStr = value(input)?;
    match duration::parse_millis(&lit.value()) {
        Ok(millis) => Ok(DurationArg { millis }),
        Err(message) => Err(syn::Error::new(lit.span(), message)),
    }
}

/// The argument a `key = [...]` entry is rooted at: `input` for `input`, `input.to`,
/// `input.address.domain`. Anything else (calls, indexing, literals) is an error.
pub fn key_root(expr: &Expr) -> syn::Result<&Ident> {
    match expr {
        Expr::Path(p) if p.qself.is_none() => p
            .path
            .get_ident()
            .ok_or_else(|| syn::Error::new_spanned(p, "expected an argument name, like `input`")),
        Expr::Field(f) => key_root(&f.base),
        other => Err(syn::Error::new_spanned(
            other,
            "a key entry is an argument or a field of one, like `input` or `input.to`",
        )),
    }
}

/// Checks a `scope = [...]` entry: a field of `self`, like `self.account` or
/// `self.config.tenant`.
fn self_field(expr: &Expr) -> syn::Result<()> {
    let mut base = expr;
    let mut fields = 0;
    while let Expr::Field(f) = base {
        base = &f.base;
        fields += 1;
    }
    match base {
        Expr::Path(p) if fields > 0 && p.qself.is_none() && p.path.is_ident("self") => Ok(()),
        _ => Err(syn::Error::new_spanned(
            expr,
            "a `scope` entry is a field of `self`, like `self.account`: the parts of the receiver that join the key",
        )),
    }
}
