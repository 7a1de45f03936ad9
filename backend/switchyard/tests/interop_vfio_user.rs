//! Interoperability with the published `vfio_user` crate's `Client` — the client library
//! cloud-hypervisor uses — against a real `switchyard serve` process.
#![forbid(unsafe_code)]

mod common;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::time::Duration;

use common::ServerProcess;
use common::driver::{Driver, Transport};
use switchyard_softgpu::regs::{DOORBELL_PAGE, DOORBELL_PAGE_SIZE};
use vfio_bindings::bindings::vfio::{
    VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_DATA_EVENTFD, VFIO_REGION_INFO_FLAG_MMAP,
    VFIO_REGION_INFO_FLAG_READ, VFIO_REGION_INFO_FLAG_WRITE,
};

struct Crate(vfio_user::Client);

impl Transport for Crate {
    fn region_read(&mut self, region: u32, offset: u64, buf: &mut [u8]) {
        self.0
            .region_read(region, offset, buf)
            .expect("region_read");
    }
    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) {
        self.0
            .region_write(region, offset, data)
            .expect("region_write");
    }
    fn dma_map(&mut self, iova: u64, size: u64, file: &File, offset: u64) {
        self.0
            .dma_map(offset, iova, size, file.as_raw_fd())
            .expect("dma_map");
    }
    fn set_msix_eventfds(&mut self, start: u32, fds: &[&File]) {
        let raw: Vec<i32> = fds.iter().map(|f| f.as_raw_fd()).collect();
        self.0
            .set_irqs(
                2,
                VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
                start,
                raw.len() as u32,
                &raw,
            )
            .expect("set_irqs");
    }
}

fn connect(server: &ServerProcess) -> vfio_user::Client {
    vfio_user::Client::new(&server.socket).expect("vfio_user client connects and negotiates")
}

#[test]
fn regions_and_irqs_as_seen_by_the_crate_client() {
    let server = ServerProcess::start("softgpu,vram=64M,queues=2");
    let mut c = connect(&server);
    let bar0 = c.region(0).expect("BAR0");
    assert_eq!(bar0.size, 64 << 10);
    assert_eq!(
        bar0.flags & (VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE),
        3
    );
    // Registers are trapped; only the doorbell page is offered for mmap.
    assert_ne!(
        bar0.flags & VFIO_REGION_INFO_FLAG_MMAP,
        0,
        "BAR0 has an mmap area"
    );
    assert!(bar0.file_offset.is_some(), "the doorbell page's fd");
    assert_eq!(
        bar0.sparse_areas
            .iter()
            .map(|a| (a.offset, a.size))
            .collect::<Vec<_>>(),
        vec![(DOORBELL_PAGE, DOORBELL_PAGE_SIZE)]
    );
    let vram = c.region(2).expect("BAR2");
    assert_eq!(vram.size, 64 << 20);
    assert_ne!(
        vram.flags & VFIO_REGION_INFO_FLAG_MMAP,
        0,
        "VRAM is mmappable"
    );
    assert!(
        vram.file_offset.is_some(),
        "VRAM fd passed with the region info"
    );
    assert_eq!(vram.sparse_areas.len(), 1);
    assert_eq!(
        (vram.sparse_areas[0].offset, vram.sparse_areas[0].size),
        (0, 64 << 20)
    );
    assert_eq!(c.region(4).expect("BAR4").size, 4096);
    assert_eq!(c.region(7).expect("config").size, 4096);
    for absent in [1, 3, 5, 6, 8] {
        assert_eq!(
            c.region(absent).map_or(0, |r| r.size),
            0,
            "region {absent} absent"
        );
    }
    let msix = c.get_irq_info(2).expect("irq info");
    assert_eq!(msix.count, 16);
    assert_eq!(c.get_irq_info(4).expect("req").count, 1);
    assert_eq!(c.get_irq_info(0).expect("intx").count, 0);
}

#[test]
fn full_workload_through_the_crate_client() {
    let server = ServerProcess::start("softgpu");
    let mut d = Driver::new(Crate(connect(&server)));
    common::workload::run_all(&mut d);
}

