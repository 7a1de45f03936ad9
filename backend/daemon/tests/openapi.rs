//! The committed OpenAPI document of the daemon's control API (`docs/control-api.json`) is
//! the code's. After an intended API change: `UPDATE_OPENAPI=1 cargo test -p
//! switchyard-daemon --test openapi`, and commit the file.
#![forbid(unsafe_code)]

use std::path::PathBuf;

#[test]
fn the_committed_document_is_the_codes() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/control-api.json");
    let doc = switchyard_daemon::app::api::openapi();
    if let Err(e) = switchyard_control::check_openapi_file(&doc, &path) {
        panic!("{e}");
    }
    for present in [
        "/v1/boards",
        "/v1/boards/{id}/quarantine",
        "/v1/pools",
        "/v1/endpoints",
        "/v1/endpoints/{id}/restart",
        "/v1/endpoints/{id}/upgrade",
        "/v1/endpoints/{id}/move",
        "/v1/boards/{id}/drain",
        "/v1/endpoints/{id}/detach",
        "/v1/endpoints/{id}/attach",
        "/v1/endpoints/{id}/vmm",
        "/events",
        "/metrics",
        "/health",
    ] {
        assert!(doc.paths.paths.contains_key(present), "{present} missing");
    }
}
