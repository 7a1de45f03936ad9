//! VFIO migration v2 over vfio-user between two real `switchyard serve` processes, driven the
//! way a VMM drives it (through `switchyard_client::migrate`): MIG_DEVICE_STATE transitions,
//! MIG_DATA_READ from the source and MIG_DATA_WRITE to the destination, with the guest RAM
//! staying in the same memfd.
#![forbid(unsafe_code)]

mod common;

use std::borrow::BorrowMut;
use std::fs::File;
use std::num::NonZeroU32;
use std::os::unix::fs::FileExt;
use std::time::Duration;

use common::driver::{CONFIG, DoorbellPage, Driver, guest, wait_eventfd};
use common::ours::Ours;
use common::{GuestMemory, ServerProcess};
use switchyard_client::migrate::{
    Migration, MigrationError, Phase, PreCopyPlan, Recovery, Side, Step,
};
use switchyard_client::{Client, ClientError};
use switchyard_proto::consts::*;
use switchyard_softgpu::BAR_REGS;
use switchyard_softgpu::cmd::{Command, Operand};
use switchyard_softgpu::regs::*;

const DEVICE: &str = "softgpu,vram=16M,queues=2";
const VRAM: u64 = 16 << 20;
const CHUNK: NonZeroU32 = NonZeroU32::new(1 << 20).expect("nonzero");

fn connect(server: &ServerProcess) -> Client {
    Client::connect(&server.socket).expect("connect")
}

fn vram_fd(c: &mut Client) -> File {
    c.region_info(2).expect("BAR2").fd.expect("VRAM fd")
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut s = seed | 1;
    (0..len.div_ceil(8))
        .flat_map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s.to_le_bytes()
        })
        .take(len)
        .collect()
}

fn read_all(f: &File) -> Vec<u8> {
    let mut v = vec![0u8; VRAM as usize];
    f.read_exact_at(&mut v, 0).expect("read VRAM");
    v
}

/// One PRE_COPY round; returns the bytes moved.
fn round<S: BorrowMut<Client>, D: BorrowMut<Client>>(mig: &mut Migration<S, D>) -> usize {
    let r = mig.pre_copy_round().expect("PRE_COPY round");
    usize::try_from(r.bytes).expect("bytes")
}

