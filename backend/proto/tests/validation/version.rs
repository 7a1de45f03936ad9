//! VERSION: the request, capabilities parsing and negotiation.

use super::*;

#[test]
fn version_request() {
    let v = |data: &[u8]| cat(&[&0u16.to_ne_bytes(), &0u16.to_ne_bytes(), data]);
    req_ok(VFIO_USER_VERSION, &v(b""), 0);
    req_ok(VFIO_USER_VERSION, &v(b"\0"), 0);
    req_ok(VFIO_USER_VERSION, &v(b"{}\0"), 0);
    assert_eq!(req_err(VFIO_USER_VERSION, &v(b"{}"), 0).errno(), EINVAL);
    assert_eq!(req_err(VFIO_USER_VERSION, &[0, 0], 0).errno(), EINVAL);
    assert_eq!(req_err(VFIO_USER_VERSION, &[], 0).errno(), EINVAL);
    assert_eq!(req_err(VFIO_USER_VERSION, &v(b"\0"), 1).errno(), EINVAL);
    assert_eq!(req_err(VFIO_USER_VERSION, &v(b"{\0}\0"), 0).errno(), EINVAL);
}

fn caps(json: &str) -> Result<Capabilities, ProtoError> {
    let mut d = json.as_bytes().to_vec();
    d.push(0);
    Capabilities::from_version_data(&d)
}

#[test]
fn caps_parsing() {
    assert_eq!(
        Capabilities::from_version_data(b""),
        Ok(Capabilities::default())
    );
    assert_eq!(
        Capabilities::from_version_data(b"\0"),
        Ok(Capabilities::default())
    );
    assert_eq!(caps("{}"), Ok(Capabilities::default()));
    assert_eq!(caps(r#"{"capabilities":{}}"#), Ok(Capabilities::default()));
    // QEMU's proposal
    let q = caps(
        r#"{"capabilities":{"migration":{"pgsize":4096,"max_bitmap_size":268435456},"max_msg_fds":16,
            "max_data_xfer_size":1048576,"pgsizes":4096,"max_dma_maps":65535,"write_multiple":true}}"#,
    )
    .expect("qemu caps");
    assert_eq!(q.max_msg_fds, 16);
    assert!(q.write_multiple);
    assert_eq!(
        q.migration,
        Some(MigrationCap {
            pgsize: 4096,
            max_bitmap_size: 256 << 20
        })
    );
    // rust crate / libvfio-user style (migration without max_bitmap_size, unknown keys)
    let r = caps(r#"{"capabilities":{"max_msg_fds":1,"max_data_xfer_size":1048576,"migration":{"pgsize":4096}}}"#).expect("ok");
    assert_eq!(
        r.migration,
        Some(MigrationCap {
            pgsize: 4096,
            max_bitmap_size: DEFAULT_MAX_BITMAP_SIZE
        })
    );
    let a =
        caps(r#"{"capabilities":{"max_fds":32,"max_data_xfer_size":1048576}}"#).expect("alioth");
    assert_eq!(a.max_msg_fds, DEFAULT_MAX_MSG_FDS);
    let t = caps(r#"{"capabilities":{"twin_socket":{"supported":true}}}"#).expect("twin");
    assert_eq!(
        t.twin_socket,
        Some(TwinSocketCap {
            supported: true,
            fd_index: None
        })
    );
    // libvfio-user test_negotiate failure cases
    for bad in [
        "{",
        "\"",
        r#"{ "capabilities": "23" }"#,
        r#"{ "capabilities": { "max_msg_fds": "foo" } }"#,
        r#"{ "capabilities": { "max_msg_fds": -1 } }"#,
        r#"{ "capabilities": { "max_msg_fds": 1025 } }"#,
        r#"{ "capabilities": { "migration": "23" } }"#,
        r#"{ "capabilities": { "migration": { "pgsize": "foo" } } }"#,
        r#"{ "capabilities": { "migration": { "pgsize": 4095 } } }"#,
        r#"{ "capabilities": { "max_data_xfer_size": 67108865 } }"#,
        r#"{ "capabilities": { "max_data_xfer_size": 0 } }"#,
        r#"{ "capabilities": { "pgsizes": 4097 } }"#,
        r#"{ "capabilities": { "max_dma_maps": 65536 } }"#,
        r#"{ "capabilities": { "write_multiple": 1 } }"#,
        r#"{ "capabilities": { "max_msg_fds": 1.5 } }"#,
        "[]",
    ] {
        assert_eq!(caps(bad).map_err(|e| e.errno()), Err(EINVAL), "{bad}");
    }
    assert_eq!(
        Capabilities::from_version_data(b"{}").map_err(|e| e.errno()),
        Err(EINVAL)
    );
}

#[test]
fn negotiation() {
    let server = ServerLimits::default();
    let client = caps(r#"{"capabilities":{"max_msg_fds":16,"pgsizes":12288,"write_multiple":true,"migration":{"pgsize":4096}}}"#)
        .expect("caps");
    let r = negotiate(&client, &server);
    assert_eq!(r.max_msg_fds, server.max_msg_fds);
    assert_eq!(r.max_data_xfer_size, server.max_data_xfer_size);
    assert_eq!(r.pgsizes, 4096);
    assert!(r.write_multiple);
    assert_eq!(r.migration, None, "server offers no migration cap");
    assert_eq!(r.twin_socket, None);
    let server2 = ServerLimits {
        migration: Some(MigrationCap {
            pgsize: 4096,
            max_bitmap_size: 1 << 20,
        }),
        twin_socket: true,
        write_multiple: false,
        ..ServerLimits::default()
    };
    let mut c2 = client.clone();
    c2.twin_socket = Some(TwinSocketCap {
        supported: true,
        fd_index: None,
    });
    let r = negotiate(&c2, &server2);
    assert_eq!(
        r.migration,
        Some(MigrationCap {
            pgsize: 4096,
            max_bitmap_size: 1 << 20
        })
    );
    assert_eq!(
        r.twin_socket,
        Some(TwinSocketCap {
            supported: true,
            fd_index: Some(0)
        })
    );
    assert!(!r.write_multiple);
    // negotiate_version
    assert_eq!(
        negotiate_version(1, 0, b"", &server).map_err(|e| e.errno()),
        Err(EINVAL)
    );
    let n = negotiate_version(0, 2, b"", &server).expect("ok");
    assert_eq!(n.minor, 0);
    assert_eq!(n.client, Capabilities::default());
    // Reply encoding: major 0 minor 0 + NUL-terminated JSON with max_msg_fds.
    let mut out = Vec::new();
    encode_version_reply(&mut out, 7, &n.reply).expect("encode");
    let h = Header::from_bytes(&out).expect("header");
    let Ok(Reply::Version(v)) = decode_reply(&h, &out[16..], 0) else {
        panic!("decode")
    };
    assert_eq!((v.major, v.minor), (0, 0));
    assert_eq!(v.data.last(), Some(&0));
    assert!(
        v.json()
            .expect("json")
            .expect("some")
            .contains("\"max_msg_fds\":8")
    );
    assert_eq!(v.capabilities(), Ok(n.reply));
}
