//! What a call does when its caller stops waiting: whether the body can run on by
//! itself (it owns everything it uses), and, when the user asks it to finish, making it
//! own what it borrows.
//!
//! The decision is made on the signature and the body's tokens, since a macro sees no
//! types: a body finishes by default when nothing it uses can borrow from the caller (a
//! reference, a lifetime, `impl Trait`, a generic parameter, `Self`), and neither can
//! its return type. `on_cancel = "finish"` also finishes a body that uses `&self` or a
//! `&T` argument: it runs on a clone of `self` (`Self: Clone`) and on owned copies of
//! those arguments (`T: ToOwned`), reborrowed under the same names. The copies are made
//! only when the call runs its body, not when it replays a result.
//!
//! A body another attribute boxed (`#[async_trait]`, rmcp's `#[tool]`: the function
//! returns `Pin<Box<dyn Future<Output = T> + 'a>>`) is judged by `T`, and by its use of
//! `self`, which `#[async_trait]` renames `__self` (binding it first, with `let __self =
//! self;`, which does not count as a use).

use proc_macro2::{Ident, Span, TokenStream, TokenTree};
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::visit::Visit;
use syn::visit_mut::VisitMut;
use syn::{Block, FnArg, ItemFn, Pat, ReturnType, Type};

use crate::attr::OnCancel;

/// What the expansion adds for a body that finishes on its own.
#[derive(Default)]
pub struct Owned {
    /// Before the call: owned copies of what the body borrows.
    pub prelude: Vec<TokenStream>,
    /// At the top of the body: the names it used, reborrowed from the copies.
    pub reborrow: Vec<TokenStream>,
    /// Whether `self` in the body must be rewritten to the reborrowed clone.
    pub rewrite_self: bool,
}

/// The ident `self` is rewritten to, in a body that runs on a clone of `self`.
pub const SELF: &str = "__idem_self";

/// Decides what a dropped call of `func` does: `Ok(None)` to abort, `Ok(Some(owned))`
/// to finish with what `owned` adds. `body` is the body that will run (`func`'s own, or
/// the inner block of a boxed one); `explicit` is the user's `on_cancel`, if any.
pub fn decide(
    func: &ItemFn,
    body: &Block,
    explicit: Option<(OnCancel, Span)>,
) -> syn::Result<Option<Owned>> {
    let generics: Vec<Ident> = func
        .sig
        .generics
        .type_params()
        .map(|p| p.ident.clone())
        .collect();
    // A method's impl may have generics of its own, which the attribute cannot see:
    // there, a one-letter capital type name (`T`, `K`) is taken for one.
    let impl_generics = func.sig.receiver().is_some();
    let used = Mentions::of(body);
    match explicit {
        Some((OnCancel::Abort, _)) => Ok(None),
        None => {
            let output = match &func.sig.output {
                ReturnType::Type(_, ty) => Some(boxed_output(ty).unwrap_or(ty)),
                ReturnType::Default => None,
            };
            let borrows = receiver_used(func, &used)
                || typed_args(func).any(|(pat, ty)| {
                    may_borrow(ty, &generics, impl_generics)
                        && bound_names(pat).iter().any(|n| used.has(n))
                })
                || output.is_some_and(|ty| may_borrow(ty, &generics, impl_generics));
            Ok((!borrows).then(Owned::default))
        }
        Some((OnCancel::Finish, span)) => make_owned(func, &used, span).map(Some),
    }
}

/// `T` in `Pin<Box<dyn Future<Output = T> + ..>>`, the return type of a body another
/// attribute boxed.
fn boxed_output(ty: &Type) -> Option<&Type> {
    let Type::Path(pin) = ty else { return None };
    let last = pin.path.segments.last().filter(|s| s.ident == "Pin")?;
    let boxed = only_type_argument(&last.arguments)?;
    let Type::Path(boxed) = boxed else {
        return None;
    };
    let last = boxed.path.segments.last().filter(|s| s.ident == "Box")?;
    let Type::TraitObject(future) = only_type_argument(&last.arguments)? else {
        return None;
    };
    future.bounds.iter().find_map(|bound| {
        let syn::TypeParamBound::Trait(bound) = bound else {
            return None;
        };
        let last = bound.path.segments.last().filter(|s| s.ident == "Future")?;
        let syn::PathArguments::AngleBracketed(args) = &last.arguments else {
            return None;
        };
        args.args.iter().find_map(|arg| match arg {
            syn::GenericArgument::AssocType(assoc) if assoc.ident == "Output" => Some(&assoc.ty),
            _ => None,
        })
    })
}

