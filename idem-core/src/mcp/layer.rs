//! [`Idempotent`]: the MCP rules (see [the module](super)) around any rmcp server.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use std::future::Future;

use futures_util::FutureExt;
use rmcp::model::*;
use rmcp::service::{MaybeSendFuture, NotificationContext, RequestContext, SubscriptionContext};
use rmcp::{RoleServer, ServerHandler};
use tokio_util::sync::CancellationToken;

use super::{Answer, Plan, Policy, WithoutRun};
use crate::store::Store;
use crate::tool::Tool as IdemTool;

/// An rmcp server whose side-effecting tools are idempotent: every `tools/call` of a
/// tool not declared read-only runs at most once per run and arguments, and a retry
/// gets the first result (see [the module](super) for the rules).
///
/// ```no_run
/// # async fn serve<S: rmcp::ServerHandler>(my_server: S) -> Result<(), Box<dyn std::error::Error>> {
/// use rmcp::ServiceExt;
///
/// let store = idem_core::default_store()?;
/// let service = idem_core::mcp::Idempotent::new(my_server).shared_store(store);
/// service.serve(rmcp::transport::stdio()).await?.waiting().await?;
/// # Ok(()) }
/// ```
///
/// Every other request and notification reaches the server unchanged; `tools/list`
/// gains `idempotentHint: true` on the tools it protects. A protected call whose
/// request is cancelled (`notifications/cancelled`, or the client hung up) answers at
/// once, while the tool runs to its end and records its result for the client's
/// retry: the server's handler gets a context whose cancellation token is not the
/// request's.
pub struct Idempotent<S> {
    inner: Arc<S>,
    policy: Policy,
    /// Each tool's `readOnlyHint` as the lists gave it, for a server whose
    /// [`ServerHandler::get_tool`] does not answer.
    listed: Arc<Mutex<Listed>>,
}

/// The tools' hints the lists gave.
#[derive(Default)]
struct Listed {
    hints: HashMap<String, Option<bool>>,
    /// Whether `hints` holds the server's whole list.
    whole: bool,
}

/// A handle on the same server, rules and tool list: what rmcp's streamable HTTP
/// service makes for each session.
impl<S> Clone for Idempotent<S> {
    fn clone(&self) -> Self {
        Idempotent {
            inner: Arc::clone(&self.inner),
            policy: self.policy.clone(),
            listed: Arc::clone(&self.listed),
        }
    }
}

impl<S: ServerHandler> Idempotent<S> {
    /// `server`, with [`Policy::new`]'s rules: records in idem's default store.
    pub fn new(server: S) -> Self {
        Idempotent::with_policy(server, Policy::new())
    }

    /// `server`, with `policy`'s rules.
    pub fn with_policy(server: S, policy: Policy) -> Self {
        Idempotent {
            inner: Arc::new(server),
            policy,
            listed: Arc::default(),
        }
    }

    /// Keeps the records in `store`: see [`Policy::store`].
    pub fn store(self, store: impl Store) -> Self {
        self.map_policy(|policy| policy.store(store))
    }

    /// Keeps the records in a store shared with other code: see
    /// [`Policy::shared_store`].
    pub fn shared_store(self, store: Arc<dyn Store>) -> Self {
        self.map_policy(|policy| policy.shared_store(store))
    }

    /// Reads the run id from `_meta[name]`: see [`Policy::run_meta_key`].
    pub fn run_meta_key(self, name: impl Into<Arc<str>>) -> Self {
        self.map_policy(|policy| policy.run_meta_key(name))
    }

    /// What a protected call without a run id gets: see [`Policy::without_run`].
    pub fn without_run(self, without_run: WithoutRun) -> Self {
        self.map_policy(|policy| policy.without_run(without_run))
    }

    /// Stores results with `isError: true` too: see [`Policy::store_tool_errors`].
    pub fn store_tool_errors(self) -> Self {
        self.map_policy(Policy::store_tool_errors)
    }

    /// Every protected tool's options: see [`Policy::defaults`].
    pub fn defaults(self, make: impl Fn(IdemTool) -> IdemTool + Send + Sync + 'static) -> Self {
        self.map_policy(|policy| policy.defaults(make))
    }

    /// Protects one tool with its own options: see [`Policy::tool`].
    pub fn tool(self, tool: IdemTool) -> Self {
        self.map_policy(|policy| policy.tool(tool))
    }

    /// Leaves one tool unprotected: see [`Policy::exempt`].
    pub fn exempt(self, name: impl Into<String>) -> Self {
        self.map_policy(|policy| policy.exempt(name))
    }

