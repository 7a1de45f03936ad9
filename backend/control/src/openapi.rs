//! The API's router and its OpenAPI document, built together ([`ControlApi`]), the routes this
//! crate provides (`GET /health`, `GET /metrics`, `GET /events`), and the check that keeps a
//! committed document in step with the code ([`check_openapi_file`]).
//!
//! Routes are added with utoipa-axum: a handler annotated with `#[utoipa::path(...)]` goes in
//! with `utoipa_axum::routes!(handler)`, so a route cannot be served without being documented,
//! nor documented without being served.

use std::borrow::Cow;
use std::fmt;
use std::fs;
use std::io;
use std::path::Path;

use axum::extract::{FromRef, State};
use axum::response::Response;
use serde::{Deserialize, Serialize};
use utoipa::openapi::content::ContentBuilder;
use utoipa::openapi::path::{HttpMethod, OperationBuilder, ParameterIn, PathItem, PathsBuilder};
use utoipa::openapi::response::ResponseBuilder;
use utoipa::openapi::schema::{ComponentsBuilder, OneOfBuilder, Schema};
use utoipa::openapi::{InfoBuilder, OpenApi, OpenApiBuilder, Ref, RefOr};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::{OpenApiRouter, UtoipaMethodRouter};
use utoipa_axum::routes;

use crate::ControlError;
use crate::api::{ErrorBody, JSON, Json, json_fallbacks, text_reply};
use crate::events::{
    Events, EventsQuery, NDJSON_CONTENT_TYPE, Sequenced, StreamNotice, events_handler,
};
use crate::metrics::{Metrics, OPENMETRICS_CONTENT_TYPE};

/// The tag of this crate's own routes in the document.
pub const CONTROL_TAG: &str = "control";

/// The environment variable that makes [`check_openapi_file`] rewrite the file.
pub const UPDATE_ENV: &str = "UPDATE_OPENAPI";

/// Builds the router and its OpenAPI document together.
///
/// ```
/// use switchyard_control::{ControlApi, Events, Metrics, Sequenced};
/// # #[derive(Clone, serde::Serialize, utoipa::ToSchema)]
/// # struct Event { seq: u64 }
/// # impl Sequenced for Event { fn seq(&self) -> u64 { self.seq } }
/// #[derive(Clone)]
/// struct AppState {
///     metrics: Metrics,
///     events: Events<Event>,
/// }
/// // (or #[derive(FromRef)] with axum's `macros` feature)
/// impl axum::extract::FromRef<AppState> for Metrics {
///     fn from_ref(state: &AppState) -> Self { state.metrics.clone() }
/// }
/// impl axum::extract::FromRef<AppState> for Events<Event> {
///     fn from_ref(state: &AppState) -> Self { state.events.clone() }
/// }
/// let state = AppState { metrics: Metrics::new(), events: Events::new(1024, 256) };
/// let (router, doc) = ControlApi::new("Switchyard pool daemon", "0.1.0")
///     .health()
///     .metrics()
///     .events::<Event>()
///     // .routes(utoipa_axum::routes!(list_endpoints)) for the daemon's own handlers
///     .build(state);
/// # let _ = (router, doc);
/// ```
pub struct ControlApi<S = ()> {
    router: OpenApiRouter<S>,
}