/// The one type argument of `Name<T>`.
fn only_type_argument(arguments: &syn::PathArguments) -> Option<&Type> {
    let syn::PathArguments::AngleBracketed(args) = arguments else {
        return None;
    };
    match args.args.first() {
        Some(syn::GenericArgument::Type(ty)) if args.args.len() == 1 => Some(ty),
        _ => None,
    }
}

/// For `on_cancel = "finish"`: owned copies of the `&self` and `&T` arguments the body
/// uses; an error for what cannot be copied (`&mut`).
fn make_owned(func: &ItemFn, used: &Mentions, span: Span) -> syn::Result<Owned> {
    let mut owned = Owned::default();
    if let Some(receiver) = func.sig.receiver() {
        if used.has_self && receiver.reference.is_some() {
            if receiver.mutability.is_some() {
                let mut err = syn::Error::new(
                    span,
                    "`on_cancel = \"finish\"` runs the body after its caller has gone, so it cannot \
                     use `&mut self`; use `on_cancel = \"abort\"`",
                );
                err.combine(syn::Error::new_spanned(receiver, "borrowed mutably here"));
                return Err(err);
            }
            let name = Ident::new(SELF, Span::call_site());
            owned.prelude.push(
                quote_spanned!(receiver.span()=> let #name = ::core::clone::Clone::clone(self);),
            );
            owned.reborrow.push(quote!(let #name = &#name;));
            owned.rewrite_self = true;
        }
    }
    for (pat, ty) in typed_args(func) {
        let Type::Reference(reference) = ty else {
            continue;
        };
        let names = bound_names(pat);
        if !names.iter().any(|n| used.has(n)) {
            continue;
        }
        let Pat::Ident(ident) = pat else {
            return Err(syn::Error::new_spanned(
                pat,
                "`on_cancel = \"finish\"` needs to own this argument: give it a name instead of a pattern",
            ));
        };
        if reference.mutability.is_some() {
            let mut err = syn::Error::new(
                span,
                "`on_cancel = \"finish\"` runs the body after its caller has gone, so it cannot \
                 borrow an argument mutably; use `on_cancel = \"abort\"`",
            );
            err.combine(syn::Error::new_spanned(reference, "borrowed mutably here"));
            return Err(err);
        }
        let name = &ident.ident;
        let mutability = &ident.mutability;
        let copy = format_ident!("__idem_owned_{}", name);
        let elem = &reference.elem;
        owned
            .prelude
            .push(quote_spanned!(ty.span()=> let #copy = ::std::borrow::ToOwned::to_owned(#name);));
        if mutability.is_some() {
            // The body reassigns the copy; the argument itself stays as it was, which
            // the signature's `mut` would otherwise be warned of.
            owned.prelude.push(quote!(let _ = &mut #name;));
        }
        owned.reborrow.push(quote_spanned!(ty.span()=>
            let #mutability #name: &#elem = ::core::borrow::Borrow::borrow(&#copy);
        ));
    }
    Ok(owned)
}

/// Removes `#[async_trait]`'s `let __self = self;` from a finishing body that does not
/// use `self`: left in, it would capture the borrowed `self` for nothing.
pub fn forget_self(block: &mut Block) {
    block.stmts.retain(|stmt| !is_self_rebinding(stmt));
}

/// Rewrites `self` in `block` to the reborrowed clone (see [`make_owned`]).
pub fn rewrite_self(block: &mut Block) {
    ReplaceSelf.visit_block_mut(block);
}

struct ReplaceSelf;

impl VisitMut for ReplaceSelf {
    fn visit_expr_path_mut(&mut self, expr: &mut syn::ExprPath) {
        if expr.qself.is_none() && expr.path.is_ident("self") {
            let span = expr.path.segments[0].ident.span();
            expr.path.segments[0].ident = Ident::new(SELF, span);
        }
        syn::visit_mut::visit_expr_path_mut(self, expr);
    }

    fn visit_macro_mut(&mut self, mac: &mut syn::Macro) {
        mac.tokens = replace_self_tokens(std::mem::take(&mut mac.tokens));
    }

    // A nested item has a `self` of its own.
    fn visit_item_mut(&mut self, _: &mut syn::Item) {}
}

/// `self` in a macro's tokens, except as the start of a path (`self::module`).
fn replace_self_tokens(tokens: TokenStream) -> TokenStream {
    let trees: Vec<TokenTree> = tokens.into_iter().collect();
    let mut out = Vec::with_capacity(trees.len());
    for (i, tree) in trees.iter().enumerate() {
        out.push(match tree {
            TokenTree::Ident(ident) if ident == "self" => {
                let path =
                    matches!(trees.get(i + 1), Some(TokenTree::Punct(p)) if p.as_char() == ':');
                if path {
                    tree.clone()
                } else {
                    TokenTree::Ident(Ident::new(SELF, ident.span()))
                }
            }
            TokenTree::Group(group) => {
                let mut inner =
                    proc_macro2::Group::new(group.delimiter(), replace_self_tokens(group.stream()));
                inner.set_span(group.span());
                TokenTree::Group(inner)
            }
            other => other.clone(),
        });
    }
    out.into_iter().collect()
}

/// Whether `stmt` is `let __self = self;`.
fn is_self_rebinding(stmt: &syn::Stmt) -> bool {
    let syn::Stmt::Local(local) = stmt else {
        return false;
    };
    let binds = matches!(&local.pat, Pat::Ident(p) if p.ident == "__self");
    let from_self = matches!(
        local.init.as_ref().map(|init| &*init.expr),
        Some(syn::Expr::Path(path)) if path.path.is_ident("self")
    );
    binds && from_self
}

/// The typed arguments: pattern and type.
fn typed_args(func: &ItemFn) -> impl Iterator<Item = (&Pat, &Type)> {
    func.sig.inputs.iter().filter_map(|arg| match arg {
        FnArg::Typed(typed) => Some((&*typed.pat, &*typed.ty)),
        FnArg::Receiver(_) => None,
    })
}

/// Whether the body uses the receiver: any receiver may borrow from the caller (`Self`
/// may itself hold a lifetime).
fn receiver_used(func: &ItemFn, used: &Mentions) -> bool {
    func.sig.receiver().is_some() && used.has_self
}

/// The names a pattern binds.
fn bound_names(pat: &Pat) -> Vec<Ident> {
    struct Names(Vec<Ident>);
    impl<'a> Visit<'a> for Names {
        fn visit_pat_ident(&mut self, p: &'a syn::PatIdent) {
            self.0.push(p.ident.clone());
            syn::visit::visit_pat_ident(self, p);
        }
    }
    let mut names = Names(Vec::new());
    names.visit_pat(pat);
    names.0
}

/// Whether a value of type `ty` may borrow from the caller. With `impl_generics`, a
/// one-letter capital type name counts as a generic parameter of the impl.
fn may_borrow(ty: &Type, generics: &[Ident], impl_generics: bool) -> bool {
    struct Borrows<'g> {
        generics: &'g [Ident],
        impl_generics: bool,
        found: bool,
    }
    impl<'a> Visit<'a> for Borrows<'_> {
        fn visit_type_reference(&mut self, reference: &'a syn::TypeReference) {
            match &reference.lifetime {
                Some(lifetime) if lifetime.ident == "static" => {
                    syn::visit::visit_type_reference(self, reference)
                }
                _ => self.found = true,
            }
        }
        fn visit_type_impl_trait(&mut self, _: &'a syn::TypeImplTrait) {
            self.found = true;
        }
        fn visit_type_infer(&mut self, _: &'a syn::TypeInfer) {
            self.found = true;
        }
        fn visit_type_macro(&mut self, _: &'a syn::TypeMacro) {
            self.found = true;
        }
        fn visit_lifetime(&mut self, lifetime: &'a syn::Lifetime) {
            self.found |= lifetime.ident != "static";
        }
        fn visit_type_path(&mut self, path: &'a syn::TypePath) {
            if let Some(first) = path.path.segments.first() {
                let alone = path.path.segments.len() == 1 && first.arguments.is_none();
                let name = first.ident.to_string();
                let one_capital = name.len() == 1 && name.chars().all(|c| c.is_ascii_uppercase());
                self.found |= first.ident == "Self"
                    || (alone && self.generics.contains(&first.ident))
                    || (alone && self.impl_generics && one_capital);
            }
            syn::visit::visit_type_path(self, path);
        }
    }
    let mut visitor = Borrows {
        generics,
        impl_generics,
        found: false,
    };
    visitor.visit_type(ty);
    visitor.found
}

/// The idents a body mentions, in code and in the inline arguments of format strings
/// (`"{to}"`): what the body's `async move` block captures, as far as tokens tell.
struct Mentions {
    idents: Vec<String>,
    has_self: bool,
}

impl Mentions {
    fn of(body: &Block) -> Mentions {
        let mut mentions = Mentions {
            idents: Vec::new(),
            has_self: false,
        };
        for stmt in &body.stmts {
            // `#[async_trait]`'s `let __self = self;` binds `self` without using it.
            if !is_self_rebinding(stmt) {
                mentions.scan(quote!(#stmt));
            }
        }
        mentions
    }

    fn scan(&mut self, tokens: TokenStream) {
        for tree in tokens {
            match tree {
                TokenTree::Ident(ident) => {
                    let text = ident.to_string();
                    self.has_self |= text == "self" || text == "__self";
                    self.idents.push(text);
                }
                TokenTree::Group(group) => self.scan(group.stream()),
                TokenTree::Literal(literal) => {
                    let text = literal.to_string();
                    // `{name}`, `{name:?}` in a format string.
                    for piece in text.split('{').skip(1) {
                        let name: String = piece
                            .chars()
                            .take_while(|c| c.is_alphanumeric() || *c == '_')
                            .collect();
                        if !name.is_empty() {
                            self.has_self |= name == "self";
                            self.idents.push(name);
                        }
                    }
                }
                TokenTree::Punct(_) => {}
            }
        }
    }

    fn has(&self, name: &Ident) -> bool {
        let name = name.to_string();
        self.idents.contains(&name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decided(item: &str) -> bool {
        let func: ItemFn = syn::parse_str(item).unwrap();
        decide(&func, &func.block, None).unwrap().is_some()
    }

    #[test]
    fn bodies_that_own_what_they_use_finish_by_default() {
        assert!(decided(
            "async fn f(input: SendEmail) -> Result<Id, ToolError> { send(input) }"
        ));
        assert!(decided(
            "async fn f(run: &Run, n: u32) -> Result<u32, ToolError> { Ok(n) }"
        ));
        assert!(decided(
            "async fn f(&self, n: u32) -> Result<u32, ToolError> { Ok(n) }"
        ));
        assert!(decided(
            "async fn f(input: Vec<String>) -> Result<&'static str, ToolError> { Ok(\"sent\") }"
        ));
    }

    #[test]
    fn bodies_that_may_borrow_abort_by_default() {
        for item in [
            "async fn f(&self, n: u32) -> Result<u32, ToolError> { self.send(n) }",
            "async fn f(to: &str) -> Result<u32, ToolError> { send(to) }",
            "async fn f(to: &str) -> Result<String, ToolError> { Ok(format!(\"{to}\")) }",
            "async fn f<T: Serialize>(x: T) -> Result<u32, ToolError> { send(x) }",
            "async fn f(x: impl Serialize) -> Result<u32, ToolError> { send(x) }",
            "async fn f<'a>(x: Cow<'a, str>) -> Result<u32, ToolError> { send(x) }",
            "async fn f(n: u32) -> Result<Cow<'_, str>, ToolError> { todo(n) }",
            // A method of `impl<T> Tool<T>`: `T` is the impl's.
            "async fn f(&self, t: T) -> Result<u32, ToolError> { send(t) }",
        ] {
            assert!(!decided(item), "{item}");
        }
    }

    #[test]
    fn boxed_bodies_are_judged_by_their_output_and_their_use_of_self() {
        // As `#[async_trait]` writes a method that never uses `self`.
        let func: ItemFn = syn::parse_str(
            "fn f<'life0, 'async_trait>(&'life0 self, input: String) \
             -> Pin<Box<dyn Future<Output = Result<u32, ToolError>> + Send + 'async_trait>> { \
                 Box::pin(async move { let __self = self; let input = input; \
                     let __ret: Result<u32, ToolError> = { send(input) }; __ret }) }",
        )
        .unwrap();
        let inner: Block = syn::parse_str(
            "{ let __self = self; let input = input; let __ret: Result<u32, ToolError> = { send(input) }; __ret }",
        )
        .unwrap();
        assert!(decide(&func, &inner, None).unwrap().is_some());
        let uses_self: Block = syn::parse_str(
            "{ let __self = self; let input = input; let __ret: Result<u32, ToolError> = { __self.send(input) }; __ret }",
        )
        .unwrap();
        assert!(decide(&func, &uses_self, None).unwrap().is_none());
    }

    #[test]
    fn finish_on_mut_borrows_is_an_error() {
        let func: ItemFn = syn::parse_str(
            "async fn f(&mut self) -> Result<u32, ToolError> { self.n += 1; Ok(1) }",
        )
        .unwrap();
        let explicit = Some((OnCancel::Finish, Span::call_site()));
        assert!(decide(&func, &func.block, explicit).is_err());
    }
}