#[test]
fn live_migration_with_precopy_between_two_server_processes() {
    let src_server = ServerProcess::start(DEVICE);
    let dst_server = ServerProcess::start(DEVICE);
    let mut d = Driver::new(Ours(connect(&src_server)));
    d.setup_queue(0);
    let src_vram = vram_fd(&mut d.t.0);
    // VRAM written by the guest through its mapping (no message reaches the server) ...
    src_vram
        .write_all_at(&pattern(1, 3 << 20), 1 << 20)
        .expect("write VRAM");
    // ... and by the device.
    d.mem.write(0x10_0000, &pattern(2, 64 << 10));
    d.run(
        0,
        &[Command::copy(
            guest(0x10_0000),
            Operand::Vram(8 << 20),
            64 << 10,
        )],
    );
    d.w32(SCRATCH, 0xabcd_0123);

    let dst = connect(&dst_server);
    assert_eq!(
        d.t.0.migration_flags().expect("flags"),
        VFIO_MIGRATION_STOP_COPY | VFIO_MIGRATION_PRE_COPY | VFIO_MIGRATION_P2P
    );
    let mut mig = Migration::new(d, dst).with_chunk(CHUNK);
    mig.prepare_destination().expect("RUNNING -> RESUMING");
    assert_eq!(
        mig.destination().mig_state().expect("state"),
        VFIO_DEVICE_STATE_RESUMING
    );

    // Pre-copy while the device keeps running.
    mig.start_pre_copy().expect("PRE_COPY");
    let first = round(&mut mig);
    assert!(
        first > (3 << 20) + (64 << 10),
        "the first round carries the used VRAM ({first} bytes)"
    );
    src_vram
        .write_all_at(&pattern(3, 8192), 2 << 20)
        .expect("rewrite two pages");
    mig.source().run(
        0,
        &[Command::fill(Operand::Vram(12 << 20), 4096, 0x7777_7777)],
    );
    let second = round(&mut mig);
    assert!(
        (3 * 4096..4 * 4096 + 1024).contains(&second),
        "the second round carries the three changed pages ({second} bytes)"
    );

    // Work the guest submitted just before it stopped (bus mastering off: still pending).
    let d = mig.source();
    let cmd = d.cfg16(0x04) & !0x4;
    d.t.0
        .region_write(CONFIG, 0x04, &cmd.to_le_bytes())
        .expect("bus master off");
    d.submit(
        0,
        &[
            Command::fill(Operand::Vram(0), 4096, 0x5a5a_5a5a),
            Command::fence(guest(0x20_0000), 42, Some(3)),
        ],
    );
    let src_regs: Vec<u32> = [
        SCRATCH,
        FENCE_COUNT_LO,
        queue_reg(0, Q_HEAD),
        queue_reg(0, Q_TAIL),
    ]
    .iter()
    .map(|&r| d.r32(r))
    .collect();

    // Stop-and-copy: the rest of the stream, the state, then the destination runs.
    mig.switchover()
        .expect("STOP_COPY, stream, RESUMING -> RUNNING");
    assert_eq!(mig.phase(), Phase::SwitchedOver);
    let (mut d, mut dst) = mig.into_parts();
    d.t.0.set_mig_state(VFIO_DEVICE_STATE_STOP).expect("STOP");
    let log = src_server.log_text();
    assert!(
        log.contains("outgoing migration stream closed") && log.contains("completed=true"),
        "the source logs the finished stream:\n{log}"
    );
    assert_eq!(dst.mig_state().expect("state"), VFIO_DEVICE_STATE_RUNNING);

    let dst_vram = vram_fd(&mut dst);
    assert!(
        read_all(&src_vram) == read_all(&dst_vram),
        "destination VRAM equals the source's"
    );
    let r32 = |c: &mut Client, off: u64| {
        let mut b = [0u8; 4];
        c.region_read(BAR_REGS, off, &mut b).expect("read");
        u32::from_le_bytes(b)
    };
    let dst_regs: Vec<u32> = [
        SCRATCH,
        FENCE_COUNT_LO,
        queue_reg(0, Q_HEAD),
        queue_reg(0, Q_TAIL),
    ]
    .iter()
    .map(|&r| r32(&mut dst, r))
    .collect();
    assert_eq!(
        dst_regs, src_regs,
        "registers and queue positions came along"
    );
    assert_eq!(r32(&mut dst, queue_reg(0, Q_STATUS)), Q_STATUS_PAUSED);
    // The destination VMM maps the same guest RAM and wires its own eventfds.
    let ram = GuestMemory {
        file: d.mem.file.try_clone().expect("clone RAM"),
        size: d.mem.size,
    };
    let d2 = Driver::with_memory(Ours(dst), ram);
    // Driver::new re-enabled bus mastering: the pending work runs on the destination.
    assert_eq!(
        wait_eventfd(&d2.completion[3], Duration::from_secs(10)),
        Some(1),
        "the fence interrupt arrives at the destination VMM"
    );
    assert_eq!(d2.mem.read_u64(0x20_0000), 42);
    let mut b = [0u8; 4];
    dst_vram.read_exact_at(&mut b, 0).expect("read");
    assert_eq!(b, [0x5a; 4]);
    src_vram.read_exact_at(&mut b, 0).expect("read");
    assert_ne!(b, [0x5a; 4], "the stopped source did not run it");
    assert_eq!(d.r32(queue_reg(0, Q_HEAD)), src_regs[2]);
}

