//! A hostile client against a real `switchyard serve` process: memory that changes under the
//! server (truncated files, filesystems with no room for a hole), windows sized to exhaust the
//! server's memory, descriptors the kernel drops at the open-file limit, and a client that
//! stops reading its replies. The server must survive each, fail only what the client broke,
//! and keep serving.
#![forbid(unsafe_code)]

mod common;

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use common::ServerProcess;
use common::driver::{Driver, GUEST_IOVA, WINDOW_SIZE, guest, wait_eventfd};
use common::ours::Ours;
use common::raw::{Raw, message};
use common::{GuestMemory, wait_for};
use switchyard_client::Client;
use switchyard_proto::consts::*;
use switchyard_softgpu::cmd::{Command, Operand};
use switchyard_softgpu::regs::*;

fn connect(server: &ServerProcess) -> Client {
    Client::connect(&server.socket).expect("connect")
}

/// Waits for the queue's error, checks its code and address and the error vector, then
/// recovers the queue.
fn expect_dma_error<T: common::driver::Transport>(d: &mut Driver<T>, q: u32, addr: u64) {
    assert_eq!(d.wait_queue(q), Q_STATUS_ERROR);
    assert_eq!(d.r32(queue_reg(q, Q_ERROR_CODE)), ERR_DMA_UNMAPPED);
    assert_eq!(d.r64(queue_reg(q, Q_ERROR_ADDR_LO)), addr);
    assert!(
        wait_eventfd(&d.error[q as usize], Duration::from_secs(30)).is_some(),
        "error vector of queue {q}"
    );
    d.w32(INT_ACK, int_error(q));
    d.w32(
        queue_reg(q, Q_CONTROL),
        Q_CONTROL_RECOVER | Q_CONTROL_ENABLE,
    );
}

/// A full workload from a fresh client on fresh (sealed) memory: the server is healthy.
fn later_client_is_served(server: &ServerProcess) {
    // The device keeps its state across clients (a queue may still be in error): a VMM resets
    // it when it starts, so does this one.
    let mut c = connect(server);
    c.device_reset().expect("reset");
    let mut d = Driver::new(Ours(c));
    d.setup_queue(0);
    d.run(0, &[Command::fill(guest(0x1000), 64, 0x600d_600d)]);
    assert_eq!(d.mem.read_u64(0x1000), 0x600d_600d_600d_600d);
}

#[test]
fn truncating_guest_memory_fails_the_command_not_the_server() {
    let mut server = ServerProcess::start("softgpu");
    let mem = GuestMemory::unsealed(2 * WINDOW_SIZE);
    let client_file = mem.file.try_clone().expect("clone");
    let mut d = Driver::with_memory(Ours(connect(&server)), mem);
    d.setup_queue(0);
    d.run(0, &[Command::fill(guest(WINDOW_SIZE + 0x1000), 64, 1)]);

    // Window 1 loses its backing: a FILL and a COPY into it fail with a DMA error.
    client_file.set_len(WINDOW_SIZE).expect("shrink");
    d.submit(0, &[Command::fill(guest(WINDOW_SIZE + 0x1000), 64, 2)]);
    expect_dma_error(&mut d, 0, GUEST_IOVA + WINDOW_SIZE + 0x1000);
    d.submit(
        0,
        &[Command::copy(
            Operand::Vram(0),
            guest(WINDOW_SIZE + 0x2000),
            4096,
        )],
    );
    expect_dma_error(&mut d, 0, GUEST_IOVA + WINDOW_SIZE + 0x2000);
    // Window 0 is unaffected.
    d.run(0, &[Command::fill(guest(0x8000), 64, 3)]);
    assert_eq!(d.mem.read_u64(0x8000), 0x0000_0003_0000_0003);

    // Now the ring itself: the command is in place, then the memory under it goes away, then
    // the doorbell. The fetch fails cleanly.
    let tail = d.r32(queue_reg(0, Q_TAIL));
    let slot = u64::from(tail & (common::driver::RING_ENTRIES - 1));
    d.mem
        .write(slot * 64, &Command::fill(guest(0x8000), 64, 4).encode());
    client_file.set_len(0).expect("truncate everything");
    d.w32(queue_reg(0, Q_DOORBELL), tail.wrapping_add(1));
    let st = wait_for(Duration::from_secs(30), || {
        (d.r32(queue_reg(0, Q_STATUS)) == Q_STATUS_ERROR).then_some(())
    });
    assert!(st.is_some(), "the queue stops on the ring fetch");
    assert_eq!(d.r32(queue_reg(0, Q_ERROR_CODE)), ERR_RING_FETCH);
    assert!(wait_eventfd(&d.error[0], Duration::from_secs(30)).is_some());
    assert!(
        server.alive(),
        "the server survived:\n{}",
        server.log_text()
    );
    drop(d);
    later_client_is_served(&server);
}

