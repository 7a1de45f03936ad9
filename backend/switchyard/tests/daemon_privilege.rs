//! What a request may make the daemon do to the filesystem (issue 34): endpoint sockets only
//! directly in the daemon's endpoint directory, for every caller (root included); another
//! place only through the configuration file.
#![forbid(unsafe_code)]

mod common;

use std::os::unix::net::UnixListener;

use common::daemon::{Daemon, api_status, socket_of};
use serde_json::json;

#[test]
fn a_request_names_a_socket_only_in_the_endpoint_directory() {
    let mut d = Daemon::new();
    d.launch();
    let c = d.client();
    let endpoints = d.run_dir().join("endpoints");
    // Another user's stale socket somewhere the caller could name.
    let elsewhere = tempfile::tempdir().expect("tempdir");
    let stale = elsewhere.path().join("stale.sock");
    drop(UnixListener::bind(&stale).expect("bind"));
    let refused = [
        "/etc/sy-test.sock".into(),
        "/root/sy-test.sock".into(),
        d.state().join("x.sock"),
        d.run_dir().join("x.sock"),
        endpoints.join("../x.sock"),
        endpoints.join("sub/x.sock"),
        endpoints.join(".hidden.sock"),
        endpoints.clone(),
        stale.clone(),
        "x.sock".into(),
    ];
    for (n, socket) in refused.iter().enumerate() {
        let id = format!("bad{n}");
        let (status, code) = api_status(c.post(
            "/v1/endpoints",
            &json!({"id": id, "pool": "default", "socket": socket}),
        ));
        assert_eq!(
            (status, code.as_str()),
            (422, "socket_outside_endpoint_dir"),
            "{}",
            socket.display()
        );
        if socket != &endpoints && socket != &stale {
            assert!(
                std::fs::symlink_metadata(socket).is_err(),
                "{} was created",
                socket.display()
            );
        }
        // The same through the CLI: an error naming the directory, exit 1.
        let out = d.ctl(&[
            "create",
            &id,
            "--pool",
            "default",
            "--endpoint-socket",
            &socket.to_string_lossy(),
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(
            err.contains("is not in the daemon's endpoint directory"),
            "{err}"
        );
    }
    // The stale socket elsewhere was left alone (not replaced by the daemon's).
    let m = std::fs::symlink_metadata(&stale).expect("still there");
    assert!(std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()));
    assert!(std::os::unix::net::UnixStream::connect(&stale).is_err());
    assert!(
        d.client()
            .get("/v1/endpoints")
            .expect("list")
            .body
            .as_array()
            .expect("a list")
            .is_empty()
    );

    // Positive control: a name of the caller's choosing in the endpoint directory.
    let mine = endpoints.join("mine.sock");
    d.ctl_ok(&[
        "create",
        "vm1",
        "--pool",
        "default",
        "--endpoint-socket",
        &mine.to_string_lossy(),
    ]);
    assert_eq!(socket_of(&d.endpoint("vm1")), mine);
    std::os::unix::net::UnixStream::connect(&mine).expect("it serves");
}

#[test]
fn the_configuration_file_may_place_a_socket_elsewhere() {
    let elsewhere = tempfile::tempdir().expect("tempdir");
    let socket = elsewhere.path().join("configured.sock");
    let mut d = Daemon::new().with_config(&format!(
        r#"
[[boards]]
id = "gpu0"
vram = "16M"

[[pools]]
name = "default"
boards = ["gpu0"]

[[endpoints]]
id = "vm1"
pool = "default"
socket = "{}"
"#,
        socket.display()
    ));
    d.launch();
    assert_eq!(socket_of(&d.endpoint("vm1")), socket);
    std::os::unix::net::UnixStream::connect(&socket).expect("it serves");
}
