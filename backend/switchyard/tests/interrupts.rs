//! Interrupt eventfds against a real server: only eventfds are accepted, the client's file
//! flags are never touched, a saturated blocking eventfd never stalls the device, and the ERR
//! index a VMM needs for error recovery is offered.
#![forbid(unsafe_code)]

mod common;

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::time::Duration;

use common::ServerProcess;
use common::driver::{Driver, Transport, guest};
use common::ours::Ours;
use common::raw::Raw;
use rustix::event::{EventfdFlags, PollFd, PollFlags, Timespec, eventfd, poll};
use rustix::fs::OFlags;
use switchyard_client::Client;
use switchyard_proto::consts::*;
use switchyard_softgpu::cmd::Command;

const EVENTFD_TRIGGER: u32 = VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER;
const NONE_TRIGGER: u32 = VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER;

fn set_irqs(flags: u32, index: u32, start: u32, count: u32) -> Vec<u8> {
    let mut b = 20u32.to_ne_bytes().to_vec();
    for v in [flags, index, start, count] {
        b.extend_from_slice(&v.to_ne_bytes());
    }
    b
}

/// A blocking eventfd, as a client may pass it (QEMU's are non-blocking, nothing requires it).
fn blocking_eventfd() -> File {
    File::from(eventfd(0, EventfdFlags::CLOEXEC).expect("eventfd"))
}

/// The eventfd's counter, reset to 0, or `None` if it was 0 (without blocking on it).
fn take(f: &File, timeout: Duration) -> Option<u64> {
    let ts = Timespec {
        tv_sec: timeout.as_secs() as i64,
        tv_nsec: i64::from(timeout.subsec_nanos()),
    };
    let mut p = [PollFd::new(f, PollFlags::IN)];
    poll(&mut p, Some(&ts)).expect("poll");
    if !p[0].revents().contains(PollFlags::IN) {
        return None;
    }
    let mut b = [0u8; 8];
    (&*f).read_exact(&mut b).expect("read eventfd");
    Some(u64::from_ne_bytes(b))
}

fn flags(f: &File) -> OFlags {
    rustix::fs::fcntl_getfl(f).expect("getfl")
}