impl<S> fmt::Debug for ControlApi<S>
where
    S: Clone + Send + Sync + 'static,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let doc = self.router.get_openapi();
        f.debug_struct("ControlApi")
            .field("title", &doc.info.title)
            .field("paths", &doc.paths.paths.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl<S> ControlApi<S>
where
    S: Clone + Send + Sync + 'static,
{
    /// An API with no routes yet, whose document is titled `title` at `version` and has the
    /// [`ErrorBody`] schema every error reply uses.
    pub fn new(title: &str, version: &str) -> Self {
        let mut schemas = Vec::new();
        collect_schemas::<ErrorBody>(&mut schemas);
        let doc = OpenApiBuilder::new()
            .info(
                InfoBuilder::new()
                    .title(title)
                    .version(version)
                    .description(Some(
                        "HTTP/JSON on a UNIX socket. Every error reply is an ErrorBody: \
                         {\"error\": {\"code\": ..., \"message\": ...}} with a 4xx or 5xx status.",
                    ))
                    .build(),
            )
            .components(Some(
                ComponentsBuilder::new().schemas_from_iter(schemas).build(),
            ))
            .build();
        Self {
            router: OpenApiRouter::with_openapi(doc),
        }
    }

    /// Replaces the document's description.
    pub fn description(mut self, text: &str) -> Self {
        self.router.get_openapi_mut().info.description = Some(text.to_owned());
        self
    }

    /// Adds documented routes: `routes(utoipa_axum::routes!(handler_a, handler_b))` (handlers
    /// of one path).
    pub fn routes(mut self, routes: UtoipaMethodRouter<S>) -> Self {
        self.router = self.router.routes(routes);
        self
    }

    /// Adds every route of `router` (and its document).
    pub fn merge(mut self, router: OpenApiRouter<S>) -> Self {
        self.router = self.router.merge(router);
        self
    }

    /// Adds `GET /health` ([`health`]).
    pub fn health(self) -> Self {
        self.routes(routes!(health))
    }

    /// Adds `GET /metrics` ([`metrics`]) for the [`Metrics`] in the state.
    pub fn metrics(self) -> Self
    where
        Metrics: FromRef<S>,
    {
        self.routes(routes!(metrics))
    }

    /// Adds `GET /events` ([`events_handler`]) for the [`Events<T>`] in the state, documented as
    /// a stream of `T` and [`StreamNotice`] lines.
    pub fn events<T>(self) -> Self
    where
        T: ToSchema + Serialize + Sequenced + Clone + Send + Sync + 'static,
        Events<T>: FromRef<S>,
    {
        self.routes(events_route::<T, S>())
    }

    /// The document so far.
    pub fn openapi(&self) -> &OpenApi {
        self.router.get_openapi()
    }

    /// The router, finished with JSON 404/405 replies ([`json_fallbacks`]) and given its state,
    /// and the document.
    pub fn build(self, state: S) -> (axum::Router, OpenApi) {
        let (router, doc) = self.router.split_for_parts();
        (json_fallbacks(router).with_state(state), doc)
    }
}

fn collect_schemas<T: ToSchema>(out: &mut Vec<(String, RefOr<Schema>)>) {
    out.push((T::name().into_owned(), T::schema()));
    T::schemas(out);
}

/// The body of `GET /health`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Health {
    /// Always `ok`: the daemon answers.
    pub status: Cow<'static, str>,
}

/// `GET /health`: `{"status":"ok"}` while the daemon serves its API.
#[utoipa::path(
    get,
    path = "/health",
    tag = CONTROL_TAG,
    operation_id = "health",
    summary = "Whether the daemon answers",
    responses((status = 200, description = "The daemon answers", body = Health))
)]
pub async fn health() -> Json<Health> {
    Json(Health {
        status: Cow::Borrowed("ok"),
    })
}

/// `GET /metrics`: every metric in the OpenMetrics text format.
#[utoipa::path(
    get,
    path = "/metrics",
    tag = CONTROL_TAG,
    operation_id = "metrics",
    summary = "Prometheus metrics: per endpoint, per board, daemon-wide",
    responses((
        status = 200,
        description = "Metrics, OpenMetrics 1.0 text (Prometheus scrapes it)",
        body = String,
        content_type = "application/openmetrics-text; version=1.0.0; charset=utf-8"
    ))
)]
pub async fn metrics(State(metrics): State<Metrics>) -> Response {
    text_reply(OPENMETRICS_CONTENT_TYPE, metrics.encode())
}

