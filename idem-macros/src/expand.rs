//! Code generation: the function, re-emitted with its body wrapped in one runtime call.
//!
//! For `async fn send_email(input: SendEmail) -> Result<Sent, ToolError> { body }` the
//! output is, in substance:
//!
//! ```text
//! async fn send_email(input: SendEmail) -> Result<Sent, ToolError> {
//!     let __idem_call = ::idem::__private_0_1_0::Call::from_args(
//!         None, "send_email", OPTIONS, &[&input as &dyn KeyInput], None);
//!     // Whether `Sent` has `PartialEq`, for the read-back check (autoref specialisation).
//!     let __idem_compare = Compare::new((&&Probe::<Result<Sent, ToolError>>::new()).ok(), JsonOnly);
//!     match ::idem::__private_0_1_0::execute::<Result<Sent, ToolError>, ReleaseErrors, _>(
//!         Checked::new(__idem_call, __idem_compare), async move { body }).await
//!     {
//!         Ok(output) => output,                          // run now, or replayed
//!         Err(error) => from_idem_error(error),          // E: From<idem::Error>
//!     }
//! }
//! ```
//!
//! The signature, attributes, visibility and docs are kept as written. A sync function
//! gets `execute_blocking(.., move || body)`. A function another attribute already
//! turned into `Box::pin(async move { .. })` (`#[async_trait]`, rmcp's `#[tool]`) keeps
//! that shape; the wrapping happens inside the boxed future, so the key is derived when
//! the future first runs (inside the caller's `Run::scope`), not when it is created.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{Block, Expr, FnArg, Ident, ItemFn, Pat, ReturnType, Stmt, Type};

use crate::attr::{key_root, Args};
use crate::cancel;

/// How an argument takes part in the call.
enum Role {
    /// The explicit run: `run: &Run` or `run: Run`; `ty` is its type, where an error
    /// about it points.
    Run { ty: Span },
    /// Serialized into the fingerprint (and the key, unless `key = [...]` says otherwise).
    Input,
    /// A `HashSet` input: keyed as a set (sorted), since its own order is the hash's.
    /// `by_ref` when the argument is a reference to one.
    Set { by_ref: bool },
    /// Listed in `skip = [...]`.
    Skipped,
}

struct Param {
    ident: Ident,
    role: Role,
}