fn ok(r: &mut Raw, body: &[u8], fds: &[std::os::fd::BorrowedFd<'_>]) {
    let (h, _) = r.call(8, 0, body, fds);
    assert!(!h.is_error(), "SET_IRQS failed: {h:?}");
}

#[test]
fn set_irqs_takes_only_eventfds_and_leaves_their_flags_alone() {
    let server = ServerProcess::start_logging("info", &["--device", "softgpu"]);
    let mut r = Raw::negotiated(&server.socket);
    let good = blocking_eventfd();
    let before = flags(&good);
    assert!(!before.contains(OFlags::NONBLOCK));
    ok(&mut r, &set_irqs(EVENTFD_TRIGGER, 2, 0, 1), &[good.as_fd()]);
    assert_eq!(
        flags(&good),
        before,
        "the client's file flags are untouched"
    );

    // A pipe, /dev/null, and a batch with one pipe among eventfds: EINVAL, nothing changes.
    let (_rd, wr) = rustix::pipe::pipe().expect("pipe");
    let null = File::options()
        .write(true)
        .open("/dev/null")
        .expect("/dev/null");
    let other = blocking_eventfd();
    r.expect_errno(
        8,
        &set_irqs(EVENTFD_TRIGGER, 2, 0, 1),
        &[wr.as_fd()],
        libc::EINVAL,
    );
    r.expect_errno(
        8,
        &set_irqs(EVENTFD_TRIGGER, 2, 0, 1),
        &[null.as_fd()],
        libc::EINVAL,
    );
    r.expect_errno(
        8,
        &set_irqs(EVENTFD_TRIGGER, 2, 0, 2),
        &[other.as_fd(), wr.as_fd()],
        libc::EINVAL,
    );
    assert!(
        !flags(&other).contains(OFlags::NONBLOCK) && !flags(&null).contains(OFlags::NONBLOCK),
        "refused files keep their flags too"
    );
    // Vector 0 is still routed to `good`, vector 1 to nothing: the client triggers both.
    ok(&mut r, &set_irqs(NONE_TRIGGER, 2, 0, 2), &[]);
    assert_eq!(take(&good, Duration::from_secs(5)), Some(1), "vector 0");
    assert_eq!(take(&other, Duration::from_millis(50)), None, "vector 1");

    // The log names the cause once, then counts (one client, well within the interval).
    drop(r);
    let log = common::wait_for(Duration::from_secs(10), || {
        let t = server.log_text();
        t.contains("repeated warning suppressed").then_some(t)
    })
    .unwrap_or_else(|| panic!("no summary line:\n{}", server.log_text()));
    // Refused by kind before anything holds them (the connection checks every descriptor
    // a message brings: `switchyard_server::fd_kind`).
    let refused: Vec<&str> = log
        .lines()
        .filter(|l| {
            l.contains("a descriptor of a kind its message cannot carry")
                || l.contains("descriptors refused by kind")
        })
        .collect();
    assert_eq!(refused.len(), 2, "{log}");
    assert!(
        refused[0].contains("what=\"Fifo\"") && refused[0].contains("cmd=8"),
        "names what the file is and the command: {}",
        refused[0]
    );
    assert!(
        refused[1].contains("suppressed=2") && refused[1].contains("repeated warning"),
        "{}",
        refused[1]
    );
}

#[test]
fn a_saturated_blocking_eventfd_does_not_stall_the_engine() {
    let server = ServerProcess::start("softgpu");
    let mut d = Driver::new(Ours(Client::connect(&server.socket).expect("connect")));
    // Queue 0 completes on MSI-X vector 0; route it to a blocking eventfd whose counter the
    // client brought to its ceiling (a write of 1 would block until someone reads it).
    let saturated = blocking_eventfd();
    (&saturated)
        .write_all(&0xffff_ffff_ffff_fffeu64.to_ne_bytes())
        .expect("saturate");
    d.t.set_msix_eventfds(0, &[&saturated]);
    d.setup_queue(0);
    for i in 0..4 {
        // Each command completes with an interrupt; the next one runs only if the engine
        // came back from signalling (the driver waits up to 60 s for the queue).
        d.run(0, &[Command::fill(guest(0x1000), 64, i).with_irq()]);
    }
    assert_eq!(d.mem.read_u64(0x1000) as u32, 3, "the last FILL ran");
    assert!(
        !flags(&saturated).contains(OFlags::NONBLOCK),
        "flags untouched"
    );
    assert_eq!(
        take(&saturated, Duration::from_secs(1)),
        Some(0xffff_ffff_ffff_fffe),
        "still pending at the ceiling"
    );
    // Drained, the next completion is delivered normally.
    d.run(0, &[Command::fill(guest(0x1000), 64, 9).with_irq()]);
    assert_eq!(take(&saturated, Duration::from_secs(5)), Some(1));
}

#[test]
fn the_err_index_offers_one_eventfd_vector_for_error_recovery() {
    let server = ServerProcess::start("softgpu");
    let mut c = Client::connect(&server.socket).expect("connect");
    let err = c.irq_info(VFIO_PCI_ERR_IRQ_INDEX).expect("ERR irq info");
    assert_eq!(err.count, 1, "{err:?}");
    assert_ne!(err.flags & VFIO_IRQ_INFO_EVENTFD, 0, "{err:?}");
    let efd = blocking_eventfd();
    c.set_irqs(
        VFIO_PCI_ERR_IRQ_INDEX,
        EVENTFD_TRIGGER,
        0,
        1,
        &[efd.as_fd()],
    )
    .expect("QEMU's SET_IRQS on the ERR index");
    // Routed: a client-side trigger of the vector reaches the eventfd.
    c.set_irqs(VFIO_PCI_ERR_IRQ_INDEX, NONE_TRIGGER, 0, 1, &[])
        .expect("trigger");
    assert_eq!(take(&efd, Duration::from_secs(5)), Some(1));
    let e = c
        .set_irqs(
            VFIO_PCI_ERR_IRQ_INDEX,
            EVENTFD_TRIGGER,
            0,
            2,
            &[efd.as_fd(), efd.as_fd()],
        )
        .expect_err("one vector only");
    assert_eq!(e.remote_errno(), Some(libc::EINVAL));
    // The MSI mode offers it too.
    let server = ServerProcess::start("softgpu,irq=msi");
    let mut c = Client::connect(&server.socket).expect("connect");
    assert_eq!(c.irq_info(VFIO_PCI_ERR_IRQ_INDEX).expect("ERR").count, 1);
}