#[test]
#[ignore = "needs root"]
fn a_hole_on_a_full_filesystem_fails_the_command_not_the_server() {
    // A tmpfs of 256 KiB, filled up, holding a sparse 32 MiB file: a device write into a hole
    // needs a page the filesystem cannot give (a store through a mapping would be SIGBUS).
    let dir = tempfile::tempdir().expect("tempdir");
    let mnt = dir.path().join("small");
    std::fs::create_dir(&mnt).expect("mkdir");
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=256k", "tmpfs"])
        .arg(&mnt)
        .status()
        .expect("run mount");
    assert!(
        mounted.success(),
        "this test mounts a small tmpfs and needs root"
    );
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(&self.0)
                .status();
        }
    }
    let _unmount = Unmount(mnt.clone());
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(mnt.join("guest-ram"))
        .expect("file");
    file.set_len(2 * WINDOW_SIZE).expect("sparse");
    let mem = GuestMemory {
        file,
        size: 2 * WINDOW_SIZE,
    };
    // The ring's page gets its backing now; then the filesystem fills up.
    mem.write(0, &[0u8; 4096]);
    let filler = std::fs::File::create(mnt.join("filler")).expect("filler");
    let chunk = vec![0x11u8; 4096];
    let mut w = &filler;
    while std::io::Write::write_all(&mut w, &chunk).is_ok() {}

    let mut server = ServerProcess::start("softgpu");
    let mut d = Driver::with_memory(Ours(connect(&server)), mem);
    d.setup_queue(0);
    // The command goes in the ring page, which has its page.
    d.submit(0, &[Command::fill(guest(0x20_0000), 4096, 5)]);
    expect_dma_error(&mut d, 0, GUEST_IOVA + 0x20_0000);
    assert!(
        server.alive(),
        "the server survived:\n{}",
        server.log_text()
    );
    drop(d);
    later_client_is_served(&server);
}

/// Resident memory of a process, in KiB.
fn rss_kib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

#[test]
fn windows_sized_to_exhaust_memory_are_refused() {
    let mut server = ServerProcess::start("softgpu");
    let mut c = connect(&server);
    let flags = VFIO_USER_F_DMA_REGION_READ | VFIO_USER_F_DMA_REGION_WRITE;
    // 2^50 bytes of sparse memfd cost the client nothing; the server cannot map it.
    let huge = memfd::MemfdOptions::default()
        .create("huge")
        .expect("memfd")
        .into_file();
    huge.set_len(1 << 50).expect("sparse");
    let e = c
        .dma_map(1 << 50, 1 << 50, flags, Some((huge.as_fd(), 0)))
        .expect_err("too large to map");
    assert_eq!(e.remote_errno(), Some(libc::ENOMEM));
    // 2^44 can be mapped, and costs nothing until logging starts; its bitmaps (1 GiB) are
    // over the budget, so logging is refused and nothing is allocated.
    let before = rss_kib(server.pid());
    c.dma_map(1 << 44, 1 << 44, flags, Some((huge.as_fd(), 0)))
        .expect("2^44 window");
    let e = c.dma_logging_start(4096, &[]).expect_err("over budget");
    assert_eq!(e.remote_errno(), Some(libc::ENOMEM));
    let grew = rss_kib(server.pid()).saturating_sub(before);
    assert!(grew < 64 << 10, "RSS grew by {grew} KiB");
    // Without that window, logging works.
    c.dma_unmap(1 << 44, 1 << 44, 0).expect("unmap");
    c.dma_logging_start(4096, &[]).expect("start");
    assert!(server.alive(), "{}", server.log_text());
}

/// The lowest descriptor number a process has free: with its limit there, it can open none.
fn lowest_free_fd(pid: i32) -> u64 {
    let used: std::collections::BTreeSet<u64> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fd dir")
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    (0..).find(|n| !used.contains(n)).unwrap_or(0)
}

fn set_nofile(pid: i32, n: u64) {
    let pid = rustix::process::Pid::from_raw(pid).expect("pid");
    rustix::process::prlimit(
        Some(pid),
        rustix::process::Resource::Nofile,
        rustix::process::Rlimit {
            current: Some(n),
            maximum: Some(n),
        },
    )
    .expect("prlimit");
}

