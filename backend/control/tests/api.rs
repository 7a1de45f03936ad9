//! Requests over a real UNIX socket: success, the JSON error shape of every refusal (handler,
//! extractor, router), and `GET /health` and `GET /metrics`.
#![forbid(unsafe_code)]

mod common;

use std::time::Duration;

use axum::http::StatusCode;
use common::{TestServer, socket_path};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use switchyard_control::{
    ApiError, ControlApi, ControlError, Json, Metrics, OPENMETRICS_CONTENT_TYPE, Path, RawReply,
};
use switchyard_proto::Command;

#[derive(Debug, Deserialize)]
struct NewItem {
    name: String,
    size: u32,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Item {
    id: u32,
    name: String,
    size: u32,
}

async fn create(Json(new): Json<NewItem>) -> Result<(StatusCode, Json<Item>), ApiError> {
    if new.size == 0 {
        return Err(ApiError::unprocessable(
            "empty_item",
            "An item needs a size above 0",
        ));
    }
    Ok((
        StatusCode::CREATED,
        Json(Item {
            id: 1,
            name: new.name,
            size: new.size,
        }),
    ))
}

async fn fetch(Path(id): Path<u32>) -> Result<Json<Item>, ApiError> {
    match id {
        1 => Ok(Json(Item {
            id,
            name: "one".into(),
            size: 1,
        })),
        _ => Err(ApiError::not_found("no_such_item", format!("No item {id}"))),
    }
}

async fn remove(Path(_id): Path<u32>) -> StatusCode {
    StatusCode::NO_CONTENT
}

fn server(metrics: Metrics) -> (tempfile::TempDir, TestServer) {
    let (dir, path) = socket_path();
    let (router, _doc) = ControlApi::new("test", "0")
        .health()
        .metrics()
        .merge(
            axum::Router::new()
                .route("/items", axum::routing::post(create))
                .route("/items/{id}", axum::routing::get(fetch).delete(remove))
                .into(),
        )
        .build(metrics);
    let server = TestServer::start(&path, router).expect("bind");
    (dir, server)
}

/// The reply is exactly `{"error": {"code": CODE, "message": "..."}}` with `status`, sent as
/// JSON; returns the message.
fn assert_error(reply: &RawReply, status: u16, code: &str) -> String {
    assert_eq!(reply.status, status, "{reply:?}");
    assert_eq!(reply.content_type.as_deref(), Some("application/json"));
    let body: Value = serde_json::from_slice(&reply.body).expect("a JSON body");
    let Value::Object(top) = &body else {
        panic!("not an object: {body}")
    };
    assert_eq!(top.len(), 1, "{body}");
    let Value::Object(error) = &top["error"] else {
        panic!("no error object: {body}")
    };
    assert_eq!(error.len(), 2, "{body}");
    assert_eq!(error["code"], code, "{body}");
    let message = error["message"].as_str().expect("a string message");
    assert!(!message.is_empty());
    message.to_owned()
}

#[test]
fn typed_route_succeeds() {
    let (_dir, server) = server(Metrics::new());
    let client = server.client();
    let reply = client
        .post("/items", &json!({"name": "a", "size": 3}))
        .expect("created");
    assert_eq!(reply.status, 201);
    assert_eq!(
        reply.json::<Item>().expect("an item"),
        Item {
            id: 1,
            name: "a".into(),
            size: 3
        }
    );
    let reply = client.get("/items/1").expect("found");
    assert_eq!(reply.body["name"], "one");
    let reply = client.delete("/items/1").expect("deleted");
    assert_eq!((reply.status, reply.body), (204, Value::Null));
}

#[test]
fn handler_error_is_decoded_by_the_client() {
    let (_dir, server) = server(Metrics::new());
    let client = server.client();
    let raw = client.request("GET", "/items/7", None).expect("a reply");
    assert_eq!(assert_error(&raw, 404, "no_such_item"), "No item 7");
    match client.get("/items/7") {
        Err(ControlError::Api {
            status: 404,
            code,
            message,
        }) => assert_eq!(
            (code.as_str(), message.as_str()),
            ("no_such_item", "No item 7")
        ),
        other => panic!("expected the API error, got {other:?}"),
    }
    let refused = client.post("/items", &json!({"name": "a", "size": 0}));
    assert!(
        matches!(&refused, Err(ControlError::Api { status: 422, code, .. }) if code == "empty_item"),
        "{refused:?}"
    );
}

#[test]
fn unknown_path_is_a_json_404() {
    let (_dir, server) = server(Metrics::new());
    let reply = server
        .client()
        .request("GET", "/no/such/thing", None)
        .expect("a reply");
    let message = assert_error(&reply, 404, "not_found");
    assert!(message.contains("/no/such/thing"), "{message}");
}

#[test]
fn wrong_method_is_a_json_405() {
    let (_dir, server) = server(Metrics::new());
    let client = server.client();
    // A route with one method, and one added by ControlApi.
    assert_error(
        &client.request("GET", "/items", None).expect("a reply"),
        405,
        "method_not_allowed",
    );
    assert_error(
        &client
            .request("POST", "/health", Some(("application/json", b"{}")))
            .expect("a reply"),
        405,
        "method_not_allowed",
    );
    // A route with two methods refuses a third.
    assert_error(
        &client.request("PUT", "/items/1", None).expect("a reply"),
        405,
        "method_not_allowed",
    );
}

#[test]
fn malformed_json_is_a_json_400() {
    let (_dir, server) = server(Metrics::new());
    let reply = server
        .client()
        .request("POST", "/items", Some(("application/json", b"{\"name\":")))
        .expect("a reply");
    assert_error(&reply, 400, "malformed_json");
}

#[test]
fn wrong_content_type_is_a_json_415() {
    let (_dir, server) = server(Metrics::new());
    let client = server.client();
    let body = br#"{"name": "a", "size": 3}"#;
    assert_error(
        &client
            .request("POST", "/items", Some(("text/plain", body)))
            .expect("a reply"),
        415,
        "unsupported_media_type",
    );
    // No content type at all.
    let reply = client.request("POST", "/items", None).expect("a reply");
    assert_error(&reply, 415, "unsupported_media_type");
}

#[test]
fn missing_field_and_wrong_type_are_json_422() {
    let (_dir, server) = server(Metrics::new());
    let client = server.client();
    let reply = client
        .request(
            "POST",
            "/items",
            Some(("application/json", br#"{"name": "a"}"#)),
        )
        .expect("a reply");
    let message = assert_error(&reply, 422, "invalid_body");
    assert!(message.contains("size"), "{message}");
    let reply = client
        .request(
            "POST",
            "/items",
            Some(("application/json", br#"{"name": "a", "size": -1}"#)),
        )
        .expect("a reply");
    assert_error(&reply, 422, "invalid_body");
}

#[test]
fn bad_path_parameter_is_a_json_400() {
    let (_dir, server) = server(Metrics::new());
    let reply = server
        .client()
        .request("GET", "/items/abc", None)
        .expect("a reply");
    assert_error(&reply, 400, "invalid_path");
}

#[test]
fn oversized_body_is_a_json_413() {
    let (_dir, server) = server(Metrics::new());
    // axum's default limit is 2 MiB.
    let mut body = br#"{"name": ""#.to_vec();
    body.resize(3 << 20, b'x');
    body.extend_from_slice(br#"", "size": 1}"#);
    let reply = server
        .client()
        .request("POST", "/items", Some(("application/json", &body)))
        .expect("a reply");
    assert_error(&reply, 413, "unreadable_body");
}

#[test]
fn client_refuses_a_target_it_cannot_send() {
    let (_dir, server) = server(Metrics::new());
    let client = server.client();
    for bad in ["items", "/items x", "/items\r\nX: y", ""] {
        assert!(
            matches!(client.get(bad), Err(ControlError::BadRequestPath(_))),
            "{bad:?}"
        );
    }
}

#[test]
fn health_answers() {
    let (_dir, server) = server(Metrics::new());
    let reply = server.client().get("/health").expect("healthy");
    assert_eq!(reply.body, json!({"status": "ok"}));
}

#[test]
fn metrics_endpoint_serves_observations() {
    let metrics = Metrics::new();
    let ep = metrics.endpoint("ep0");
    ep.observe(Command::RegionRead, Duration::from_micros(3));
    ep.observe(Command::RegionRead, Duration::from_micros(40));
    ep.observe(Command::DmaMap, Duration::from_millis(2));
    let board = metrics.board("gpu0");
    board.add_jobs(5);
    board.moved(Duration::from_micros(1500));
    let (_dir, server) = server(metrics);
    let client = server.client();
    let raw = client.request("GET", "/metrics", None).expect("a reply");
    assert_eq!(raw.status, 200);
    assert_eq!(raw.content_type.as_deref(), Some(OPENMETRICS_CONTENT_TYPE));
    let text = client.get_text("/metrics").expect("metrics");
    for line in [
        r#"switchyard_endpoint_messages_total{endpoint="ep0",command="REGION_READ"} 2"#,
        r#"switchyard_endpoint_messages_total{endpoint="ep0",command="DMA_MAP"} 1"#,
        r#"switchyard_endpoint_request_duration_seconds_count{endpoint="ep0"} 3"#,
        r#"switchyard_board_jobs_total{board="gpu0"} 5"#,
        r#"switchyard_board_moves_total{board="gpu0"} 1"#,
        r#"switchyard_board_last_move_downtime_seconds{board="gpu0"} 0.0015"#,
        "# EOF",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "missing {line:?} in:\n{text}"
        );
    }
}
