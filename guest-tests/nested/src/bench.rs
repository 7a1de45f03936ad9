//! The latency benchmarks: MMIO reads from L2 through each path a register can take
//! (`mmio-bench`), edu's MSI to an eventfd through VFIO and through switchyard (`irq-bench`),
//! and the AF_UNIX round trip in L1 under both.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};
use switchyard_ch::UserDeviceConfig;

use crate::l2::{l2_cmdline, l2_spec};
use crate::procs::{Server, Vm};
use crate::{DEVICE, L2_TIMEOUT, SWITCHYARD, bind_vfio};

/// AF_UNIX ping-pong in L1 between two threads (one byte each way, blocking): the floor under
/// any vfio-user round trip in L1, measured in the same run. Per-round-trip p50 and mean, ns.
fn l1_socket_floor(rounds: u32) -> Result<Value> {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;
    let (mut a, mut b) = UnixStream::pair()?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let mut buf = [0u8; 1];
        loop {
            if b.read(&mut buf)? == 0 {
                return Ok(());
            }
            b.write_all(&buf)?;
        }
    });
    let mut each = Vec::with_capacity(rounds as usize);
    let mut buf = [0u8; 1];
    for i in 0..rounds + 50 {
        let t = Instant::now();
        a.write_all(&[1])?;
        a.read_exact(&mut buf)?;
        if i >= 50 {
            each.push(t.elapsed().as_nanos() as f64);
        }
    }
    drop(a);
    echo.join()
        .map_err(|_| anyhow::anyhow!("echo thread panicked"))??;
    each.sort_by(f64::total_cmp);
    let mean = each.iter().sum::<f64>() / each.len() as f64;
    Ok(json!({ "p50": each[each.len() / 2], "mean": mean, "rounds": rounds }))
}

/// MMIO reads from L2 user space through each path a register can take: a device assigned
/// directly (edu through VFIO in L1: no exit), a device cloud-hypervisor emulates (its
/// virtio-rng: an exit to the VMM), and the softgpu's trapped BAR0 over vfio-user (an exit,
/// then the socket to switchyard). Needs L0 to give L1 an `edu` and `intel-iommu,intremap=on`.
pub fn mmio_bench(dir: &Path, count: u32) -> Result<Value> {
    let edus = bind_vfio("1234:11e8")?;
    let server = Server::start(Path::new(SWITCHYARD), dir, "gpu-bench", DEVICE)?;
    let count_s = count.to_string();
    let targets = [
        "direct=1234:11e8:0:0:0",
        "vmm-emulated=1af4:1044:0:0:0",
        "vfio-user-trapped=1234:5347:0:0:0",
    ];
    let mut args = vec!["--count", count_s.as_str()];
    args.extend_from_slice(&targets);
    let mut spec = l2_spec(
        "bench",
        l2_cmdline("mmio-bench", &args).replace(" quiet", " quiet iomem=relaxed"),
    );
    spec.user_devices = vec![UserDeviceConfig::new(&server.socket).id("gpu0")];
    spec.vfio_devices = vec![PathBuf::from(format!("/sys/bus/pci/devices/{}/", edus[0]))];
    let mut vm = Vm::start(dir, spec)?;
    let rc_line = vm.wait_line("GUEST: test mmio-bench rc=", L2_TIMEOUT)?;
    let status = vm.wait_exit(Duration::from_secs(60))?;
    let mut rows = serde_json::Map::new();
    for l in vm.lines() {
        if let Some(j) = l.trim().strip_prefix("SY-MMIO ") {
            let v: Value = serde_json::from_str(j).context("SY-MMIO JSON")?;
            let label = v["label"].as_str().unwrap_or("?").to_owned();
            rows.insert(label, v);
        }
    }
    let p50 = |k: &str| rows.get(k).and_then(|v| v["read_ns"]["p50"].as_f64());
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => json!(a / b),
        _ => Value::Null,
    };
    let ok = rc_line.ends_with("rc=0") && status.success() && rows.len() == targets.len();
    let floor = l1_socket_floor(count)?;
    Ok(json!({
        "ok": ok,
        "count": count,
        "rows": rows,
        "l1_socket_rtt_ns": floor,
        "trapped_vs_direct_p50": ratio(p50("vfio-user-trapped"), p50("direct")),
        "trapped_vs_vmm_exit_p50": ratio(p50("vfio-user-trapped"), p50("vmm-emulated")),
        "ch_exit": status.code(),
    }))
}