    /// The rules in force.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The wrapped server.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn map_policy(mut self, change: impl FnOnce(Policy) -> Policy) -> Self {
        self.policy = change(self.policy);
        self
    }

    fn listed(&self) -> std::sync::MutexGuard<'_, Listed> {
        self.listed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The tool's `readOnlyHint`: from the server's `get_tool`, else from the lists
    /// seen; a tool in none is looked up in the server's whole list first.
    async fn read_only_hint(
        &self,
        name: &str,
        context: &RequestContext<RoleServer>,
    ) -> Option<bool> {
        if let Some(tool) = self.inner.get_tool(name) {
            return tool.annotations.and_then(|a| a.read_only_hint);
        }
        {
            let listed = self.listed();
            if let Some(hint) = listed.hints.get(name) {
                return *hint;
            }
            if listed.whole {
                return None;
            }
        }
        let mut cursor = None;
        let mut hints = HashMap::new();
        for _ in 0..100 {
            let page = PaginatedRequestParams::default().with_cursor(cursor.take());
            let Ok(list) = self.inner.list_tools(Some(page), context.clone()).await else {
                break;
            };
            for tool in &list.tools {
                let read_only = tool.annotations.as_ref().and_then(|a| a.read_only_hint);
                hints.insert(tool.name.to_string(), read_only);
            }
            match list.next_cursor {
                Some(next) => cursor = Some(next),
                None => break,
            }
        }
        let mut listed = self.listed();
        listed.hints.extend(hints);
        listed.whole = true;
        listed.hints.get(name).copied().flatten()
    }

    fn mark_listed(&self, list: &mut ListToolsResult) {
        let mut listed = self.listed();
        for tool in &mut list.tools {
            let read_only = tool.annotations.as_ref().and_then(|a| a.read_only_hint);
            listed.hints.insert(tool.name.to_string(), read_only);
            self.mark(tool, read_only);
        }
    }

    /// `idempotentHint: true` on a tool the policy protects.
    fn mark(&self, tool: &mut Tool, read_only: Option<bool>) {
        if self.policy.protects(&tool.name, read_only) {
            tool.annotations
                .get_or_insert_with(Default::default)
                .idempotent_hint = Some(true);
        }
    }

    /// A `tools/call`: forwarded, or made idempotent by the policy.
    async fn protected_call(
        &self,
        call: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let read_only = self.read_only_hint(&call.name, &context).await;
        let meta = Some(&context.meta.0 .0);
        let protected = match self.policy.plan(&call.name, read_only, meta) {
            Plan::Forward => return self.inner.call_tool(call, context).await,
            Plan::Protect(protected) => protected,
        };
        let cancelled = context.ct.clone();
        let arguments = call.arguments.clone();
        let inner = Arc::clone(&self.inner);
        let mut context = context;
        // The tool runs to its end, and its result is recorded, whatever the client does.
        context.ct = CancellationToken::new();
        let run_meta_key = self.policy.run_key().to_owned();
        let answer = protected.call(arguments.as_ref(), move || async move {
            match inner.call_tool(call, context).await {
                Ok(CallToolResponse::Complete(result)) => serde_json::to_value(&result)
                    .map_err(|error| Err(ErrorData::internal_error(error.to_string(), None))),
                // Asks the client for input, or a task to poll: not an outcome to store.
                other => Err(other),
            }
        });
        // A tool that panics has its claim settled by idem (by the delivery policy); the
        // client gets an error instead of no answer at all.
        let answer = std::panic::AssertUnwindSafe(answer).catch_unwind();
        let answer = tokio::select! {
            answer = answer => match answer {
                Ok(answer) => answer,
                Err(_) => return Err(ErrorData::internal_error("the tool panicked", None)),
            },
            () = cancelled.cancelled() => {
                tracing::info!("idem: a tools/call request was cancelled; its call runs on and records its result for the retry");
                return Err(ErrorData::internal_error("request cancelled", None));
            }
        };
        match answer {
            Answer::Result(result) => serde_json::from_value::<CallToolResult>(result)
                .map(CallToolResponse::Complete)
                .map_err(|error| ErrorData::internal_error(error.to_string(), None)),
            Answer::Unstored(forwarded) => forwarded,
            Answer::Refused(error) => {
                let (code, message) = super::rpc_error(&error, &run_meta_key);
                Err(ErrorData::new(ErrorCode(code as i32), message, None))
            }
        }
    }
}