#[test]
fn refused_transitions_bad_streams_and_recovery() {
    let server = ServerProcess::start(DEVICE);
    let mut c = connect(&server);
    let errno = |r: switchyard_client::Result<u32>| r.expect_err("refused").remote_errno();
    assert_eq!(c.mig_state().expect("state"), VFIO_DEVICE_STATE_RUNNING);
    assert_eq!(
        errno(c.set_mig_state(VFIO_DEVICE_STATE_ERROR)),
        Some(libc::EINVAL)
    );
    // The softgpu offers the P2P states: quiesced, and back.
    assert_eq!(
        c.set_mig_state(VFIO_DEVICE_STATE_RUNNING_P2P)
            .expect("RUNNING_P2P"),
        VFIO_DEVICE_STATE_RUNNING_P2P
    );
    assert_eq!(
        c.set_mig_state(VFIO_DEVICE_STATE_RUNNING).expect("RUNNING"),
        VFIO_DEVICE_STATE_RUNNING
    );
    assert_eq!(
        c.mig_data_read(64).expect_err("not saving").remote_errno(),
        Some(libc::EINVAL)
    );

    // STOP_COPY -> PRE_COPY is not an arc, and nothing changes.
    c.set_mig_state(VFIO_DEVICE_STATE_STOP_COPY)
        .expect("STOP_COPY");
    assert_eq!(
        errno(c.set_mig_state(VFIO_DEVICE_STATE_PRE_COPY)),
        Some(libc::EINVAL)
    );
    assert_eq!(c.mig_state().expect("state"), VFIO_DEVICE_STATE_STOP_COPY);
    assert_eq!(
        c.mig_data_write(&[0; 16])
            .expect_err("not resuming")
            .remote_errno(),
        Some(libc::EINVAL)
    );

    // A stream that is not one: refused, then loading fails and the device is in ERROR ...
    c.set_mig_state(VFIO_DEVICE_STATE_RESUMING)
        .expect("STOP_COPY -> RESUMING");
    assert_eq!(
        c.mig_data_write(b"definitely not a softgpu stream")
            .expect_err("garbage")
            .remote_errno(),
        Some(libc::EINVAL)
    );
    assert_eq!(
        errno(c.set_mig_state(VFIO_DEVICE_STATE_RUNNING)),
        Some(libc::EINVAL)
    );
    assert_eq!(c.mig_state().expect("state"), VFIO_DEVICE_STATE_ERROR);
    assert_eq!(
        errno(c.set_mig_state(VFIO_DEVICE_STATE_STOP)),
        Some(libc::EINVAL)
    );
    // ... until a reset.
    c.device_reset().expect("reset");
    assert_eq!(c.mig_state().expect("state"), VFIO_DEVICE_STATE_RUNNING);

    // A client that leaves mid-migration leaves a running device behind.
    c.set_mig_state(VFIO_DEVICE_STATE_STOP_COPY)
        .expect("STOP_COPY");
    c.mig_data_read(4096).expect("some data");
    // Shut the socket down rather than only closing our descriptor: a server process being
    // spawned by a parallel test may hold a forked copy of it until its exec, and the server
    // (rightly) refuses a second client while the first is still connected.
    c.socket()
        .shutdown(std::net::Shutdown::Both)
        .expect("shutdown");
    drop(c);
    let mut d = Driver::new(Ours(connect(&server)));
    assert_eq!(d.t.0.mig_state().expect("state"), VFIO_DEVICE_STATE_RUNNING);
    d.setup_queue(1);
    d.run(1, &[Command::fence(guest(0x100), 7, None)]);
    assert_eq!(d.mem.read_u64(0x100), 7);
}

/// Reads all of VRAM through trapped region reads.
fn read_trapped(c: &mut Client) -> Vec<u8> {
    let mut v = vec![0u8; VRAM as usize];
    for (i, chunk) in v.chunks_mut(256 << 10).enumerate() {
        c.region_read(2, (i as u64) << 18, chunk)
            .expect("VRAM read");
    }
    v
}

#[test]
fn trapped_vram_migrates_by_its_write_log() {
    let device = "softgpu,vram=16M,queues=2,vram_mmap=off";
    let src_server = ServerProcess::start(device);
    let dst_server = ServerProcess::start(device);
    let mut src = connect(&src_server);
    let info = src.region_info(2).expect("BAR2");
    assert!(
        info.fd.is_none() && info.info.flags & VFIO_REGION_INFO_FLAG_MMAP == 0,
        "VRAM is trapped, not mappable"
    );
    src.region_write(2, 1 << 20, &pattern(5, 256 << 10))
        .expect("VRAM write");
    let dst = connect(&dst_server);
    let mut mig = Migration::new(src, dst).with_chunk(CHUNK);
    mig.prepare_destination().expect("RESUMING");
    mig.start_pre_copy().expect("PRE_COPY");
    let first = round(&mut mig);
    assert!(first >= 256 << 10, "{first}");
    mig.source()
        .region_write(2, 10 << 20, &pattern(6, 5 * 4096))
        .expect("VRAM write");
    let second = round(&mut mig);
    assert!(
        (5 * 4096..6 * 4096).contains(&second),
        "the second round carries the five written pages ({second} bytes)"
    );
    mig.source()
        .region_write(2, 12 << 20, &pattern(7, 4096))
        .expect("VRAM write");
    let last = mig
        .switchover()
        .expect("STOP_COPY, stream, RUNNING")
        .stream
        .bytes;
    // One page, the device state (JSON, about 9 KiB with the config space) and the records.
    assert!(
        (4096..4096 + (16 << 10)).contains(&last),
        "the final round: one page and the state ({last})"
    );
    let (mut src, mut dst) = mig.into_parts();
    assert_eq!(dst.mig_state().expect("state"), VFIO_DEVICE_STATE_RUNNING);
    assert!(read_trapped(&mut src) == read_trapped(&mut dst));
}

