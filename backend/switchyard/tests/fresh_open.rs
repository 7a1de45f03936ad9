//! A new client finds the device as a new user of kernel vfio-pci does: its PCI function as
//! after a reset (config space at power-on), the device's memory as the kind keeps it; and a
//! client that leaves its device stopped (a guest's poweroff, a migrated source's VMM) has
//! abandoned no migration, while the next client finds the device running. Against real
//! `switchyard serve` processes, at the protocol level.
#![forbid(unsafe_code)]

mod common;

use std::time::Duration;

use common::ServerProcess;
use switchyard_client::Client;
use switchyard_proto::consts::*;

const CONFIG: u32 = VFIO_PCI_CONFIG_REGION_INDEX;

/// A client once the previous one is gone (a second concurrent client is refused, so the
/// handshake succeeds only once the server has torn the previous one down).
fn next_client(server: &ServerProcess) -> Client {
    common::wait_for(Duration::from_secs(10), || {
        Client::connect(&server.socket).ok()
    })
    .expect("connect")
}

fn config(c: &mut Client) -> Vec<u8> {
    let size = c.region_info(CONFIG).expect("config region").info.size;
    let mut v = vec![0u8; usize::try_from(size).expect("size")];
    c.region_read(CONFIG, 0, &mut v).expect("read config");
    v
}

fn u16_at(cs: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([cs[at], cs[at + 1]])
}

/// The offset of capability `id` in `cs`.
fn cap(cs: &[u8], id: u8) -> Option<usize> {
    let mut p = usize::from(cs[0x34]);
    for _ in 0..48 {
        if p == 0 {
            return None;
        }
        if cs[p] == id {
            return Some(p);
        }
        p = usize::from(cs[p + 1]);
    }
    None
}

/// What a guest's driver writes: COMMAND (memory, bus master), BAR0's address, the interrupt
/// line, PCIe Device Control (0x2810 → 0x2830, what a Linux guest writes), MSI-X enable with
/// the function mask. Returns the space as it then reads, checked to differ from `fresh`
/// where written.
fn write_as_a_guest(c: &mut Client, fresh: &[u8]) -> Vec<u8> {
    c.region_write(CONFIG, 0x04, &0x0006u16.to_le_bytes())
        .expect("COMMAND");
    c.region_write(CONFIG, 0x10, &0xfe00_0000u32.to_le_bytes())
        .expect("BAR0");
    c.region_write(CONFIG, 0x3c, &[11]).expect("interrupt line");
    let exp = cap(fresh, 0x10).expect("PCI Express capability");
    c.region_write(CONFIG, (exp + 8) as u64, &0x2830u16.to_le_bytes())
        .expect("Device Control");
    if let Some(msix) = cap(fresh, 0x11) {
        let ctl = u16_at(fresh, msix + 2) | 0xc000;
        c.region_write(CONFIG, (msix + 2) as u64, &ctl.to_le_bytes())
            .expect("MSI-X control");
    }
    let written = config(c);
    assert_eq!(u16_at(&written, 0x04) & 0x6, 0x6, "COMMAND not written");
    assert_eq!(
        u16_at(&written, exp + 8),
        0x2830,
        "Device Control not written"
    );
    if let Some(msix) = cap(fresh, 0x11) {
        assert_eq!(
            u16_at(&written, msix + 2) & 0xc000,
            0xc000,
            "MSI-X not enabled"
        );
    }
    written
}

/// Client 1 writes config space as a guest would and leaves; client 2 reads the power-on
/// values, byte for byte.
fn config_is_fresh_for_the_next_client(device: &str) {
    let server = ServerProcess::start(device);
    let mut c = Client::connect(&server.socket).expect("connect");
    let fresh = config(&mut c);
    let written = write_as_a_guest(&mut c, &fresh);
    assert_ne!(written, fresh);
    drop(c);
    let mut c = next_client(&server);
    let seen = config(&mut c);
    let differ: Vec<usize> = (0..fresh.len()).filter(|&i| seen[i] != fresh[i]).collect();
    assert!(
        differ.is_empty(),
        "{device}: the next client finds what the last one wrote at {differ:#x?}"
    );
}

#[test]
fn a_new_client_keeps_the_softgpu_registers_and_vram_but_not_its_config() {
    use switchyard_softgpu::regs::SCRATCH;
    let server = ServerProcess::start("softgpu,vram=16M");
    let mut c = Client::connect(&server.socket).expect("connect");
    let fresh = config(&mut c);
    write_as_a_guest(&mut c, &fresh);
    c.region_write(0, SCRATCH, &0x5eed_u32.to_le_bytes())
        .expect("scratch");
    c.region_write(2, 0x100, b"kept across clients")
        .expect("vram write");
    drop(c);
    let mut c = next_client(&server);
    assert_eq!(config(&mut c), fresh, "config space not fresh");
    let mut b = [0u8; 4];
    c.region_read(0, SCRATCH, &mut b).expect("read");
    assert_eq!(u32::from_le_bytes(b), 0x5eed, "registers are kept");
    let mut v = [0u8; 19];
    c.region_read(2, 0x100, &mut v).expect("vram read");
    assert_eq!(&v, b"kept across clients", "VRAM is kept");
}

#[test]
fn a_new_softgpu_client_with_msi_finds_a_fresh_config_space() {
    config_is_fresh_for_the_next_client("softgpu,vram=16M,irq=msi");
}

#[test]
fn a_new_scratchpad_client_finds_a_fresh_config_space() {
    config_is_fresh_for_the_next_client("scratchpad,size=64K");
}

#[test]
fn a_client_leaving_its_device_stopped_abandons_no_migration_and_the_next_finds_it_running() {
    let server = ServerProcess::start("softgpu,vram=16M");
    let mut c = Client::connect(&server.socket).expect("connect");
    c.set_mig_state(VFIO_DEVICE_STATE_STOP).expect("STOP");
    drop(c);
    let mut c = next_client(&server);
    assert_eq!(
        c.mig_state().expect("state"),
        VFIO_DEVICE_STATE_RUNNING,
        "the next client finds the device running"
    );
    let log = server.log_text();
    assert!(
        log.contains("client gone leaving its device stopped"),
        "{log}"
    );
    assert!(!log.contains("abandoned"), "{log}");
    // A client leaving with a stream open has abandoned a migration.
    c.set_mig_state(VFIO_DEVICE_STATE_PRE_COPY)
        .expect("PRE_COPY");
    drop(c);
    let mut c = next_client(&server);
    assert_eq!(c.mig_state().expect("state"), VFIO_DEVICE_STATE_RUNNING);
    let log = server.log_text();
    assert!(
        log.contains("client gone during migration; abandoned") && log.contains("PreCopy"),
        "{log}"
    );
}