/// `tools/call` and `tools/list` as the module says; every other method is the
/// server's own.
#[allow(deprecated)] // rmcp marks sampling, roots and logging deprecated; they pass through.
impl<S: ServerHandler> ServerHandler for Idempotent<S> {
    fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<CallToolResponse, ErrorData>> + MaybeSendFuture + '_ {
        self.protected_call(request, context)
    }

    async fn list_tools(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let mut list = self.inner.list_tools(request, context).await?;
        self.mark_listed(&mut list);
        Ok(list)
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        let mut tool = self.inner.get_tool(name)?;
        let read_only = tool.annotations.as_ref().and_then(|a| a.read_only_hint);
        self.mark(&mut tool, read_only);
        Some(tool)
    }

    fn ping(
        &self,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<(), ErrorData>> + MaybeSendFuture + '_ {
        self.inner.ping(context)
    }

    fn initialize(
        &self,
        request: InitializeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<InitializeResult, ErrorData>> + MaybeSendFuture + '_ {
        self.inner.initialize(request, context)
    }

    fn negotiate_initialize(
        &self,
        request: &InitializeRequestParams,
    ) -> Result<InitializeResult, ErrorData> {
        self.inner.negotiate_initialize(request)
    }

    fn supported_protocol_versions(&self) -> Cow<'static, [ProtocolVersion]> {
        self.inner.supported_protocol_versions()
    }

    fn discover(
        &self,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<DiscoverResult, ErrorData>> + MaybeSendFuture + '_ {
        self.inner.discover(context)
    }

    fn complete(
        &self,
        request: CompleteRequestParams,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<CompleteResult, ErrorData>> + MaybeSendFuture + '_ {
        self.inner.complete(request, context)
    }

    fn set_level(
        &self,
        request: SetLevelRequestParams,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<(), ErrorData>> + MaybeSendFuture + '_ {
        self.inner.set_level(request, context)
    }

    fn get_prompt(
        &self,
        request: GetPromptRequestParams,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<GetPromptResponse, ErrorData>> + MaybeSendFuture + '_ {
        self.inner.get_prompt(request, context)
    }

    fn list_prompts(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<ListPromptsResult, ErrorData>> + MaybeSendFuture + '_ {
        self.inner.list_prompts(request, context)
    }

    fn list_resources(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<ListResourcesResult, ErrorData>> + MaybeSendFuture + '_ {
        self.inner.list_resources(request, context)
    }

    fn list_resource_templates(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<ListResourceTemplatesResult, ErrorData>> + MaybeSendFuture + '_
    {
        self.inner.list_resource_templates(request, context)
    }

    fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<ReadResourceResponse, ErrorData>> + MaybeSendFuture + '_ {
        self.inner.read_resource(request, context)
    }

    fn accepted_subscription_filter(
        &self,
        requested: &SubscriptionFilter,
    ) -> Option<SubscriptionFilter> {
        self.inner.accepted_subscription_filter(requested)
    }

    fn listen(
        &self,
        context: SubscriptionContext,
    ) -> impl Future<Output = Result<(), ErrorData>> + MaybeSendFuture + '_ {
        self.inner.listen(context)
    }

    fn subscribe(
        &self,
        request: SubscribeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<(), ErrorData>> + MaybeSendFuture + '_ {
        self.inner.subscribe(request, context)
    }

    fn unsubscribe(
        &self,
        request: UnsubscribeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<(), ErrorData>> + MaybeSendFuture + '_ {
        self.inner.unsubscribe(request, context)
    }

    fn on_custom_request(
        &self,
        request: CustomRequest,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<CustomResult, ErrorData>> + MaybeSendFuture + '_ {
        self.inner.on_custom_request(request, context)
    }

    fn on_cancelled(
        &self,
        notification: CancelledNotificationParam,
        context: NotificationContext<RoleServer>,
    ) -> impl Future<Output = ()> + MaybeSendFuture + '_ {
        self.inner.on_cancelled(notification, context)
    }

    fn on_progress(
        &self,
        notification: ProgressNotificationParam,
        context: NotificationContext<RoleServer>,
    ) -> impl Future<Output = ()> + MaybeSendFuture + '_ {
        self.inner.on_progress(notification, context)
    }

    fn on_initialized(
        &self,
        context: NotificationContext<RoleServer>,
    ) -> impl Future<Output = ()> + MaybeSendFuture + '_ {
        self.inner.on_initialized(context)
    }

    fn on_roots_list_changed(
        &self,
        context: NotificationContext<RoleServer>,
    ) -> impl Future<Output = ()> + MaybeSendFuture + '_ {
        self.inner.on_roots_list_changed(context)
    }

    fn on_custom_notification(
        &self,
        notification: CustomNotification,
        context: NotificationContext<RoleServer>,
    ) -> impl Future<Output = ()> + MaybeSendFuture + '_ {
        self.inner.on_custom_notification(notification, context)
    }

    fn get_info(&self) -> ServerConfig {
        self.inner.get_info()
    }

    fn get_task(
        &self,
        request: GetTaskParams,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<GetTaskResult, ErrorData>> + MaybeSendFuture + '_ {
        self.inner.get_task(request, context)
    }

    fn update_task(
        &self,
        request: UpdateTaskParams,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<(), ErrorData>> + MaybeSendFuture + '_ {
        self.inner.update_task(request, context)
    }

    fn cancel_task(
        &self,
        request: CancelTaskParams,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<(), ErrorData>> + MaybeSendFuture + '_ {
        self.inner.cancel_task(request, context)
    }

    fn list_skills(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<ListSkillsResult, ErrorData>> + MaybeSendFuture + '_ {
        self.inner.list_skills(request, context)
    }

    fn get_skill(
        &self,
        request: GetSkillRequestParams,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<GetSkillResult, ErrorData>> + MaybeSendFuture + '_ {
        self.inner.get_skill(request, context)
    }

    fn read_resource_directory(
        &self,
        request: ReadResourceDirectoryRequestParams,
        context: RequestContext<RoleServer>,
    ) -> impl Future<Output = Result<ReadResourceDirectoryResult, ErrorData>> + MaybeSendFuture + '_
    {
        self.inner.read_resource_directory(request, context)
    }
}

impl<S> std::fmt::Debug for Idempotent<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotent")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}