/// p50/p90/max of a set of durations, in µs.
fn stats_us(mut v: Vec<f64>) -> Value {
    if v.is_empty() {
        return Value::Null;
    }
    v.sort_by(f64::total_cmp);
    let at = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    json!({ "p50": at(0.5), "p90": at(0.9), "max": v[v.len() - 1], "n": v.len() })
}

/// Waits until a non-blocking eventfd is signalled (spinning on `read`), up to 5 s.
fn wait_eventfd(fd: &std::fs::File) -> Result<()> {
    use std::io::Read;
    let t = Instant::now();
    let mut buf = [0u8; 8];
    loop {
        match (&*fd).read(&mut buf) {
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                ensure!(
                    t.elapsed() < Duration::from_secs(5),
                    "no interrupt within 5 s"
                );
                std::hint::spin_loop();
            }
            Err(e) => return Err(e.into()),
        }
    }
}

fn new_eventfd() -> Result<std::fs::File> {
    Ok(std::fs::File::from(rustix::event::eventfd(
        0,
        rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC,
    )?))
}

const EDU_IRQ_RAISE: u64 = 0x60;
const EDU_IRQ_ACK: u64 = 0x64;
const EDU_LIVENESS: u64 = 0x04;

/// edu's MSI through switchyard as a VMM sees it: raise (a region write) → the client's eventfd.
fn irq_through_switchyard(dir: &Path, bdf: &str, opts: &str, rounds: u32) -> Result<Value> {
    use std::os::fd::AsFd;
    let name = if opts.is_empty() {
        "irq-direct"
    } else {
        "irq-relay"
    };
    let server = Server::start(
        Path::new(SWITCHYARD),
        dir,
        name,
        &format!("vfio,host={bdf}{opts}"),
    )?;
    let mut c = switchyard_client::Client::connect(&server.socket)?;
    // Memory space on, then MSI enabled in the (emulated) capability, as a guest would.
    let mut cfg = vec![0u8; 256];
    c.region_read(7, 0, &mut cfg)?;
    let cmd = u16::from_le_bytes([cfg[4], cfg[5]]) | 0x6;
    c.region_write(7, 4, &cmd.to_le_bytes())?;
    let mut p = cfg[0x34] & 0xfc;
    let mut msi = None;
    while p >= 0x40 && msi.is_none() {
        if cfg[p as usize] == 0x05 {
            msi = Some(u64::from(p));
        }
        p = cfg[p as usize + 1] & 0xfc;
    }
    let msi = msi.context("edu has no MSI capability in the client's view")?;
    let ctl = u16::from_le_bytes([cfg[msi as usize + 2], cfg[msi as usize + 3]]) | 1;
    c.region_write(7, msi + 2, &ctl.to_le_bytes())?;
    let efd = new_eventfd()?;
    c.set_irqs(
        1,
        switchyard_proto::consts::VFIO_IRQ_SET_DATA_EVENTFD
            | switchyard_proto::consts::VFIO_IRQ_SET_ACTION_TRIGGER,
        0,
        1,
        &[efd.as_fd()],
    )?;
    let (mut raise, mut write) = (vec![], vec![]);
    for i in 0..rounds + 20 {
        let t = Instant::now();
        c.region_write(0, EDU_LIVENESS, &i.to_le_bytes())?;
        let w = t.elapsed();
        let t = Instant::now();
        c.region_write(0, EDU_IRQ_RAISE, &1u32.to_le_bytes())?;
        wait_eventfd(&efd)?;
        let r = t.elapsed();
        c.region_write(0, EDU_IRQ_ACK, &1u32.to_le_bytes())?;
        if i >= 20 {
            write.push(w.as_secs_f64() * 1e6);
            raise.push(r.as_secs_f64() * 1e6);
        }
    }
    drop(c);
    Ok(json!({ "raise_to_eventfd_us": stats_us(raise), "write_rtt_us": stats_us(write) }))
}