pub fn expand(args: Args, mut func: ItemFn) -> syn::Result<TokenStream> {
    let krate = args
        .krate
        .as_ref()
        .map(|p| quote!(#p))
        .unwrap_or_else(|| quote!(::idem));
    // The facade's hidden module for generated code, named after this crate's version
    // (the two are released together): a mismatched pair fails to compile.
    let private_module = format_ident!(
        "__private_{}",
        env!("CARGO_PKG_VERSION").replace(['.', '-', '+'], "_")
    );
    let private = quote!(#krate::#private_module);

    let ret = match &func.sig.output {
        ReturnType::Type(_, ty) => (**ty).clone(),
        ReturnType::Default => {
            return Err(syn::Error::new_spanned(
                &func.sig,
                "an `#[idempotent]` function must return `Result<T, E>`: idem stores the `Ok` value and replays it to retries",
            ))
        }
    };

    let params = params(&func, &args)?;
    let has_receiver = func.sig.receiver().is_some();

    // The tool name: the `name` option, else the function's path as the compiler writes
    // a closure made in its body: module, type and trait, with this instantiation's
    // generic arguments. No two tools share it. A literal and the path live as long as
    // the program, and the call holds them as they are; any other expression gives a
    // `&str` that may borrow from the call (`name = &self.name`), copied for the call.
    let name = match &args.name {
        Some(
            name @ Expr::Lit(syn::ExprLit {
                lit: syn::Lit::Str(_),
                ..
            }),
        ) => quote!(#name),
        Some(name) => quote!(#private::ToolName::copied(#name)),
        None => quote!({
            let __idem_here = || ();
            #private::default_tool_name(::core::any::type_name_of_val(&__idem_here))
        }),
    };
    if let (Some(first), false) = (args.scope.first(), has_receiver) {
        return Err(syn::Error::new_spanned(
            first,
            "`scope` names fields of `self`, and this function has no `self`",
        ));
    }

    let options = options(&args, &private);

    let run_param = params.iter().find_map(|p| match p.role {
        Role::Run { ty } => Some((&p.ident, ty)),
        _ => None,
    });
    // `run = expr`: where the run comes from (a request's metadata, a context argument);
    // its value is a `Run`, a `&Run` or an `Option` of either, `None` meaning the ambient
    // run.
    let run_source = match (&args.run, run_param) {
        (Some(expr), Some((ident, _))) => {
            let mut err = syn::Error::new_spanned(
                expr,
                "`run = ...` and a `Run` argument both name the run; keep one",
            );
            err.combine(syn::Error::new_spanned(ident, "the `Run` argument"));
            return Err(err);
        }
        (Some(expr), None) => Some(quote_spanned!(expr.span()=> let __idem_run = #expr;)),
        (None, _) => None,
    };
    let run = match (run_source.is_some(), run_param) {
        (true, _) => quote!(#private::RunSource::run(&__idem_run)),
        // Spanned at the argument's type: a type of another crate named `Run` is an
        // error there, saying why.
        (false, Some((ident, ty))) => {
            let as_run = respan(quote!(#private::RunArgument::as_run), ty);
            quote_spanned!(ty=> ::core::option::Option::Some(#as_run(&#ident)))
        }
        (false, None) => quote!(::core::option::Option::None),
    };

    // Each input as `&dyn KeyInput`, spanned at the argument: an argument that does not
    // serialize is one error, there.
    let as_input = |e: &dyn quote::ToTokens| {
        let span = e.span();
        quote_spanned!(span=> &#e as &dyn #private::KeyInput)
    };
    // A `HashSet` argument, keyed as a set.
    let as_set = |ident: &Ident, by_ref: bool| {
        let set = if by_ref {
            quote!(#ident)
        } else {
            quote!(&#ident)
        };
        quote_spanned!(ident.span()=> &#private::Sorted(#set) as &dyn #private::KeyInput)
    };
    let argument = |p: &Param| match p.role {
        Role::Set { by_ref } => Some(as_set(&p.ident, by_ref)),
        Role::Input => Some(as_input(&p.ident)),
        Role::Run { .. } | Role::Skipped => None,
    };
    // `scope = [self.account]`: fields of the receiver, after the arguments.
    let scope: Vec<TokenStream> = args.scope.iter().map(|e| as_input(e)).collect();
    let inputs: Vec<TokenStream> = params
        .iter()
        .filter_map(argument)
        .chain(scope.clone())
        .collect();
    let key = match &args.key {
        None => quote!(::core::option::Option::None),
        Some(key) => {
            let key: Vec<TokenStream> = key
                .iter()
                .map(|e| {
                    let whole = params
                        .iter()
                        .find(|p| matches!(e, Expr::Path(path) if path.path.is_ident(&p.ident)));
                    whole.and_then(argument).unwrap_or_else(|| as_input(e))
                })
                .chain(scope)
                .collect();
            quote!(::core::option::Option::Some(&[#(#key),*]))
        }
    };
    let call = quote!(#private::Call::from_args(#run, #name, #options, &[#(#inputs),*], #key));
    // `reconcile = check`: before the call, an abandoned claim of it is settled by what
    // `check(&key, &arg, ..)` finds out downstream (every argument but the run, by
    // reference). Spanned at the hook: a hook of the wrong shape is an error there.
    let reconciling = private.clone();
    let compare_ident = format_ident!("__idem_compare");
    let reconcile = match &args.reconcile {
        None => quote!(),
        Some((hook, _)) => {
            // Every argument but the run, by reference, rebound under its own name in
            // the closure that asks the hook (which gets the key, owned).
            let idents: Vec<&Ident> = params
                .iter()
                .filter(|p| !matches!(p.role, Role::Run { .. }))
                .map(|p| &p.ident)
                .collect();
            let span = hook.span();
            quote_spanned! {span=>
                #reconciling::reconcile(&__idem_call, #compare_ident.ok, {
                    let __idem_args = (#(&#idents,)*);
                    let __idem_eq = #compare_ident.ok;
                    move |__idem_key: #reconciling::Key| {
                        let (#(#idents,)*) = __idem_args;
                        async move {
                            #reconciling::hook_answer(__idem_eq, #hook(&__idem_key, #(#idents),*).await)
                        }
                    }
                })
                .await;
            }
        }
    };

    // The runtime calls carry bounds on the return type (`Result`, `Serialize`,
    // `From<idem::Error>`): span them at it, so that is where errors point.
    let private = respan(private, ret.span());
    let policy = if args.cache_errors {
        quote!(#private::CacheErrors)
    } else {
        quote!(#private::ReleaseErrors)
    };
    let convert = match &args.map_error {
        Some(map) => quote!(#private::ToolOutput::from_result(
            ::core::result::Result::Err(#map(__idem_error))
        )),
        None => quote_spanned!(ret.span()=> #private::from_idem_error(__idem_error)),
    };
    let finish = |executed: TokenStream| {
        quote! {
            match #executed {
                ::core::result::Result::Ok(__idem_output) => __idem_output,
                ::core::result::Result::Err(__idem_error) => #convert,
            }
        }
    };
    let call_ident = format_ident!("__idem_call");
    // How the tool's outcomes are compared when read back before they are stored: by
    // `PartialEq` where the types have it (asked where their names are written, see
    // `read_back` in idem-core), always by JSON. `output` is the tool's `Result` type.
    let compare = |output: &Type| {
        let err = match args.cache_errors {
            true => quote!(__idem_probe.err()),
            false => quote!(#private::JsonOnly),
        };
        let compare = quote_spanned! {output.span()=>
            // The probe's shape: a reference the compiler derefs to find the method,
            // and a conversion that is the identity for one of the two answers.
            #[allow(clippy::needless_borrow, clippy::useless_conversion)]
            let #compare_ident = {
                #[allow(unused_imports)]
                use #private::{ErrByJson as _, ErrByPartialEq as _, OkByJson as _, OkByPartialEq as _};
                let __idem_probe = &&#private::Probe::<#output>::new();
                #private::Compare::new(__idem_probe.ok(), #err)
            };
        };
        let checked = quote!(#private::Checked::new(#call_ident, #compare_ident));
        (compare, checked)
    };
    let explicit = args
        .on_cancel
        .as_ref()
        .map(|(choice, lit)| (*choice, lit.span()));
    // Which runtime call: one that finishes a body its caller stopped waiting for (its
    // body made by a closure, on the owner's path only), or one that settles its claim
    // at once.
    // Spanned at `span` (the return type, where the bounds' errors then point).
    let execute = |owned: Option<cancel::Owned>,
                   block: &mut Block,
                   ret: &TokenStream,
                   checked: &TokenStream,
                   span: Span| match owned {
        Some(owned) => {
            if owned.rewrite_self {
                cancel::rewrite_self(block);
            } else {
                cancel::forget_self(block);
            }
            let (prelude, reborrow) = (&owned.prelude, &owned.reborrow);
            let stmts = &block.stmts;
            quote_spanned!(span=> #private::execute_finishing::<#ret, #policy, _>(
                #checked,
                move || { #(#prelude)* async move { #(#reborrow)* #(#stmts)* } },
            ))
        }
        None => {
            let stmts = &block.stmts;
            quote_spanned!(span=> #private::execute::<#ret, #policy, _>(
                #checked,
                async move { #(#stmts)* },
            ))
        }
    };

    if func.sig.asyncness.is_some() {
        let mut block = (*func.block).clone();
        let owned = cancel::decide(&func, &block, explicit)?;
        let (compare, checked) = compare(&ret);
        let executed = execute(owned, &mut block, &quote!(#ret), &checked, ret.span());
        let body = finish(quote_spanned!(ret.span()=> #executed.await));
        *func.block = syn::parse_quote!({
            #run_source
            let #call_ident = #call;
            #compare
            #reconcile
            #body
        });
    } else if boxed_async_block(&mut func.block).is_some() {
        // `Box::pin(async move { .. })` from another attribute: wrap the inner block.
        let signature = func_without_body(&func);
        let Some(inner) = boxed_async_block(&mut func.block) else {
            return Ok(quote!(#func));
        };
        let mut block = Block {
            brace_token: inner.brace_token,
            stmts: std::mem::take(&mut inner.stmts),
        };
        let owned = cancel::decide(&signature, &block, explicit)?;
        // The boxed future's `Output`, the tool's `Result`: as written, or through the
        // `Future` trait (a return type behind an alias, `BoxFuture<Result<T, E>>`).
        let output = future_output(&ret)
            .unwrap_or_else(|| syn::parse_quote!(<#ret as ::core::future::Future>::Output));
        let (compare, checked) = compare(&output);
        let executed = execute(owned, &mut block, &quote!(_), &checked, Span::call_site());
        let body = finish(quote!(#executed.await));
        inner.stmts = syn::parse_quote!(
            #run_source
            let #call_ident = #call;
            #compare
            #reconcile
            #body
        );
    } else {
        if let Some((_, lit)) = &args.on_cancel {
            return Err(syn::Error::new_spanned(
                lit,
                "`on_cancel` is for async tools: a sync tool's body runs on its caller's thread, \
                 and always finishes",
            ));
        }
        if let Some((_, option)) = &args.reconcile {
            return Err(syn::Error::new_spanned(
                option,
                "`reconcile` is for async tools: its hook asks a downstream system, and is \
                 awaited",
            ));
        }
        let block = &func.block;
        let (compare, checked) = compare(&ret);
        let body = finish(quote_spanned!(ret.span()=>
            #private::execute_blocking::<#ret, #policy, _>(#checked, move || #block)
        ));
        *func.block = syn::parse_quote!({
            #run_source
            let #call_ident = #call;
            #compare
            #body
        });
    }
    Ok(quote!(#func))
}

/// The `Output = T` of a future type (`Pin<Box<dyn Future<Output = T> + Send>>`,
/// `impl Future<Output = T>`): what a boxed async function returns.
fn future_output(ty: &Type) -> Option<Type> {
    struct Find(Option<Type>);
    impl<'a> syn::visit::Visit<'a> for Find {
        fn visit_assoc_type(&mut self, assoc: &'a syn::AssocType) {
            if self.0.is_none() && assoc.ident == "Output" {
                self.0 = Some(assoc.ty.clone());
            }
            syn::visit::visit_assoc_type(self, assoc);
        }
    }
    let mut find = Find(None);
    syn::visit::Visit::visit_type(&mut find, ty);
    find.0
}

/// `func` with an empty body: its signature, for deciding about a body kept elsewhere.
fn func_without_body(func: &ItemFn) -> ItemFn {
    ItemFn {
        attrs: Vec::new(),
        vis: func.vis.clone(),
        sig: func.sig.clone(),
        block: Box::new(syn::parse_quote!({})),
    }
}

/// Sorts the arguments into run, inputs and skipped, checking `skip` and `key`.
fn params(func: &ItemFn, args: &Args) -> syn::Result<Vec<Param>> {
    let mut params = Vec::new();
    let mut run_seen: Option<Span> = None;
    for arg in &func.sig.inputs {
        let FnArg::Typed(typed) = arg else { continue }; // the receiver is never input
        let ident = match &*typed.pat {
            Pat::Ident(p) => p.ident.clone(),
            // A destructuring pattern (`Parameters(input): Parameters<T>`): the names it
            // binds are the input.
            pattern => {
                let mut bound = Vec::new();
                bindings(pattern, &mut bound)?;
                for ident in bound {
                    let role = if args.skip.contains(&ident) {
                        Role::Skipped
                    } else {
                        no_set_inside(&typed.ty)?;
                        Role::Input
                    };
                    params.push(Param { ident, role });
                }
                continue;
            }
        };
        let role = if args.skip.contains(&ident) {
            Role::Skipped
        } else if is_run_type(&typed.ty) {
            if let Some(first) = run_seen {
                let mut err =
                    syn::Error::new_spanned(&typed.ty, "only one `Run` argument is allowed");
                err.combine(syn::Error::new(first, "the first `Run` argument is here"));
                return Err(err);
            }
            run_seen = Some(typed.ty.span());
            Role::Run {
                ty: typed.ty.span(),
            }
        } else if let Some(by_ref) = set_type(&typed.ty) {
            Role::Set { by_ref }
        } else {
            no_set_inside(&typed.ty)?;
            Role::Input
        };
        params.push(Param { ident, role });
    }
    for skipped in &args.skip {
        if !params.iter().any(|p| &p.ident == skipped) {
            return Err(syn::Error::new_spanned(
                skipped,
                format!("`skip`: the function has no argument named `{skipped}`"),
            ));
        }
    }
    for entry in args.key.iter().flatten() {
        let root = key_root(entry)?;
        match params.iter().find(|p| &p.ident == root).map(|p| &p.role) {
            Some(Role::Input | Role::Set { .. }) => {}
            Some(Role::Run { .. }) => {
                return Err(syn::Error::new_spanned(
                    entry,
                    "the `Run` argument is always part of the key; leave it out of `key = [...]`",
                ))
            }
            Some(Role::Skipped) => {
                return Err(syn::Error::new_spanned(
                    entry,
                    format!("`{root}` is in `skip`, so it cannot be in `key`"),
                ))
            }
            None => {
                return Err(syn::Error::new_spanned(
                    entry,
                    format!("`key`: the function has no argument named `{root}`"),
                ))
            }
        }
    }
    Ok(params)
}

/// The names a destructuring argument pattern binds. A `_` (or `..`) hides part of an
/// argument from the key, which could make two different calls share one: an error.
fn bindings(pattern: &Pat, out: &mut Vec<Ident>) -> syn::Result<()> {
    let hidden = |p: &dyn quote::ToTokens| {
        Err(syn::Error::new_spanned(
            p,
            "`#[idempotent]` needs every part of an argument in the key: name it (`_unused: T` \
             is fine), or give the argument a name and list it in `skip = [...]`",
        ))
    };
    match pattern {
        Pat::Ident(p) => {
            out.push(p.ident.clone());
            Ok(())
        }
        Pat::Tuple(t) => t.elems.iter().try_for_each(|p| bindings(p, out)),
        Pat::TupleStruct(t) => t.elems.iter().try_for_each(|p| bindings(p, out)),
        Pat::Struct(s) => {
            if let Some(rest) = &s.rest {
                return hidden(rest);
            }
            s.fields.iter().try_for_each(|f| bindings(&f.pat, out))
        }
        Pat::Reference(r) => bindings(&r.pat, out),
        Pat::Paren(p) => bindings(&p.pat, out),
        Pat::Type(t) => bindings(&t.pat, out),
        other => hidden(other),
    }
}

/// Whether `ty` is written `Run` or `&Run`, alone or as `idem::Run` (or
/// `idem_core::Run`): the call's run. `workflow::Run` is another crate's type, and an
/// input.
fn is_run_type(ty: &Type) -> bool {
    let ty = match ty {
        Type::Reference(r) if r.mutability.is_none() => &*r.elem,
        other => other,
    };
    let Type::Path(p) = ty else { return false };
    if p.qself.is_some() {
        return false;
    }
    let segments: Vec<&syn::PathSegment> = p.path.segments.iter().collect();
    let Some((last, before)) = segments.split_last() else {
        return false;
    };
    let ours = match before {
        [] => true,
        [.., krate] => krate.ident == "idem" || krate.ident == "idem_core",
    };
    ours && last.ident == "Run" && last.arguments.is_none()
}

/// Whether a path segment names a hash set (`HashSet`, and aliases such as
/// `FxHashSet` or `AHashSet`), which serializes in hash order.
fn is_hash_set(segment: &syn::PathSegment) -> bool {
    segment.ident.to_string().ends_with("HashSet")
}

/// `Some(by_ref)` when `ty` is a hash set, or a shared reference to one: an argument
/// the attribute keys as a set.
fn set_type(ty: &Type) -> Option<bool> {
    let (ty, by_ref) = match ty {
        Type::Reference(r) if r.mutability.is_none() => (&*r.elem, true),
        other => (other, false),
    };
    match ty {
        Type::Path(p) if p.qself.is_none() => {
            is_hash_set(p.path.segments.last()?).then_some(by_ref)
        }
        _ => None,
    }
}

/// An error at a hash set inside an argument's type (`Option<HashSet<T>>`,
/// `Vec<HashSet<T>>`): it would serialize in hash order, a new key in every process,
/// and the attribute can key only a whole argument as a set.
fn no_set_inside(ty: &Type) -> syn::Result<()> {
    struct Find<'a>(Option<&'a syn::PathSegment>);
    impl<'a> syn::visit::Visit<'a> for Find<'a> {
        fn visit_path_segment(&mut self, segment: &'a syn::PathSegment) {
            if self.0.is_none() && is_hash_set(segment) {
                self.0 = Some(segment);
            }
            syn::visit::visit_path_segment(self, segment);
        }
    }
    let mut find = Find(None);
    syn::visit::Visit::visit_type(&mut find, ty);
    match find.0 {
        None => Ok(()),
        Some(set) => Err(syn::Error::new_spanned(
            set,
            "a hash set serializes in hash order, which differs from process to process, so \
             this argument would get a new idempotency key in every process: use a `BTreeSet`, \
             pass the set as an argument of its own (the attribute keys a `HashSet` argument as \
             a set), or wrap it in a type whose field has \
             `#[serde(serialize_with = \"idem::key::sorted\")]`",
        )),
    }
}

fn options(args: &Args, private: &TokenStream) -> TokenStream {
    let mut options = quote!(#private::Options::new());
    let millis = |ms: u64| quote!(::core::time::Duration::from_millis(#ms));
    if let Some(ttl) = &args.ttl {
        let d = millis(ttl.millis);
        options = quote!(#options.ttl(#d));
    }
    if let Some(lease) = &args.lease {
        let d = millis(lease.millis);
        options = quote!(#options.lease(#d));
    }
    if let Some(wait) = &args.wait {
        let d = millis(wait.millis);
        options = quote!(#options.wait(#d));
    }
    if args.fail_fast.is_some() {
        options = quote!(#options.fail_fast());
    }
    if args.at_most_once {
        options = quote!(#options.at_most_once());
    }
    if let Some(max_run) = &args.max_run {
        let d = millis(max_run.millis);
        options = quote!(#options.max_run(#d));
    }
    if let Some((timeout, _)) = &args.reconcile_timeout {
        let d = millis(timeout.millis);
        options = quote!(#options.reconcile_timeout(#d));
    }
    options
}

/// `tokens`, every token of them spanned at `span`.
fn respan(tokens: TokenStream, span: Span) -> TokenStream {
    tokens
        .into_iter()
        .map(|mut tree| {
            if let proc_macro2::TokenTree::Group(group) = &tree {
                let mut inner =
                    proc_macro2::Group::new(group.delimiter(), respan(group.stream(), span));
                inner.set_span(span);
                tree = proc_macro2::TokenTree::Group(inner);
            } else {
                tree.set_span(span);
            }
            tree
        })
        .collect()
}

/// The `async move { .. }` inside a body ending in `Box::pin(async move { .. })`.
fn boxed_async_block(block: &mut Block) -> Option<&mut Block> {
    let Some(Stmt::Expr(Expr::Call(call), None)) = block.stmts.last_mut() else {
        return None;
    };
    let Expr::Path(func) = &*call.func else {
        return None;
    };
    let segments: Vec<String> = func
        .path
        .segments
        .iter()
        .map(|s| s.ident.to_string())
        .collect();
    if !segments.ends_with(&["Box".to_string(), "pin".to_string()]) || call.args.len() != 1 {
        return None;
    }
    match call.args.first_mut() {
        Some(Expr::Async(inner)) => Some(&mut inner.block),
        _ => None,
    }
}
