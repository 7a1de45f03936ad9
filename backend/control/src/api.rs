//! The JSON error shape every failed request gets, and extractors that produce it.
//!
//! A handler returns `Result<_, ApiError>`; a request the router or an extractor refuses
//! (unknown path, wrong method, malformed JSON, wrong content type, a missing field, a bad
//! query string or path parameter) comes out in the same shape, so a client decodes one thing:
//!
//! ```json
//! {"error": {"code": "malformed_json", "message": "Failed to parse the request body as JSON: ..."}}
//! ```
//!
//! For that, handlers take this module's [`Json`], [`Query`] and [`Path`] instead of axum's, and
//! the router is finished with [`json_fallbacks`] (done by [`crate::ControlApi::build`]).

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// A failed request: an HTTP status (4xx or 5xx), a stable machine-readable `code` (snake
/// case, e.g. `not_found`, `busy`) and a sentence for people.
///
/// Rendered as [`ErrorBody`]: `{"error": {"code": ..., "message": ...}}`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message} ({code}, {status})")]
pub struct ApiError {
    /// The HTTP status; anything that is not a 4xx or 5xx is sent as 500.
    pub status: StatusCode,
    /// Stable machine-readable code.
    pub code: &'static str,
    /// Human-readable message, a sentence.
    pub message: String,
}

impl ApiError {
    /// An error with any status. A status that is not a client or server error is sent as
    /// 500 (an error reply must never look like success).
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }

    /// 400 Bad Request.
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, code, message)
    }

    /// 404 Not Found (an unknown id).
    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, code, message)
    }

    /// 409 Conflict (a busy board, a move during a migration, ...).
    pub fn conflict(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, code, message)
    }

    /// 422 Unprocessable Entity (well-formed, but refused: an incompatible target, ...).
    pub fn unprocessable(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNPROCESSABLE_ENTITY, code, message)
    }

    /// 500 Internal Server Error, code `internal`.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }

    /// The status actually sent.
    pub fn effective_status(&self) -> StatusCode {
        if self.status.is_client_error() || self.status.is_server_error() {
            self.status
        } else {
            StatusCode::INTERNAL_SERVER_ERROR
        }
    }

    /// The body sent.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                code: self.code.to_owned(),
                message: self.message.clone(),
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.effective_status();
        if status.is_server_error() {
            tracing::warn!(
                code = self.code,
                status = status.as_u16(),
                "{}",
                self.message
            );
        } else {
            tracing::debug!(
                code = self.code,
                status = status.as_u16(),
                "{}",
                self.message
            );
        }
        (status, axum::Json(self.body())).into_response()
    }
}

/// The body of every error reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    /// What went wrong.
    pub error: ErrorDetail,
}

/// The `error` member of an `ErrorBody`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ErrorDetail {
    /// Stable machine-readable code (snake case).
    pub code: String,
    /// Human-readable message.
    pub message: String,
}

impl From<JsonRejection> for ApiError {
    fn from(r: JsonRejection) -> Self {
        // The server's body read timeout ([`crate::BODY_READ_TIMEOUT`]), under axum's layers.
        let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&r);
        while let Some(e) = source {
            if let Some(timeout @ crate::ControlError::BodyTimeout(_)) = e.downcast_ref() {
                return Self::new(
                    StatusCode::REQUEST_TIMEOUT,
                    "body_timeout",
                    timeout.to_string(),
                );
            }
            source = e.source();
        }
        let code = match &r {
            JsonRejection::JsonSyntaxError(_) => "malformed_json",
            JsonRejection::JsonDataError(_) => "invalid_body",
            JsonRejection::MissingJsonContentType(_) => "unsupported_media_type",
            JsonRejection::BytesRejection(_) => "unreadable_body",
            _ => "bad_request",
        };
        Self::new(r.status(), code, r.body_text())
    }
}

impl From<QueryRejection> for ApiError {
    fn from(r: QueryRejection) -> Self {
        Self::new(r.status(), "invalid_query", r.body_text())
    }
}

impl From<PathRejection> for ApiError {
    fn from(r: PathRejection) -> Self {
        Self::new(r.status(), "invalid_path", r.body_text())
    }
}

/// A JSON body in (extractor) or out (response), like `axum::Json`, but a refused request body
/// becomes an [`ApiError`]: `malformed_json` (400), `invalid_body` (422: a missing field, a
/// wrong type), `unsupported_media_type` (415: no `Content-Type: application/json`),
/// `unreadable_body` (the body could not be read, e.g. 413 past the size limit), `body_timeout`
/// (408: the body did not arrive within the server's [`crate::BODY_READ_TIMEOUT`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct Json<T>(pub T);

impl<T, S> FromRequest<S> for Json<T>
where
    axum::Json<T>: FromRequest<S, Rejection = JsonRejection>,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let axum::Json(value) = axum::Json::<T>::from_request(req, state).await?;
        Ok(Self(value))
    }
}

impl<T: Serialize> IntoResponse for Json<T> {
    fn into_response(self) -> Response {
        axum::Json(self.0).into_response()
    }
}

/// Query string parameters, like `axum::extract::Query`, refused as `invalid_query` (400).
#[derive(Debug, Clone, Copy, Default)]
pub struct Query<T>(pub T);

impl<T, S> FromRequestParts<S> for Query<T>
where
    axum::extract::Query<T>: FromRequestParts<S, Rejection = QueryRejection>,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let axum::extract::Query(value) =
            axum::extract::Query::<T>::from_request_parts(parts, state).await?;
        Ok(Self(value))
    }
}

/// Path parameters, like `axum::extract::Path`, refused as `invalid_path` (400, or 500 when
/// the route has no such parameter: a bug in the router, not the request).
#[derive(Debug, Clone, Copy, Default)]
pub struct Path<T>(pub T);

impl<T, S> FromRequestParts<S> for Path<T>
where
    axum::extract::Path<T>: FromRequestParts<S, Rejection = PathRejection>,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let axum::extract::Path(value) =
            axum::extract::Path::<T>::from_request_parts(parts, state).await?;
        Ok(Self(value))
    }
}

/// The fallback for a path no route matches: 404, code `not_found`.
pub async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::not_found("not_found", format!("No route for {method} {}", uri.path()))
}

/// The fallback for a route that exists without the request's method: 405, code
/// `method_not_allowed` (axum still adds the `Allow` header).
pub async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("{} does not take {method}", uri.path()),
    )
}

/// Makes the router's own refusals JSON errors: unknown paths ([`not_found`]) and unknown
/// methods ([`method_not_allowed`]). Call it last, once every route is in (axum applies the 405
/// fallback to the routes present at the time).
pub fn json_fallbacks<S>(router: axum::Router<S>) -> axum::Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    router
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(not_found)
}

/// The `Content-Type` of JSON replies.
pub(crate) const JSON: &str = "application/json";

/// A reply with a text body and a content type.
pub(crate) fn text_reply(content_type: &'static str, body: String) -> Response {
    ([(header::CONTENT_TYPE, content_type)], body).into_response()
}
