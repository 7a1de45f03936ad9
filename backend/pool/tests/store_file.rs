//! The store's file (issue 34): an empty, truncated or foreign file is refused with its path,
//! never re-initialised and never a panic; the file is left as it was; a new store is
//! private (0600) whatever the umask; `move_aside` keeps a damaged store for its
//! administrator.
#![forbid(unsafe_code)]

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

mod common;
use common::{KINDS, config, in_pool};
use switchyard_pool::{Pool, PoolError, StoreDamage};

const CONFIG: &str = r#"
[daemon]
endpoint_dir = "/run/sy"

[[boards]]
id = "gpu0"
[[boards]]
id = "gpu1"

[[pools]]
name = "default"
boards = ["gpu0", "gpu1"]
"#;

fn open(path: &Path) -> Result<Pool, PoolError> {
    Pool::open(&config(CONFIG), KINDS, path).map(|(pool, _)| pool)
}

/// A store with one endpoint; its bytes.
fn good_store(path: &Path) -> Vec<u8> {
    let mut pool = open(path).expect("a new store");
    pool.create_endpoint(&in_pool("vm1", "default"))
        .expect("create");
    drop(pool);
    std::fs::read(path).expect("read")
}

#[test]
fn a_damaged_store_is_refused_with_its_path_and_left_as_it_is() {
    let dir = tempfile::tempdir().expect("tempdir");
    let good = good_store(&dir.path().join("pool.redb"));
    let n = good.len();
    assert!(n > 3 * 4096, "{n}");
    // Empty, cut anywhere (in the magic number, the header, the first page, the regions,
    // one byte short), and not a redb file at all.
    let mut cases: Vec<(String, Vec<u8>)> =
        [0, 5, 100, 320, 4095, 4096, 8192, n / 2, n - 4096, n - 1]
            .into_iter()
            .map(|len| (format!("cut to {len} bytes"), good[..len].to_vec()))
            .collect();
    cases.push(("not a redb file".into(), vec![b'x'; n]));
    let mut failures = Vec::new();
    for (i, (name, bytes)) in cases.iter().enumerate() {
        let path = dir.path().join(format!("case{i}.redb"));
        std::fs::write(&path, bytes).expect("write");
        let opened = std::panic::catch_unwind(|| open(&path).map(drop));
        let failure = match opened {
            Err(_) => Some("panicked".to_owned()),
            Ok(Ok(())) => Some("opened".to_owned()),
            Ok(Err(e @ PoolError::StoreDamaged { .. })) => {
                let PoolError::StoreDamaged {
                    path: named,
                    problem,
                } = &e
                else {
                    unreachable!()
                };
                let wanted = match bytes.len() {
                    0 => matches!(problem, StoreDamage::Empty),
                    _ if bytes[0] == b'x' => matches!(problem, StoreDamage::NotRedb),
                    _ => matches!(problem, StoreDamage::Truncated { .. }),
                };
                if named != &path || !e.to_string().contains(&path.display().to_string()) {
                    Some(format!("the error does not name the file: {e}"))
                } else if !wanted {
                    Some(format!("wrong problem: {e}"))
                } else {
                    None
                }
            }
            Ok(Err(e)) => Some(format!("another error: {e:?}")),
        };
        if std::fs::read(&path).expect("still there") != *bytes {
            failures.push(format!("{name}: the file was changed"));
        }
        if let Some(f) = failure {
            failures.push(format!("{name}: {f}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // Positive control: the whole file opens, with its endpoint.
    let path = dir.path().join("whole.redb");
    std::fs::write(&path, &good).expect("write");
    let pool = open(&path).expect("the whole store opens");
    assert!(pool.inventory().endpoint("vm1").is_some());
}

#[test]
fn a_damaged_store_moved_aside_is_kept_and_a_new_one_made() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("pool.redb");
    let good = good_store(&path);
    std::fs::write(&path, &good[..good.len() / 2]).expect("truncate");
    let e = open(&path).expect_err("truncated");
    assert!(e.is_damaged(), "{e:?}");
    let aside = switchyard_pool::move_aside(&path).expect("moved aside");
    assert_eq!(aside.parent(), path.parent());
    assert!(
        aside
            .file_name()
            .expect("name")
            .to_string_lossy()
            .starts_with("pool.redb.damaged-"),
        "{}",
        aside.display()
    );
    assert_eq!(std::fs::read(&aside).expect("kept"), good[..good.len() / 2]);
    assert!(!path.exists());
    let pool = open(&path).expect("a new store");
    assert!(pool.inventory().endpoint("vm1").is_none(), "a fresh store");
    drop(pool);
    // A second one moved aside in the same second does not replace the first.
    std::fs::write(&path, b"").expect("empty");
    let second = switchyard_pool::move_aside(&path).expect("moved aside");
    assert_ne!(second, aside);
    assert!(aside.exists() && second.exists());
}

#[test]
fn a_new_store_is_private_whatever_the_umask() {
    let dir = tempfile::tempdir().expect("tempdir");
    // The umask is the process's: this file's other tests do not depend on it.
    let old = rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o002));
    let path = dir.path().join("pool.redb");
    let opened = open(&path).map(drop);
    // Positive control: a file made now under this umask is group-writable.
    let control = dir.path().join("control");
    std::fs::write(&control, b"").expect("write");
    rustix::process::umask(old);
    opened.expect("a new store");
    let mode = |p: &Path| std::fs::metadata(p).expect("meta").permissions().mode() & 0o777;
    assert_eq!(mode(&control), 0o664);
    assert_eq!(mode(&path), 0o600);
    // Nothing else left in the directory (the temporary name was renamed).
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .expect("dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
}

/// A store in a directory whose name is not UTF-8 is moved aside next to itself, its path's
/// bytes kept as they are.
#[test]
fn a_store_under_a_name_that_is_not_utf8_is_moved_aside_beside_itself() {
    use std::os::unix::ffi::OsStrExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let sub = dir.path().join(std::ffi::OsStr::from_bytes(b"state\xff"));
    std::fs::create_dir(&sub).expect("mkdir");
    let path = sub.join("pool.redb");
    std::fs::write(&path, b"").expect("empty");
    let aside = switchyard_pool::move_aside(&path).expect("moved aside");
    assert_eq!(aside.parent(), Some(sub.as_path()));
    assert_eq!(std::fs::read(&aside).expect("kept"), b"");
    assert!(!path.exists());
}