fn events_route<T, S>() -> UtoipaMethodRouter<S>
where
    T: ToSchema + Serialize + Sequenced + Clone + Send + Sync + 'static,
    Events<T>: FromRef<S>,
    S: Clone + Send + Sync + 'static,
{
    let mut schemas = Vec::new();
    collect_schemas::<T>(&mut schemas);
    collect_schemas::<StreamNotice>(&mut schemas);
    collect_schemas::<ErrorBody>(&mut schemas);
    let line = OneOfBuilder::new()
        .item(Ref::from_schema_name(T::name()))
        .item(Ref::from_schema_name(StreamNotice::name()));
    let error = ContentBuilder::new()
        .schema(Some(Ref::from_schema_name(ErrorBody::name())))
        .build();
    let operation = OperationBuilder::new()
        .tag(CONTROL_TAG)
        .operation_id(Some("events"))
        .summary(Some("Lifecycle events as they happen"))
        .description(Some(
            "Newline-delimited JSON, one event per line; the body stays open until the daemon \
             stops. A `{\"type\":\"lagged\",\"missed\":N}` line stands where N events were \
             dropped (a slow reader, or `since` older than the replay buffer).",
        ))
        .parameters(Some(EventsQuery::into_params(|| Some(ParameterIn::Query))))
        .response(
            "200",
            ResponseBuilder::new()
                .description("One JSON value per line: an event or a stream notice")
                .content(
                    NDJSON_CONTENT_TYPE,
                    ContentBuilder::new().schema(Some(line)).build(),
                )
                .build(),
        )
        .response(
            "400",
            ResponseBuilder::new()
                .description("A bad query string")
                .content(JSON, error.clone())
                .build(),
        )
        .response(
            "503",
            ResponseBuilder::new()
                .description("The daemon is shutting down")
                .content(JSON, error)
                .build(),
        )
        .build();
    let paths = PathsBuilder::new()
        .path("/events", PathItem::new(HttpMethod::Get, operation))
        .build();
    (schemas, paths, axum::routing::get(events_handler::<T>))
}

/// Compares the committed OpenAPI document at `path` with `doc` (pretty JSON and a newline);
/// with `UPDATE_OPENAPI=1` in the environment it rewrites the file instead. For a test:
///
/// ```no_run
/// # let doc = utoipa::openapi::OpenApi::default();
/// switchyard_control::check_openapi_file(&doc, "docs/control-api.json".as_ref())
///     .unwrap_or_else(|e| panic!("{e}"));
/// ```
///
/// A difference is [`ControlError::OpenApiDrift`], whose message names the first differing
/// line and how to rewrite the file.
pub fn check_openapi_file(doc: &OpenApi, path: &Path) -> Result<(), ControlError> {
    let update = std::env::var_os(UPDATE_ENV).is_some_and(|v| v == "1");
    check_openapi_file_with(doc, path, update)
}

/// [`check_openapi_file`] with the choice made by the caller: `update` rewrites a missing or
/// different file instead of failing.
pub fn check_openapi_file_with(
    doc: &OpenApi,
    path: &Path,
    update: bool,
) -> Result<(), ControlError> {
    let mut generated = doc.to_pretty_json().map_err(ControlError::EncodeOpenApi)?;
    generated.push('\n');
    let committed = match fs::read_to_string(path) {
        Ok(text) => Some(text),
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(source) => {
            return Err(ControlError::OpenApiFile {
                path: path.to_owned(),
                source,
            });
        }
    };
    if committed.as_deref() == Some(generated.as_str()) {
        return Ok(());
    }
    if update {
        if let Some(parent) = path.parent()
            && !parent.as_os_str().is_empty()
        {
            fs::create_dir_all(parent).map_err(|source| ControlError::OpenApiFile {
                path: path.to_owned(),
                source,
            })?;
        }
        fs::write(path, &generated).map_err(|source| ControlError::OpenApiFile {
            path: path.to_owned(),
            source,
        })?;
        tracing::info!(file = %path.display(), "OpenAPI document rewritten");
        return Ok(());
    }
    let Some(committed) = committed else {
        return Err(ControlError::OpenApiMissing(path.to_owned()));
    };
    let mut committed_lines = committed.lines();
    let mut generated_lines = generated.lines();
    let mut line = 1;
    loop {
        match (committed_lines.next(), generated_lines.next()) {
            (Some(c), Some(g)) if c == g => line += 1,
            (None, None) => {
                return Err(ControlError::OpenApiDrift {
                    path: path.to_owned(),
                    line,
                    committed: "(the same lines, other line ends)".to_owned(),
                    generated: "(lines ending in \\n, a final newline)".to_owned(),
                });
            }
            (c, g) => {
                return Err(ControlError::OpenApiDrift {
                    path: path.to_owned(),
                    line,
                    committed: c.unwrap_or("(end of file)").trim().to_owned(),
                    generated: g.unwrap_or("(end of file)").trim().to_owned(),
                });
            }
        }
    }
}
