//! The metrics text: every family with its labels after observations, the latency buckets,
//! and removal of an endpoint's or a board's series.
#![forbid(unsafe_code)]

use std::time::Duration;

use switchyard_control::{LATENCY_BUCKETS, Metrics, command_name};
use switchyard_proto::Command;

fn has_line(text: &str, line: &str) -> bool {
    text.lines().any(|l| l == line)
}

#[test]
fn families_and_labels_after_observations() {
    let metrics = Metrics::new();
    let ep = metrics.endpoint("ep-a");
    ep.observe(Command::RegionWrite, Duration::from_micros(2));
    ep.observe(Command::RegionWrite, Duration::from_micros(2));
    ep.count(Command::MigDataRead, 7);
    // A second handle of the same endpoint records into the same series.
    metrics
        .endpoint("ep-a")
        .observe(Command::RegionWrite, Duration::from_millis(300));
    let board = metrics.board("b0");
    board.add_jobs(3);
    board.add_bytes(4096);
    board.add_errors(1);
    board.moved(Duration::from_millis(2));
    board.moved(Duration::from_micros(750));
    metrics.endpoint_restarted();
    ep.restarted(Some(Duration::from_millis(40)));
    ep.restarted(None);
    metrics.upgraded();
    metrics.upgraded();
    let text = metrics.encode();
    for line in [
        "# TYPE switchyard_endpoint_messages counter",
        r#"switchyard_endpoint_messages_total{endpoint="ep-a",command="REGION_WRITE"} 3"#,
        r#"switchyard_endpoint_messages_total{endpoint="ep-a",command="MIG_DATA_READ"} 7"#,
        "# TYPE switchyard_endpoint_request_duration_seconds histogram",
        r#"switchyard_endpoint_request_duration_seconds_count{endpoint="ep-a"} 3"#,
        r#"switchyard_endpoint_request_duration_seconds_bucket{le="0.0000025",endpoint="ep-a"} 2"#,
        r#"switchyard_endpoint_request_duration_seconds_bucket{le="0.25",endpoint="ep-a"} 2"#,
        r#"switchyard_endpoint_request_duration_seconds_bucket{le="0.5",endpoint="ep-a"} 3"#,
        r#"switchyard_endpoint_request_duration_seconds_bucket{le="+Inf",endpoint="ep-a"} 3"#,
        r#"switchyard_board_jobs_total{board="b0"} 3"#,
        r#"switchyard_board_bytes_total{board="b0"} 4096"#,
        r#"switchyard_board_errors_total{board="b0"} 1"#,
        r#"switchyard_board_moves_total{board="b0"} 2"#,
        r#"switchyard_board_last_move_downtime_seconds{board="b0"} 0.00075"#,
        "switchyard_endpoint_restarts_total 1",
        r#"switchyard_endpoint_worker_restarts_total{endpoint="ep-a"} 2"#,
        r#"switchyard_endpoint_last_restart_seconds{endpoint="ep-a"} 0.04"#,
        "switchyard_upgrades_total 2",
        "# EOF",
    ] {
        assert!(has_line(&text, line), "missing {line:?} in:\n{text}");
    }
    // One bucket per bound plus +Inf.
    let buckets = text
        .lines()
        .filter(|l| l.starts_with("switchyard_endpoint_request_duration_seconds_bucket"))
        .count();
    assert_eq!(buckets, LATENCY_BUCKETS.len() + 1);
    // Commands never seen have no series.
    assert!(!text.contains("DMA_MAP"), "{text}");
}

#[test]
fn removed_endpoints_and_boards_leave_the_text() {
    let metrics = Metrics::new();
    for id in ["keep", "drop"] {
        metrics
            .endpoint(id)
            .observe(Command::RegionRead, Duration::from_micros(1));
        metrics.endpoint(id).count(Command::DmaMap, 1);
        metrics.board(id).add_jobs(1);
    }
    assert!(metrics.remove_endpoint("drop"));
    assert!(metrics.remove_board("drop"));
    assert!(!metrics.remove_endpoint("drop"), "removed twice");
    assert!(!metrics.remove_board("never"));
    let text = metrics.encode();
    assert!(!text.contains(r#""drop""#), "{text}");
    assert!(has_line(
        &text,
        r#"switchyard_endpoint_messages_total{endpoint="keep",command="DMA_MAP"} 1"#
    ));
    assert!(has_line(
        &text,
        r#"switchyard_board_jobs_total{board="keep"} 1"#
    ));
    // A new endpoint of the same name starts from zero.
    metrics.endpoint("drop").count(Command::DmaMap, 1);
    assert!(has_line(
        &metrics.encode(),
        r#"switchyard_endpoint_messages_total{endpoint="drop",command="DMA_MAP"} 1"#
    ));
}

#[test]
fn every_command_has_its_spec_name() {
    for command in Command::ALL {
        let name = command_name(command);
        assert!(
            name.bytes().all(|b| b.is_ascii_uppercase() || b == b'_'),
            "{name}"
        );
    }
    assert_eq!(command_name(Command::RegionRead), "REGION_READ");
    assert_eq!(
        command_name(Command::DeviceGetRegionIoFds),
        "DEVICE_GET_REGION_IO_FDS"
    );
}

#[test]
fn batches_reported_by_a_data_path_process_add_up_with_observations() {
    let metrics = Metrics::new();
    let ep = metrics.endpoint("w");
    ep.observe(Command::RegionRead, Duration::from_micros(3));
    // 2 requests ≤ 1 µs, 1 ≤ 5 µs, 1 beyond 1 s.
    let mut buckets = vec![0u64; LATENCY_BUCKETS.len() + 1];
    buckets[0] = 2;
    buckets[2] = 1;
    buckets[LATENCY_BUCKETS.len()] = 1;
    ep.add_requests(
        &[(Command::RegionRead, 3), (Command::DmaMap, 1)],
        &buckets,
        2.5,
    );
    let text = metrics.encode();
    for line in [
        r#"switchyard_endpoint_messages_total{endpoint="w",command="REGION_READ"} 4"#,
        r#"switchyard_endpoint_messages_total{endpoint="w",command="DMA_MAP"} 1"#,
        r#"switchyard_endpoint_request_duration_seconds_count{endpoint="w"} 5"#,
        r#"switchyard_endpoint_request_duration_seconds_bucket{le="0.000001",endpoint="w"} 2"#,
        r#"switchyard_endpoint_request_duration_seconds_bucket{le="0.000005",endpoint="w"} 4"#,
        r#"switchyard_endpoint_request_duration_seconds_bucket{le="1.0",endpoint="w"} 4"#,
        r#"switchyard_endpoint_request_duration_seconds_bucket{le="+Inf",endpoint="w"} 5"#,
    ] {
        assert!(has_line(&text, line), "missing {line:?} in:\n{text}");
    }
}
