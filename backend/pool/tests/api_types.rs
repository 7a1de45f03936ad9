//! What the control API layer relies on: the public types publish OpenAPI schemas, errors
//! and the pool cross threads.
#![forbid(unsafe_code)]

use switchyard_pool::{
    BoardView, ByteSize, DeviceView, Endpoint, EndpointSpec, ErrorKind, Event, EventKind, MovePlan,
    OpenReport, Placement, Pool, PoolConfig, PoolError, PoolView,
};
use utoipa::openapi::ComponentsBuilder;

#[test]
fn the_public_types_have_openapi_schemas() {
    let components = ComponentsBuilder::new()
        .schema_from::<BoardView>()
        .schema_from::<DeviceView>()
        .schema_from::<PoolView>()
        .schema_from::<Endpoint>()
        .schema_from::<EndpointSpec>()
        .schema_from::<Placement>()
        .schema_from::<MovePlan>()
        .schema_from::<Event>()
        .schema_from::<EventKind>()
        .schema_from::<OpenReport>()
        .schema_from::<ErrorKind>()
        .schema_from::<PoolConfig>()
        .build();
    let json = serde_json::to_value(&components).expect("json");
    let schemas = &json["schemas"];
    for name in [
        "BoardView",
        "Endpoint",
        "EventKind",
        "MovePlan",
        "PoolConfig",
    ] {
        assert!(schemas[name].is_object(), "no schema for {name}: {json}");
    }
    // The event kinds are tagged by `type`, as serde writes them.
    let kinds = schemas["EventKind"]["oneOf"].as_array().expect("oneOf");
    assert!(kinds.iter().any(|k| {
        k["properties"]["type"]["enum"]
            .as_array()
            .is_some_and(|v| v.iter().any(|t| t == "lease_moved"))
    }));
    // Sizes are documented as an integer or a suffixed string.
    let size = serde_json::to_value(<ByteSize as utoipa::PartialSchema>::schema()).expect("json");
    assert_eq!(size["oneOf"].as_array().map(Vec::len), Some(2), "{size}");
}

#[test]
fn errors_and_the_pool_cross_threads() {
    fn send_sync<T: Send + Sync + 'static>() {}
    send_sync::<PoolError>();
    send_sync::<Pool>();
    send_sync::<Event>();
}

#[test]
fn error_kinds_serialize_for_the_api() {
    assert_eq!(
        serde_json::to_string(&ErrorKind::NotFound).expect("json"),
        "\"not_found\""
    );
    assert_eq!(
        PoolError::UnknownPool("x".into()).kind(),
        ErrorKind::NotFound
    );
}