#[test]
fn descriptors_dropped_at_the_open_file_limit_are_refused_not_reinterpreted() {
    let mut server = ServerProcess::start("softgpu");
    let mut d = Driver::new(Ours(connect(&server)));
    d.setup_queue(0);
    d.run(0, &[Command::fill(guest(0x1000), 8, 1)]);
    // No room for one more descriptor in the server.
    let pid = server.pid();
    set_nofile(pid, lowest_free_fd(pid));
    let flags = VFIO_USER_F_DMA_REGION_READ | VFIO_USER_F_DMA_REGION_WRITE;
    let other = GuestMemory::new(0x10_0000);
    let e =
        d.t.0
            .dma_map(
                0x40_0000_0000,
                0x10_0000,
                flags,
                Some((other.file.as_fd(), 0)),
            )
            .expect_err("its descriptor was dropped");
    assert_eq!(e.remote_errno(), Some(libc::EMFILE));
    // Not mapped as a message-based window either: a FILL there is an unmapped address.
    d.submit(0, &[Command::fill(Operand::Guest(0x40_0000_0000), 8, 2)]);
    expect_dma_error(&mut d, 0, 0x40_0000_0000);
    // SET_IRQS whose eventfds were dropped is refused and leaves the vectors wired.
    let fresh: Vec<std::fs::File> = (0..8)
        .map(|_| switchyard_device::irq::new_eventfd().expect("eventfd"))
        .collect();
    let fds: Vec<_> = fresh.iter().map(|f| f.as_fd()).collect();
    let e =
        d.t.0
            .set_irqs(
                VFIO_PCI_MSIX_IRQ_INDEX,
                VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
                0,
                8,
                &fds,
            )
            .expect_err("its eventfds were dropped");
    assert_eq!(e.remote_errno(), Some(libc::EMFILE));
    d.run(0, &[Command::fence(guest(0x3000), 0x77, Some(0))]);
    assert!(
        wait_eventfd(&d.completion[0], Duration::from_secs(30)).is_some(),
        "the old eventfd of vector 0 still fires"
    );
    assert!(server.alive(), "{}", server.log_text());
}

#[test]
fn descriptors_beyond_what_a_message_may_carry_are_refused() {
    let mut server = ServerProcess::start("softgpu");
    let mut r = Raw::negotiated(&server.socket);
    let mem = GuestMemory::new(0x1000);
    // DMA_MAP of iova 0x1000 + 0x1000 at file offset 0, read/write, sent with 40 copies of the
    // descriptor: the server receives at most 32 with one message and must not take a subset.
    let mut body = Vec::new();
    body.extend_from_slice(&32u32.to_ne_bytes()); // argsz
    body.extend_from_slice(&3u32.to_ne_bytes()); // flags: read | write
    body.extend_from_slice(&0u64.to_ne_bytes()); // offset
    body.extend_from_slice(&0x1000u64.to_ne_bytes()); // address
    body.extend_from_slice(&0x1000u64.to_ne_bytes()); // size
    let id = r.id();
    let m = message(id, 2 /* DMA_MAP */, 0, &body);
    let many: Vec<_> = (0..40).map(|_| mem.file.as_fd()).collect();
    r.send(&m, &many);
    let (h, _) = r.recv().expect("reply");
    assert!(h.is_error(), "{h:?}");
    assert_eq!(h.error_no as i32, libc::E2BIG);
    assert_eq!(h.msg_id, id);
    assert!(server.alive(), "{}", server.log_text());
    assert_ne!(r.read_reg(0), u32::MAX, "still serving");
}

/// Pipelines `n` VRAM reads of 1 MiB that the client never reads the replies of.
fn flood_unread_replies(r: &mut Raw, n: usize) {
    let mut body = Vec::new();
    body.extend_from_slice(&0u64.to_ne_bytes()); // offset
    body.extend_from_slice(&(switchyard_softgpu::BAR_VRAM).to_ne_bytes());
    body.extend_from_slice(&(1u32 << 20).to_ne_bytes());
    for _ in 0..n {
        let id = r.id();
        let m = message(id, 9 /* REGION_READ */, 0, &body);
        if std::io::Write::write_all(&mut &r.s, &m).is_err() {
            return; // the server stopped reading too: enough
        }
    }
}

#[test]
fn sigterm_stops_a_server_whose_client_stopped_reading() {
    let mut server = ServerProcess::start("softgpu");
    let mut r = Raw::negotiated(&server.socket);
    r.s.set_write_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    flood_unread_replies(&mut r, 64);
    // The server is stuck sending once a reply has begun to arrive: 1 MiB does not fit the
    // socket, and the client reads none of it.
    let sending = wait_for(Duration::from_secs(10), || {
        (rustix::io::ioctl_fionread(&r.s).ok()? > 0).then_some(())
    });
    assert!(sending.is_some(), "no reply began to arrive");
    let t0 = Instant::now();
    let status = server.terminate();
    let took = t0.elapsed();
    assert!(status.success(), "{status}");
    assert!(took < Duration::from_secs(1), "SIGTERM took {took:?}");
    assert!(
        std::fs::symlink_metadata(&server.socket).is_err(),
        "the socket file was removed"
    );
}

