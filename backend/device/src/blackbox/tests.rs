use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use super::*;

fn specs() -> Vec<RecordSpec> {
    vec![
        RecordSpec::new("dev.hot", 1000),
        RecordSpec::new("server.rx", 70_000),
    ]
}

fn reopen(bb: &BlackBox) -> Arc<BlackBox> {
    BlackBox::open(bb.file().try_clone().expect("dup")).expect("open")
}

#[test]
fn publishes_are_read_back_by_another_mapping() {
    let bb = BlackBox::create(&specs()).expect("create");
    let mut hot = bb.record("dev.hot").expect("record");
    let mut rx = bb.record("server.rx").expect("record");
    assert_eq!(hot.read().expect("read"), None, "never published");
    hot.publish(b"first").expect("publish");
    hot.publish_parts(&[b"sec", b"ond"]).expect("publish");
    rx.publish(&[7u8; 70_000]).expect("a full record");
    let other = reopen(&bb);
    assert_eq!(other.layout(), specs());
    assert_eq!(
        other
            .record("dev.hot")
            .expect("record")
            .read()
            .expect("read"),
        Some(b"second".to_vec())
    );
    assert_eq!(other.record("dev.hot").expect("record").generation(), 2);
    assert_eq!(
        other
            .record("server.rx")
            .expect("record")
            .read()
            .expect("read"),
        Some(vec![7u8; 70_000])
    );
    // An empty publish is a publish.
    hot.publish(&[]).expect("publish");
    assert_eq!(hot.read().expect("read"), Some(Vec::new()));
}

#[test]
fn bad_layouts_and_oversized_publishes_are_refused() {
    for bad in [
        vec![RecordSpec::new("", 1)],
        vec![RecordSpec::new("a b", 1)],
        vec![RecordSpec::new("x".repeat(MAX_NAME + 1), 1)],
        vec![RecordSpec::new("a", 1), RecordSpec::new("a", 2)],
        vec![RecordSpec::new("a", MAX_CAPACITY + 1)],
        (0..=MAX_RECORDS)
            .map(|i| RecordSpec::new(format!("r{i}"), 1))
            .collect(),
    ] {
        let err = BlackBox::create(&bad).expect_err("refused");
        assert!(matches!(err, BlackBoxError::Layout(_)), "{err}");
    }
    let bb = BlackBox::create(&specs()).expect("create");
    let mut hot = bb.record("dev.hot").expect("record");
    hot.publish(b"kept").expect("publish");
    let err = hot.publish(&[0u8; 1001]).expect_err("too large");
    assert!(
        matches!(
            err,
            BlackBoxError::TooLarge {
                len: 1001,
                capacity: 1000,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(
        hot.read().expect("read"),
        Some(b"kept".to_vec()),
        "unchanged"
    );
    assert!(matches!(bb.record("nope"), Err(BlackBoxError::NoRecord(_))));
}

#[test]
fn open_refuses_files_that_are_not_sealed_black_boxes() {
    let plain = tempfile_in_memory(8192, false);
    let err = BlackBox::open(plain).expect_err("unsealed");
    assert!(err.to_string().contains("sealed"), "{err}");
    let garbage = tempfile_in_memory(8192, true);
    let err = BlackBox::open(garbage).expect_err("no magic");
    assert!(matches!(err, BlackBoxError::Format(_)), "{err}");
}

fn tempfile_in_memory(size: u64, sealed: bool) -> File {
    let mfd = memfd::MemfdOptions::default()
        .allow_sealing(true)
        .create("test")
        .expect("memfd");
    mfd.as_file().set_len(size).expect("size");
    if sealed {
        mfd.add_seals(&[memfd::FileSeal::SealShrink]).expect("seal");
    }
    mfd.into_file()
}

#[test]
fn a_damaged_current_copy_is_reported_not_returned() {
    let bb = BlackBox::create(&specs()).expect("create");
    let mut hot = bb.record("dev.hot").expect("record");
    hot.publish(b"good").expect("publish");
    // Flip a byte of the current copy's data.
    let at = hot.copy_at(hot.generation()) + COPY_HEADER;
    bb.slice().write_obj(b'X', at).expect("poke");
    assert!(matches!(hot.read(), Err(BlackBoxError::Corrupt(_))));
}

/// The child side of `a_writer_killed_mid_publish_leaves_a_whole_publish`: publishes records
/// whose bytes all equal their sequence number (mod 251), forever.
#[test]
#[ignore = "child process of a_writer_killed_mid_publish_leaves_a_whole_publish"]
fn black_box_writer_child() {
    let Ok(path) = std::env::var("BLACK_BOX_PATH") else {
        return;
    };
    // Opening /proc/PID/fd/N of a memfd opens the same memory.
    let file = File::options()
        .read(true)
        .write(true)
        .open(path)
        .expect("open the parent's memfd");
    let bb = BlackBox::open(file).expect("open");
    let mut rec = bb.record("server.rx").expect("record");
    let mut buf = vec![0u8; 60_000];
    println!("ready");
    for i in 0u64.. {
        let b = (i % 251) as u8;
        let len = 1 + (i as usize).wrapping_mul(7919) % buf.len();
        buf[..len].fill(b);
        // In parts, so that bytes are written during (almost) the whole publish: a kill
        // anywhere in it hits a half-written copy.
        let parts: Vec<&[u8]> = buf[..len].chunks(1000).collect();
        rec.publish_parts(&parts).expect("publish");
    }
}

#[test]
fn a_writer_killed_mid_publish_leaves_a_whole_publish() {
    use std::io::BufRead;
    use std::os::fd::AsRawFd;
    let bb = BlackBox::create(&specs()).expect("create");
    let path = format!("/proc/{}/fd/{}", std::process::id(), bb.file().as_raw_fd());
    let exe = std::env::current_exe().expect("test binary");
    let mut last_generation = 0;
    for round in 0..20u64 {
        let mut child = Command::new(&exe)
            .args([
                "--exact",
                "blackbox::tests::black_box_writer_child",
                "--include-ignored",
                "--nocapture",
            ])
            .env("BLACK_BOX_PATH", &path)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("spawn the writer");
        let mut out = std::io::BufReader::new(child.stdout.take().expect("stdout"));
        let mut line = String::new();
        while !line.contains("ready") {
            line.clear();
            assert!(
                out.read_line(&mut line).expect("read") > 0,
                "writer exited early"
            );
        }
        // Kill at a different point of a publish each round.
        std::thread::sleep(Duration::from_micros(2_000 + round * 1_313));
        child.kill().expect("SIGKILL");
        child.wait().expect("reap");
        let rec = reopen(&bb).record("server.rx").expect("record");
        let generation = rec.generation();
        assert!(
            generation > last_generation,
            "round {round}: the writer published"
        );
        last_generation = generation;
        let bytes = rec.read().expect("a whole publish").expect("published");
        let first = bytes[0];
        assert!(
            bytes.iter().all(|&b| b == first),
            "round {round}: a torn publish ({} bytes, first {first})",
            bytes.len()
        );
    }
}