/// Asserts that `err` is a MIG_DATA_WRITE the destination refused in `step`, after which the
/// source runs again.
fn assert_refused_by_destination(err: &MigrationError, step: Step) {
    assert!(
        matches!(
            err,
            MigrationError::Client { step: s, side: Side::Destination, .. } if *s == step
        ),
        "{err}"
    );
    assert_eq!(
        err.client_error().and_then(ClientError::remote_errno),
        Some(libc::EINVAL),
        "{err}"
    );
    assert!(
        matches!(err.recovery(), Some(Recovery::SourceRunning)),
        "{err}"
    );
}

#[test]
fn a_refused_stream_leaves_the_source_running() {
    let src_server = ServerProcess::start(DEVICE);
    // Half the source's VRAM: the stream's first record does not fit.
    let dst_server = ServerProcess::start("softgpu,vram=8M,queues=2");
    let mut d = Driver::new(Ours(connect(&src_server)));
    d.setup_queue(0);
    d.w32(SCRATCH, 0x0bad_5eed);
    let mut dst = connect(&dst_server);

    // Stop-copy into a destination that was not put into RESUMING: the stopped source runs
    // again.
    let mut mig = Migration::new(&mut d.t.0, &mut dst);
    let err = mig
        .switchover()
        .expect_err("the destination is not RESUMING");
    assert_refused_by_destination(&err, Step::Stream);
    assert_eq!(mig.phase(), Phase::Aborted);
    assert!(
        matches!(
            mig.pre_copy_round(),
            Err(MigrationError::OutOfOrder {
                step: Step::PreCopyRound,
                phase: Phase::Aborted
            })
        ),
        "an aborted migration sends nothing more"
    );
    assert!(matches!(mig.abort(), Recovery::NotNeeded));
    assert_eq!(d.t.0.mig_state().expect("state"), VFIO_DEVICE_STATE_RUNNING);
    assert_eq!(d.r32(SCRATCH), 0x0bad_5eed);
    d.run(0, &[Command::fence(guest(0x100), 1, None)]);
    assert_eq!(d.mem.read_u64(0x100), 1);

    // Pre-copy into a destination with less VRAM: refused at once, the source still runs.
    let mut mig = Migration::new(&mut d.t.0, &mut dst);
    mig.prepare_destination().expect("RESUMING");
    let err = mig
        .pre_copy(&PreCopyPlan::default())
        .expect_err("the destination's VRAM is smaller");
    assert_refused_by_destination(&err, Step::PreCopyRound);
    assert_eq!(d.t.0.mig_state().expect("state"), VFIO_DEVICE_STATE_RUNNING);
    d.run(0, &[Command::fence(guest(0x100), 2, None)]);
    assert_eq!(d.mem.read_u64(0x100), 2);

    // An explicit abort in pre-copy.
    let mut mig = Migration::new(&mut d.t.0, &mut dst);
    mig.start_pre_copy().expect("PRE_COPY");
    assert!(matches!(mig.abort(), Recovery::SourceRunning));
    assert_eq!(d.t.0.mig_state().expect("state"), VFIO_DEVICE_STATE_RUNNING);
}

