//! Quiescing the device while an engine waits for the client: a command whose ring lives in a
//! DMA window mapped without a file descriptor is fetched with a server→client DMA_READ that
//! only the connection thread can route back. DEVICE_RESET and migration STOP, served by that
//! same thread, must not wait for that reply (the client's DMA timeout, 5 s), and the command
//! must not latch a DMA error or fire the error vector.
#![forbid(unsafe_code)]

mod common;

use std::time::{Duration, Instant};

use common::ServerProcess;
use common::driver::{Driver, guest, wait_eventfd};
use common::ours::Ours;
use switchyard_client::{Client, FlatDma};
use switchyard_device::irq::take_eventfd;
use switchyard_proto::Request;
use switchyard_proto::consts::*;
use switchyard_softgpu::cmd::Command;
use switchyard_softgpu::regs::*;

/// The fd-less window: queue 0's ring lives here.
const REMOTE: u64 = 0x2_0000_0000;
const REMOTE_SIZE: u64 = 0x1_0000;
const RING: u32 = 16;
/// Where the FENCE of the tests writes (fd-backed guest memory).
const FENCE_AT: u64 = 0x20_0000;
/// Well under the client DMA timeout (5 s), which is what a quiesce used to wait.
const FAST: Duration = Duration::from_secs(1);

fn connect(p: &ServerProcess) -> Driver<Ours> {
    let mut d = Driver::new(Ours(Client::connect(&p.socket).expect("connect")));
    let flags = VFIO_USER_F_DMA_REGION_READ | VFIO_USER_F_DMA_REGION_WRITE;
    d.t.0
        .dma_map(REMOTE, REMOTE_SIZE, flags, None)
        .expect("map a window without fd");
    d
}

fn setup_remote_queue(d: &mut Driver<Ours>) {
    d.w64(queue_reg(0, Q_RING_BASE_LO), REMOTE);
    d.w32(queue_reg(0, Q_RING_SIZE), RING);
    d.w32(queue_reg(0, Q_CONTROL), Q_CONTROL_ENABLE);
}

/// Rings queue 0's doorbell (tail 1) and returns the id and address of the server's DMA_READ
/// of the ring entry, which is left unanswered.
fn ring_and_take_dma_read(c: &mut Client) -> (u16, u64) {
    let mut buf = Vec::new();
    Request::RegionWrite {
        offset: queue_reg(0, Q_DOORBELL),
        region: 0,
        data: &1u32.to_le_bytes(),
    }
    .encode(0x4242, false, &mut buf)
    .expect("encode");
    c.send_raw(&buf, &[]).expect("send the doorbell");
    let (mut replied, mut read) = (false, None);
    while !replied || read.is_none() {
        let m = c.recv_raw().expect("a message from the server");
        if m.header.is_command() {
            assert_eq!(m.header.cmd, VFIO_USER_DMA_READ, "{:?}", m.header);
            let address = u64::from_le_bytes(m.body[..8].try_into().expect("address"));
            read = Some((m.header.msg_id, address));
        } else {
            assert_eq!(m.header.msg_id, 0x4242, "{:?}", m.header);
            assert!(
                !m.header.is_error(),
                "doorbell write failed: {:?}",
                m.header
            );
            replied = true;
        }
    }
    read.expect("DMA_READ")
}

#[test]
fn device_reset_does_not_wait_for_an_unanswered_dma_read() {
    let p = ServerProcess::start("softgpu");
    let mut d = connect(&p);
    setup_remote_queue(&mut d);
    let (id, address) = ring_and_take_dma_read(&mut d.t.0);
    assert_eq!(address, REMOTE, "the engine fetches the ring entry");

    let t = Instant::now();
    d.t.0.device_reset().expect("DEVICE_RESET");
    let took = t.elapsed();
    eprintln!("DEVICE_RESET with an unanswered DMA_READ in flight: {took:?}");
    assert!(took < FAST, "DEVICE_RESET took {took:?}");
    assert_eq!(
        take_eventfd(&d.error[0]),
        None,
        "the cancelled ring fetch fired the error vector"
    );

    // The client's answer comes late: it is dropped and the connection goes on.
    let mut late = Vec::new();
    switchyard_proto::encode_error_reply(&mut late, id, VFIO_USER_DMA_READ, libc::EFAULT);
    d.t.0.send_raw(&late, &[]).expect("late reply");
    assert_eq!(d.r32(MAGIC), MAGIC_VALUE);
    assert_eq!(d.r32(queue_reg(0, Q_ERROR_CODE)), ERR_NONE);

    // Positive control: the same fetch failed by the client does latch the error and fire the
    // error vector, so the silence above means something.
    d.enable_device();
    setup_remote_queue(&mut d);
    let (id, _) = ring_and_take_dma_read(&mut d.t.0);
    let mut fail = Vec::new();
    switchyard_proto::encode_error_reply(&mut fail, id, VFIO_USER_DMA_READ, libc::EFAULT);
    d.t.0.send_raw(&fail, &[]).expect("error reply");
    assert!(
        wait_eventfd(&d.error[0], Duration::from_secs(5)).is_some(),
        "a failed ring fetch fires the error vector"
    );
    assert_ne!(d.r32(queue_reg(0, Q_ERROR_CODE)), ERR_NONE);
    let log = p.log_text();
    assert!(
        log.contains("dropping a late reply to a cancelled DMA request"),
        "{log}"
    );
    assert!(!log.contains("unsolicited"), "{log}");
}

