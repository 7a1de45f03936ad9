//! `edu-client SOCKET`: drives QEMU's `edu` device (1234:11e8) through a `switchyard serve
//! --device vfio,host=BDF` server on SOCKET, over vfio-user with our client library, and checks
//! what a physical-device backend must get right:
//!
//! - VERSION, DEVICE_GET_INFO, REGION_INFO (BAR0 1 MiB, no ROM, config space);
//! - the virtualized config space: IDs, BAR0 sizing (all-ones reads back the 1 MiB mask, the
//!   address stays in the shadow), the ROM BAR reads 0, INTx pin 0, the capability list;
//! - edu's registers through trapped BAR0 accesses: ID, liveness (0x04 reads back inverted),
//!   factorial (0x08, busy bit 0 of status 0x20);
//! - MSI: an eventfd handed over SET_IRQS is signalled by the host kernel when edu raises an
//!   interrupt (raise 0x60, status 0x24, ack 0x64);
//! - DMA: a memfd DMA_MAPped at an IOVA below edu's 28-bit DMA mask; edu's DMA engine (src
//!   0x80, dst 0x88, count 0x90, cmd 0x98) copies bytes into its buffer (0x40000) and back to
//!   another place of the memfd, verified, with its completion interrupt;
//! - a read-only DMA window (from a read-only descriptor): edu reads it, and its write to it is
//!   blocked by the IOMMU (the bytes stay);
//! - the DMA dirty report: every mapped page reads dirty (the device cannot track its writes);
//! - a DMA_MAP without a file descriptor is refused with ENOTSUP;
//! - with `bars=mmap`: BAR0 comes with the device's descriptor and a sparse area; the client
//!   maps it and reaches edu's registers without a message (ID, liveness).
//!
//! `edu-client --msix SOCKET` instead probes a device with MSI-X behind a PCIe port (the guest
//! test uses `virtio-rng-pci`): the PCI Express capability kept and vendor-specific ones
//! hidden, no extended capability, the emulated MSI-X table (masked at power-on, written and
//! read back), MSI-X eventfds handed to the kernel (all vectors, then one), a vector masked
//! and unmasked through the table (its kernel eventfd parked and restored), the PBA, the
//! sparse mmap areas leaving the table's page trapped, and DEVICE_RESET (FLR) with the config
//! space still answering (`MSIX: <step> ok`, `MSIX-SUMMARY {json}`).
//!
//! `edu-client --nvme SOCKET` drives QEMU's NVMe controller (1b36:0010) far enough to get
//! real MSI-X interrupts: admin queues in a DMA_MAPped memfd, Identify Controller completing on
//! vector 0 (its eventfd signalled by the kernel), then the same with vector 0 masked in the
//! emulated table: no signal, the PBA bit set, and the interrupt delivered on unmask
//! (`NVME: <step> ok`, `NVME-SUMMARY {json}`).
//!
//! `edu-client --abandon SOCKET` maps the DMA window and hands an MSI eventfd over, then exits
//! without undoing either: the server must unmap the window from the IOMMU and take the
//! eventfd back from the kernel when the client is gone (the next client maps the same IOVA).
//!
//! `edu-client --conformance BDF` is not a client: it runs the device conformance suite
//! (`switchyard-conformance`) on the passthrough kind itself, in this process, on the device
//! at BDF (bound to vfio-pci, no server holding it): `CONFORMANCE: <check> ok` or
//! `CONFORMANCE: <check> FAIL <why>` per check, then `CONFORMANCE-SUMMARY {json}`; exit 0
//! only when every check passed.
//!
//! Prints `EDU: <step> ok ...` per step and `EDU-SUMMARY {json}` at the end; exit 0 when every
//! step passed, 1 at the first failure (`EDU: FAIL <step>: <why>`).

#![forbid(unsafe_code)]

mod checks;
mod conformance;
mod edu;
mod migrate;
mod msix;
mod nvme;

type Result<T> = std::result::Result<T, String>;

fn ensure(cond: bool, what: impl FnOnce() -> String) -> Result<()> {
    if cond { Ok(()) } else { Err(what()) }
}

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flag, bdf] = args.as_slice()
        && flag == "--conformance"
    {
        return conformance::run_conformance(bdf);
    }
    if let [flag, src, dst] = args.as_slice()
        && flag == "--migrate"
    {
        return match migrate::run_migrate(src, dst) {
            Ok(summary) => {
                println!("MIGRATE-SUMMARY {summary}");
                std::process::ExitCode::SUCCESS
            }
            Err(e) => {
                println!("MIGRATE: FAIL {e}");
                std::process::ExitCode::FAILURE
            }
        };
    }
    let (mode, socket) = match args.as_slice() {
        [s] => ("", s),
        [flag, s] if ["--msix", "--nvme", "--abandon"].contains(&flag.as_str()) => {
            (flag.as_str(), s)
        }
        _ => {
            eprintln!(
                "usage: edu-client [--msix|--nvme|--abandon] SOCKET | --migrate SRC DST | --conformance BDF"
            );
            return std::process::ExitCode::from(2);
        }
    };
    let (result, label) = match mode {
        "--msix" => (msix::run_msix(socket), "MSIX"),
        "--nvme" => (nvme::run_nvme(socket), "NVME"),
        "--abandon" => (checks::run_abandon(socket), "ABANDON"),
        _ => (checks::run(socket), "EDU"),
    };
    match result {
        Ok(summary) => {
            println!("{label}-SUMMARY {summary}");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            println!("{label}: FAIL {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