/// Interrupt latency: edu's MSI delivered to an eventfd (1) by VFIO in L1 directly (the floor),
/// (2) through switchyard with the client's eventfds handed to VFIO (`SET_IRQS` straight to the
/// kernel: the interrupt never passes through the server), (3) through switchyard relaying
/// (the kernel signals the server, a server thread signals the client). Each number includes the
/// region write that raises the interrupt; the write's own round trip is measured beside it.
pub fn irq_bench(dir: &Path, rounds: u32) -> Result<Value> {
    use sygpu_driver::irq::IrqMode;
    let edus = bind_vfio("1234:11e8")?;
    ensure!(
        edus.len() >= 2,
        "irq-bench needs two edus (L0: nested_with_devices(.., 2, ..))"
    );
    // (1) VFIO directly in L1.
    let sys = sygpu_driver::sysfs::Sysfs::system();
    let dev = sys.read_device(&edus[0]).map_err(anyhow::Error::msg)?;
    let group = dev.iommu_group.context("edu has no IOMMU group")?;
    let vfio =
        sygpu_driver::vfio::Vfio::open(&sys.device_dir(&edus[0]), group, Duration::from_secs(5))
            .map_err(anyhow::Error::msg)?;
    let bar = vfio.map_region(0).map_err(anyhow::Error::msg)?;
    let mut cmd = [0u8; 2];
    vfio.cfg_read(4, &mut cmd).map_err(anyhow::Error::msg)?;
    let c = u16::from_le_bytes(cmd) | 0x6;
    vfio.cfg_write(4, &c.to_le_bytes())
        .map_err(anyhow::Error::msg)?;
    let efd = vmm_sys_util::eventfd::EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK)?;
    vfio.enable_irqs(IrqMode::Msi, vec![&efd])
        .map_err(anyhow::Error::msg)?;
    let mut floor = vec![];
    for i in 0..rounds + 20 {
        let t = Instant::now();
        bar.w32(EDU_IRQ_RAISE, 1);
        let start = Instant::now();
        loop {
            match efd.read() {
                Ok(_) => break,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    ensure!(
                        start.elapsed() < Duration::from_secs(5),
                        "no MSI from edu in L1"
                    );
                    std::hint::spin_loop();
                }
                Err(e) => return Err(e.into()),
            }
        }
        let r = t.elapsed();
        bar.w32(EDU_IRQ_ACK, 1);
        if i >= 20 {
            floor.push(r.as_secs_f64() * 1e6);
        }
    }
    vfio.disable_irqs(IrqMode::Msi)
        .map_err(anyhow::Error::msg)?;
    drop(vfio);
    let direct = irq_through_switchyard(dir, &edus[1], "", rounds)?;
    let relay = irq_through_switchyard(dir, &edus[1], ",irq=relay", rounds)?;
    let socket = l1_socket_floor(rounds)?;
    let p50 = |v: &Value| v["raise_to_eventfd_us"]["p50"].as_f64();
    let floor_s = stats_us(floor);
    Ok(json!({
        "ok": true,
        "rounds": rounds,
        "vfio_in_l1_us": floor_s,
        "switchyard_eventfd_to_vfio": direct,
        "switchyard_relay": relay,
        "l1_socket_rtt_ns": socket,
        "relay_vs_direct_p50": match (p50(&relay), p50(&direct)) {
            (Some(a), Some(b)) if b > 0.0 => json!(a / b),
            _ => Value::Null,
        },
    }))
}