#[test]
fn a_client_that_stops_reading_is_dropped_after_the_send_timeout() {
    let server = ServerProcess::start("softgpu");
    let mut r = Raw::negotiated(&server.socket);
    r.s.set_write_timeout(Some(Duration::from_secs(2)))
        .expect("timeout");
    flood_unread_replies(&mut r, 64);
    let t0 = Instant::now();
    // The next client is served once the stuck one is dropped (5 s send timeout).
    let served = wait_for(Duration::from_secs(15), || {
        let c = Client::connect(&server.socket).ok()?;
        drop(c);
        Some(t0.elapsed())
    })
    .expect("a new client is served");
    assert!(
        served >= Duration::from_secs(4),
        "dropped after {served:?}: too early"
    );
    assert!(
        server.log_text().contains("cannot send a reply"),
        "{}",
        server.log_text()
    );
    drop(r);
    later_client_is_served(&server);
}

#[test]
fn the_dirty_log_budget_is_an_operator_setting() {
    let server = ServerProcess::start_with(&["--device", "softgpu", "--dirty-log-budget", "2K"]);
    let mut c = connect(&server);
    let flags = VFIO_USER_F_DMA_REGION_READ | VFIO_USER_F_DMA_REGION_WRITE;
    let mem = GuestMemory::new(64 << 20); // 4 KiB of bitmaps: over a 2 KiB budget
    c.dma_map(GUEST_IOVA, 64 << 20, flags, Some((mem.file.as_fd(), 0)))
        .expect("map");
    let e = c.dma_logging_start(4096, &[]).expect_err("over budget");
    assert_eq!(e.remote_errno(), Some(libc::ENOMEM));
    c.dma_unmap(GUEST_IOVA, 64 << 20, 0).expect("unmap");
    let small = GuestMemory::new(16 << 20); // 1 KiB of bitmaps
    c.dma_map(GUEST_IOVA, 16 << 20, flags, Some((small.file.as_fd(), 0)))
        .expect("map");
    c.dma_logging_start(4096, &[]).expect("within the budget");
    // A size that is not one is refused before anything starts.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args([
            "serve",
            "--socket",
            "/nonexistent/x.sock",
            "--dirty-log-budget",
            "12Q",
        ])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("Invalid size `12Q`: unknown suffix `Q`"),
        "{err}"
    );
}

#[test]
fn max_dma_maps_is_what_the_process_can_hold() {
    // A server whose open-file limit (soft and hard) is 600: every window of a distinct memory
    // object costs it one descriptor, so it must not advertise the spec's 65535.
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("gpu.sock");
    let mut child = std::process::Command::new("sh")
        .args([
            "-c",
            "ulimit -n 600 && exec \"$0\" serve --socket \"$1\" --device softgpu",
            env!("CARGO_BIN_EXE_switchyard"),
        ])
        .arg(&socket)
        .env("RUST_LOG", "warn")
        .stdin(std::process::Stdio::null())
        .spawn()
        .expect("spawn");
    let up = wait_for(Duration::from_secs(20), || {
        use std::os::unix::fs::FileTypeExt;
        std::fs::symlink_metadata(&socket)
            .is_ok_and(|m| m.file_type().is_socket())
            .then_some(())
    });
    assert!(up.is_some(), "server did not listen");
    let mut c = Client::connect(&socket).expect("connect");
    let max = c.negotiated_caps().max_dma_maps;
    assert!(max > 0 && max < 600, "advertised max_dma_maps {max}");
    // Every one of them can really be held, each on its own memory object.
    let flags = VFIO_USER_F_DMA_REGION_READ | VFIO_USER_F_DMA_REGION_WRITE;
    let mems: Vec<GuestMemory> = (0..max).map(|_| GuestMemory::new(4096)).collect();
    for (i, m) in mems.iter().enumerate() {
        c.dma_map(
            0x1000_0000 + i as u64 * 0x1000,
            4096,
            flags,
            Some((m.file.as_fd(), 0)),
        )
        .unwrap_or_else(|e| panic!("window {i} of {max}: {e}"));
    }
    let one_more = GuestMemory::new(4096);
    let e = c
        .dma_map(0x9000_0000, 4096, flags, Some((one_more.file.as_fd(), 0)))
        .expect_err("one over the advertised maximum");
    assert_eq!(e.remote_errno(), Some(libc::ENOSPC));
    assert!(
        child.try_wait().expect("wait").is_none(),
        "the server is alive"
    );
    let _ = child.kill();
    let _ = child.wait();
}
