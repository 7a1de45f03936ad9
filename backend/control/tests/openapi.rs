//! The OpenAPI document of this crate's routes: committed and checked against the code
//! (`UPDATE_OPENAPI=1 cargo test -p switchyard-control --test openapi` rewrites it), what it
//! documents is what the router serves, and the drift check's failures.
#![forbid(unsafe_code)]

mod common;

use std::fs;
use std::path::Path;

use common::{TestServer, socket_path};
use serde::Serialize;
use switchyard_control::{
    ControlApi, ControlError, Events, Metrics, Sequenced, check_openapi_file,
    check_openapi_file_with,
};

/// The committed document.
const COMMITTED: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/control-api.json");

/// A stand-in for the daemon's event type.
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
enum DemoEvent {
    /// An endpoint was created.
    EndpointCreated {
        /// Sequence number.
        seq: u64,
        /// The endpoint.
        endpoint: String,
    },
}

impl Sequenced for DemoEvent {
    fn seq(&self) -> u64 {
        match self {
            DemoEvent::EndpointCreated { seq, .. } => *seq,
        }
    }
}

#[derive(Clone)]
struct State {
    metrics: Metrics,
    events: Events<DemoEvent>,
}

impl axum::extract::FromRef<State> for Metrics {
    fn from_ref(s: &State) -> Self {
        s.metrics.clone()
    }
}

impl axum::extract::FromRef<State> for Events<DemoEvent> {
    fn from_ref(s: &State) -> Self {
        s.events.clone()
    }
}

fn api(state: State) -> (axum::Router, utoipa::openapi::OpenApi) {
    ControlApi::new("Switchyard control routes", "0.1.0")
        .health()
        .metrics()
        .events::<DemoEvent>()
        .build(state)
}

fn state() -> State {
    State {
        metrics: Metrics::new(),
        events: Events::new(8, 8),
    }
}

#[test]
fn committed_document_matches_the_code() {
    let (_, doc) = api(state());
    check_openapi_file(&doc, Path::new(COMMITTED)).unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn document_has_the_routes_and_the_shared_schemas() {
    let (_, doc) = api(state());
    let paths: Vec<&str> = doc.paths.paths.keys().map(String::as_str).collect();
    assert_eq!(paths, ["/events", "/health", "/metrics"]);
    let schemas = &doc.components.as_ref().expect("components").schemas;
    for name in [
        "ErrorBody",
        "ErrorDetail",
        "StreamNotice",
        "DemoEvent",
        "Health",
    ] {
        assert!(schemas.contains_key(name), "no {name} schema");
    }
    let json = serde_json::to_value(&doc).expect("serializes");
    let events_200 = &json["paths"]["/events"]["get"]["responses"]["200"]["content"];
    assert!(
        events_200.get("application/x-ndjson").is_some(),
        "{events_200}"
    );
    assert_eq!(
        json["paths"]["/events"]["get"]["parameters"][0]["name"],
        "since"
    );
}

/// Every documented operation is served (none falls through to the 404 fallback).
#[test]
fn every_documented_route_is_served() {
    let state = state();
    state
        .events
        .publish(DemoEvent::EndpointCreated {
            seq: 1,
            endpoint: "ep0".to_owned(),
        })
        .expect("publish");
    // A closed hub answers /events at once (503) instead of streaming.
    state.events.close();
    let (router, doc) = api(state);
    let (_dir, path) = socket_path();
    let server = TestServer::start(&path, router).expect("bind");
    let client = server.client();
    let json = serde_json::to_value(&doc).expect("serializes");
    let paths = json["paths"].as_object().expect("paths");
    assert!(!paths.is_empty());
    for (path, item) in paths {
        for method in item.as_object().expect("a path item").keys() {
            let reply = client
                .request(&method.to_uppercase(), path, None)
                .expect("a reply");
            assert_ne!(
                reply.status, 404,
                "{method} {path} is documented, not served"
            );
            assert_ne!(
                reply.status, 405,
                "{method} {path} is documented, not served"
            );
        }
    }
}

#[test]
fn drift_names_the_line_and_how_to_rewrite() {
    let (_, doc) = api(state());
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("api.json");
    check_openapi_file_with(&doc, &file, true).expect("written");
    check_openapi_file_with(&doc, &file, false).expect("now equal");
    let text = fs::read_to_string(&file).expect("read");
    let changed = text.replacen("\"/health\"", "\"/healthz\"", 1);
    assert_ne!(changed, text);
    fs::write(&file, &changed).expect("write");
    match check_openapi_file_with(&doc, &file, false) {
        Err(e @ ControlError::OpenApiDrift { line, .. }) => {
            let expected_line = text
                .lines()
                .position(|l| l.contains("\"/health\""))
                .expect("the path is in the document")
                + 1;
            assert_eq!(line, expected_line);
            let message = e.to_string();
            assert!(message.contains("/healthz"), "{message}");
            assert!(message.contains("UPDATE_OPENAPI=1"), "{message}");
        }
        other => panic!("expected drift, got {other:?}"),
    }
    // Nothing was rewritten by the failed check; the update mode does rewrite.
    assert_eq!(fs::read_to_string(&file).expect("read"), changed);
    check_openapi_file_with(&doc, &file, true).expect("rewritten");
    assert_eq!(fs::read_to_string(&file).expect("read"), text);
}

#[test]
fn missing_document_is_reported_or_created() {
    let (_, doc) = api(state());
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("docs/api.json");
    match check_openapi_file_with(&doc, &file, false) {
        Err(e @ ControlError::OpenApiMissing(_)) => {
            assert!(e.to_string().contains("UPDATE_OPENAPI=1"), "{e}");
        }
        other => panic!("expected missing, got {other:?}"),
    }
    assert!(!file.exists());
    check_openapi_file_with(&doc, &file, true).expect("created with its directory");
    check_openapi_file_with(&doc, &file, false).expect("now equal");
}