#[test]
fn migration_stop_cancels_an_unanswered_dma_read_and_the_command_runs_after_resume() {
    let p = ServerProcess::start("softgpu");
    let mut d = connect(&p);
    setup_remote_queue(&mut d);
    let mut ring = FlatDma::new(REMOTE, REMOTE_SIZE as usize);
    ring.mem[..64].copy_from_slice(&Command::fence(guest(FENCE_AT), 7, Some(0)).encode());
    let (_, address) = ring_and_take_dma_read(&mut d.t.0);
    assert_eq!(address, REMOTE);

    let t = Instant::now();
    d.t.0.set_mig_state(VFIO_DEVICE_STATE_STOP).expect("STOP");
    let took = t.elapsed();
    eprintln!("migration STOP with an unanswered DMA_READ in flight: {took:?}");
    assert!(took < FAST, "STOP took {took:?}");
    assert_eq!(take_eventfd(&d.error[0]), None, "error vector fired");
    assert_eq!(d.r32(queue_reg(0, Q_ERROR_CODE)), ERR_NONE);
    assert_eq!(d.r32(queue_reg(0, Q_STATUS)), Q_STATUS_PAUSED);
    assert_eq!(d.r64(queue_reg(0, Q_COMPLETED_LO)), 0);
    assert_ne!(d.r32(DEV_STATUS) & DEV_STATUS_STOPPED, 0);

    // After RUNNING the command runs again from the start, once, and this time the client
    // answers.
    d.t.0.set_dma_handler(Some(Box::new(ring)));
    d.t.0
        .set_mig_state(VFIO_DEVICE_STATE_RUNNING)
        .expect("RUNNING");
    let done = common::wait_for(Duration::from_secs(5), || {
        (d.r64(queue_reg(0, Q_COMPLETED_LO)) == 1).then_some(())
    });
    assert!(done.is_some(), "the fence did not complete after RUNNING");
    assert_eq!(d.mem.read_u64(FENCE_AT), 7);
    assert!(wait_eventfd(&d.completion[0], Duration::from_secs(5)).is_some());
    assert_eq!(d.r32(queue_reg(0, Q_HEAD)), 1);
    assert_eq!(d.r32(queue_reg(0, Q_ERROR_CODE)), ERR_NONE);
    assert_eq!(take_eventfd(&d.error[0]), None);
}

#[test]
fn a_client_leaving_with_a_dma_read_unanswered_latches_no_error() {
    let p = ServerProcess::start("softgpu");
    let mut d = connect(&p);
    setup_remote_queue(&mut d);
    ring_and_take_dma_read(&mut d.t.0);
    d.t.0
        .socket()
        .shutdown(std::net::Shutdown::Both)
        .expect("shutdown");
    drop(d);
    let mut c = common::wait_for(Duration::from_secs(10), || Client::connect(&p.socket).ok())
        .expect("reconnect");
    let mut b = [0u8; 4];
    c.region_read(0, queue_reg(0, Q_ERROR_CODE), &mut b)
        .expect("read");
    assert_eq!(u32::from_le_bytes(b), ERR_NONE, "{}", p.log_text());
    c.region_read(0, DEV_STATUS, &mut b).expect("read");
    assert_ne!(u32::from_le_bytes(b) & DEV_STATUS_HALTED, 0);
    c.region_read(0, queue_reg(0, Q_HEAD), &mut b)
        .expect("read");
    assert_eq!(
        u32::from_le_bytes(b),
        0,
        "the fetch runs again for the next client"
    );
}

#[test]
fn flr_and_the_register_reset_do_not_wait_for_an_unanswered_dma_read() {
    let p = ServerProcess::start("softgpu");
    let mut d = connect(&p);
    let exp = d.find_cap(0x10).expect("PCI Express capability");
    type Reset<'a> = &'a dyn Fn(&mut Driver<Ours>);
    let resets: [(&str, Reset<'_>); 2] = [
        ("FLR", &|d| {
            let devctl = d.cfg16(exp + 8) | 0x8000;
            d.t.0
                .region_write(common::driver::CONFIG, exp + 8, &devctl.to_le_bytes())
                .expect("FLR");
        }),
        ("DEV_CONTROL.RESET", &|d| {
            d.w32(DEV_CONTROL, DEV_CONTROL_RESET)
        }),
    ];
    for (name, reset) in resets {
        d.enable_device();
        setup_remote_queue(&mut d);
        ring_and_take_dma_read(&mut d.t.0);
        let t = Instant::now();
        reset(&mut d);
        let took = t.elapsed();
        eprintln!("{name} with an unanswered DMA_READ in flight: {took:?}");
        assert!(took < FAST, "{name} took {took:?}");
        assert_eq!(
            take_eventfd(&d.error[0]),
            None,
            "{name}: error vector fired"
        );
        assert_eq!(d.r32(queue_reg(0, Q_ERROR_CODE)), ERR_NONE, "{name}");
    }
}