/// A queue on mapped doorbells migrates with the tail the guest stored into the source's
/// doorbell page and never rang (the vCPU stopped before it could): the tail travels in the
/// device state, the destination writes it into its own page, and the command runs there.
#[test]
fn a_mapped_doorbell_tail_migrates_into_the_destination_page() {
    let device = "softgpu,vram=16M,queues=2,spin=0";
    let src_server = ServerProcess::start(device);
    let dst_server = ServerProcess::start(device);
    let mut src = connect(&src_server);
    let src_page = DoorbellPage::map(&mut src);
    let mut d = Driver::new(Ours(src));
    d.setup_queue(0);
    d.map_queue(0);
    d.submit_mapped(&src_page, 0, &[Command::fence(guest(0x20_0000), 1, None)]);
    assert_eq!(d.wait_queue(0), Q_STATUS_IDLE);
    // Bus mastering off (the guest is being stopped), then a submission only in the page.
    let cmd = d.cfg16(0x04) & !0x4;
    d.t.0
        .region_write(CONFIG, 0x04, &cmd.to_le_bytes())
        .expect("bus master off");
    let tail = d.enqueue(
        0,
        &[
            Command::fill(Operand::Vram(0), 4096, 0x3c3c_3c3c),
            Command::fence(guest(0x20_0000), 2, None),
        ],
    );
    src_page.publish(0, tail);

    let mut mig = Migration::new(d, connect(&dst_server)).with_chunk(CHUNK);
    mig.prepare_destination().expect("RESUMING");
    mig.start_pre_copy().expect("PRE_COPY");
    round(&mut mig);
    mig.switchover().expect("STOP_COPY, stream, RUNNING");
    let (d, mut dst) = mig.into_parts();
    let dst_page = DoorbellPage::map(&mut dst);
    assert_eq!(
        dst_page.tail(0),
        tail,
        "the destination page holds the tail"
    );
    let mut b = [0u8; 4];
    dst.region_read(BAR_REGS, queue_reg(0, Q_CONTROL), &mut b)
        .expect("read");
    assert_eq!(
        u32::from_le_bytes(b),
        Q_CONTROL_ENABLE | Q_CONTROL_MAPPED,
        "still in mapped mode"
    );
    // The destination VMM maps the same guest RAM; bus mastering back on runs the work.
    let ram = GuestMemory {
        file: d.mem.file.try_clone().expect("clone RAM"),
        size: d.mem.size,
    };
    let mut d2 = Driver::with_memory(Ours(dst), ram);
    d2.set_tail(0, tail);
    assert_eq!(d2.wait_queue(0), Q_STATUS_IDLE);
    assert_eq!(d2.mem.read_u64(0x20_0000), 2);
    assert_eq!(d2.r32(queue_reg(0, Q_HEAD)), tail);
}

/// DEVICE_FEATURE SET `VFIO_USER_DEVICE_FEATURE_MIG_MAPPED_REGIONS` (issue 35): a client that
/// migrates the mapped VRAM itself, as its RAM, is answered yes for the regions the softgpu
/// allows (BAR0's doorbell page, BAR2) and no otherwise or with `--mapped-migration off`;
/// then the device's stream carries what the device wrote and not what the client wrote
/// through its mapping, which is the client's to send.
#[test]
fn a_client_that_migrates_mapped_vram_gets_only_the_devices_writes() {
    let set = |c: &mut Client, mask: u64| {
        c.device_feature(
            16,
            VFIO_DEVICE_FEATURE_SET | u32::from(VFIO_USER_DEVICE_FEATURE_MIG_MAPPED_REGIONS),
            &mask.to_le_bytes(),
        )
    };
    let refused = |r: Result<_, ClientError>| match r {
        Err(ClientError::Remote { errno, .. }) => errno == libc::ENOTTY,
        _ => false,
    };
    let off = ServerProcess::start_with(&["--device", DEVICE, "--mapped-migration", "off"]);
    assert!(refused(set(&mut connect(&off), 0b101)), "off refuses");

    let src_server = ServerProcess::start(DEVICE);
    let dst_server = ServerProcess::start(DEVICE);
    let mut src = connect(&src_server);
    assert!(refused(set(&mut src, 0b10)), "BAR1 has no mapped memory");
    assert!(refused(set(&mut src, 0)), "an empty mask");
    set(&mut src, 0b101).expect("BAR0 and BAR2 accepted");
    let vram = vram_fd(&mut src);
    // The client's write through its mapping: not the device's to send.
    vram.write_all_at(&pattern(8, 8192), 1 << 20)
        .expect("VRAM write");
    let dst = connect(&dst_server);
    let mut mig = Migration::new(src, dst).with_chunk(CHUNK);
    mig.prepare_destination().expect("RESUMING");
    mig.start_pre_copy().expect("PRE_COPY");
    let first = round(&mut mig);
    assert!(first < 4096, "no pass over VRAM ({first} bytes)");
    // The device's write (trapped): the device's to send, at the switchover.
    mig.source()
        .region_write(2, 3 << 20, &pattern(9, 4096))
        .expect("VRAM write");
    mig.switchover().expect("STOP_COPY, stream, RUNNING");
    let (mut src, mut dst) = mig.into_parts();
    src.set_mig_state(VFIO_DEVICE_STATE_STOP).expect("STOP");
    let dst_vram = vram_fd(&mut dst);
    let mut page = vec![0u8; 4096];
    dst_vram.read_exact_at(&mut page, 3 << 20).expect("read");
    assert_eq!(page, pattern(9, 4096), "the device's write arrived");
    dst_vram.read_exact_at(&mut page, 1 << 20).expect("read");
    assert_eq!(
        page,
        vec![0u8; 4096],
        "the client's write is the client's to send"
    );
    let log = src_server.log_text();
    assert!(
        log.contains("client_mapped=true"),
        "the source's stream knew:\n{log}"
    );
}