#[test]
fn vram_mmap_and_engines_share_bytes() {
    use vm_memory::{MmapRegion, VolatileMemory};
    let server = ServerProcess::start("softgpu,vram=16M");
    let c = connect(&server);
    let fo = c
        .region(2)
        .and_then(|r| r.file_offset.clone())
        .expect("VRAM fd");
    let map = MmapRegion::<()>::from_file(fo, 16 << 20).expect("mmap VRAM like a VMM does");
    let mut d = Driver::new(Crate(c));
    d.setup_queue(0);
    // CPU writes through the mapping, the engine copies it to guest memory.
    let s = map.get_slice(0x4000, 256).expect("slice");
    s.copy_from(&[0x3c_u8; 256][..]);
    d.run(
        0,
        &[switchyard_softgpu::cmd::Command::copy(
            switchyard_softgpu::cmd::Operand::Vram(0x4000),
            common::driver::guest(0x1000),
            256,
        )],
    );
    let mut b = [0u8; 256];
    d.mem.read(0x1000, &mut b);
    assert_eq!(b, [0x3c; 256]);
    // The engine writes VRAM, the CPU sees it through the mapping.
    d.run(
        0,
        &[switchyard_softgpu::cmd::Command::fill(
            switchyard_softgpu::cmd::Operand::Vram(0x8000),
            64,
            0x11223344,
        )],
    );
    let mut v = [0u8; 8];
    map.get_slice(0x8000, 8).expect("slice").copy_to(&mut v[..]);
    assert_eq!(v, [0x44, 0x33, 0x22, 0x11, 0x44, 0x33, 0x22, 0x11]);
}

#[test]
fn reset_returns_to_power_on() {
    let server = ServerProcess::start("softgpu");
    let mut c = connect(&server);
    c.region_write(
        0,
        switchyard_softgpu::regs::SCRATCH,
        &0xabcdu32.to_le_bytes(),
    )
    .expect("write");
    c.reset().expect("reset");
    let mut b = [0u8; 4];
    c.region_read(0, switchyard_softgpu::regs::SCRATCH, &mut b)
        .expect("read");
    assert_eq!(
        u32::from_le_bytes(b),
        0,
        "scratch back to power-on after DEVICE_RESET"
    );
}

#[test]
fn reconnect_keeps_state_and_second_client_is_refused() {
    let mut server = ServerProcess::start("softgpu");
    let mut c = connect(&server);
    c.region_write(
        0,
        switchyard_softgpu::regs::SCRATCH,
        &0x5eed_u32.to_le_bytes(),
    )
    .expect("write");
    c.region_write(2, 0x100, b"kept across clients")
        .expect("vram write");
    // A second concurrent client is closed right away: negotiation fails instead of hanging.
    let second = std::thread::spawn({
        let p = server.socket.clone();
        move || vfio_user::Client::new(&p).err()
    });
    let refused = common::wait_for(Duration::from_secs(10), || {
        second.is_finished().then_some(())
    });
    assert!(refused.is_some(), "second client hung");
    // Refused means closed by the server during negotiation: the stream ends (EOF or a
    // reset), not some other failure such as a failed connect.
    let err = second
        .join()
        .expect("join")
        .expect("second client must be refused");
    let io = match &err {
        vfio_user::Error::StreamRead(e) | vfio_user::Error::StreamWrite(e) => e.kind(),
        other => panic!("second client failed in another way: {other:?}"),
    };
    assert!(
        matches!(
            io,
            std::io::ErrorKind::UnexpectedEof
                | std::io::ErrorKind::ConnectionReset
                | std::io::ErrorKind::BrokenPipe
        ),
        "{err:?}"
    );
    // The first client still works.
    let mut b = [0u8; 4];
    c.region_read(0, switchyard_softgpu::regs::SCRATCH, &mut b)
        .expect("read");
    assert_eq!(u32::from_le_bytes(b), 0x5eed);
    c.shutdown().expect("shutdown");
    drop(c);
    // Reconnect: registers and VRAM kept.
    let mut c = common::wait_for(Duration::from_secs(10), || {
        vfio_user::Client::new(&server.socket).ok()
    })
    .expect("reconnect");
    c.region_read(0, switchyard_softgpu::regs::SCRATCH, &mut b)
        .expect("read");
    assert_eq!(
        u32::from_le_bytes(b),
        0x5eed,
        "device state survives a reconnect"
    );
    let mut v = [0u8; 19];
    c.region_read(2, 0x100, &mut v).expect("vram read");
    assert_eq!(&v, b"kept across clients");
    assert!(server.alive());
    assert!(server.log_text().contains("refusing a second client"));
}
