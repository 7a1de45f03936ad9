//! Helpers shared by the test files.
#![allow(dead_code)] // each test file uses some

pub mod kinds;

pub use kinds::KINDS;
use switchyard_pool::{EndpointSpec, PoolConfig};

/// The configuration `text` with the test kinds.
pub fn config(text: &str) -> PoolConfig {
    PoolConfig::from_toml(text, KINDS).expect("config")
}

/// An endpoint leasing from `pool`.
pub fn in_pool(id: &str, pool: &str) -> EndpointSpec {
    EndpointSpec {
        id: id.into(),
        pool: Some(pool.into()),
        ..EndpointSpec::default()
    }
}

/// An endpoint leasing `device`.
pub fn on_device(id: &str, device: &str) -> EndpointSpec {
    EndpointSpec {
        id: id.into(),
        device: Some(device.into()),
        ..EndpointSpec::default()
    }
}
