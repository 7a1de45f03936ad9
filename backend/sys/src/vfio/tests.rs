//! `DmaMapping` against a recording IOMMU (the real one is exercised by the guest tests, where
//! the in-guest driver maps its DMA windows through the guest's `intel-iommu`).

use std::any::Any;
use std::sync::Mutex;

use vm_memory::{Bytes, VolatileMemory};

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Call {
    Map { iova: u64, size: usize, addr: usize },
    Unmap { iova: u64, size: usize },
}

#[derive(Default)]
struct FakeIommu {
    calls: Mutex<Vec<Call>>,
    fail_map: bool,
    fail_unmap: bool,
}

impl FakeIommu {
    fn calls(&self) -> Vec<Call> {
        self.calls.lock().expect("lock").clone()
    }
}

impl VfioOps for FakeIommu {
    unsafe fn vfio_dma_map(
        &self,
        iova: u64,
        size: usize,
        user_addr: *mut u8,
    ) -> vfio_ioctls::Result<()> {
        self.calls.lock().expect("lock").push(Call::Map {
            iova,
            size,
            addr: user_addr as usize,
        });
        if self.fail_map {
            return Err(VfioError::IommuDmaMap(vmm_sys_util::errno::Error::new(
                ENOMEM,
            )));
        }
        Ok(())
    }

    fn vfio_dma_unmap(&self, iova: u64, size: usize) -> vfio_ioctls::Result<()> {
        self.calls
            .lock()
            .expect("lock")
            .push(Call::Unmap { iova, size });
        if self.fail_unmap {
            return Err(VfioError::InvalidDmaUnmapSize);
        }
        Ok(())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

const ENOMEM: i32 = 12;

/// Whether `addr` is inside a mapping of this process, from `/proc/self/maps`.
fn is_mapped(addr: usize) -> bool {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("/proc/self/maps");
    maps.lines().any(|l| {
        let range = l.split_whitespace().next().expect("range");
        let (a, b) = range.split_once('-').expect("a-b");
        let a = usize::from_str_radix(a, 16).expect("hex");
        let b = usize::from_str_radix(b, 16).expect("hex");
        (a..b).contains(&addr)
    })
}

const LEN: usize = 64 << 10;

/// The tests that look at `/proc/self/maps` run one at a time, so that a region another test
/// maps cannot land on the address one of them just released.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn region() -> MmapRegion<()> {
    MmapRegion::new(LEN).expect("anonymous mmap")
}

#[test]
fn drop_unmaps_from_the_iommu_before_releasing_the_memory() {
    let _serial = serial();
    let iommu = Arc::new(FakeIommu::default());
    let mem = region();
    let addr = mem.as_ptr() as usize;
    let m = DmaMapping::new(iommu.clone(), 0x10_0000, mem).expect("map");
    assert_eq!(
        iommu.calls(),
        vec![Call::Map {
            iova: 0x10_0000,
            size: LEN,
            addr
        }]
    );
    assert_eq!((m.iova(), m.size()), (0x10_0000, LEN));
    m.memory()
        .as_volatile_slice()
        .write_obj(0xfeed_u32, 8)
        .expect("volatile write");
    assert!(is_mapped(addr));
    drop(m);
    assert_eq!(
        iommu.calls()[1..],
        [Call::Unmap {
            iova: 0x10_0000,
            size: LEN
        }]
    );
    assert!(
        !is_mapped(addr),
        "the memory is released after a successful unmap"
    );
}

#[test]
fn a_failed_unmap_leaks_the_memory_instead_of_freeing_it() {
    let _serial = serial();
    let iommu = Arc::new(FakeIommu {
        fail_unmap: true,
        ..FakeIommu::default()
    });
    let mem = region();
    let addr = mem.as_ptr() as usize;
    let m = DmaMapping::new(iommu.clone(), 0x2000, mem).expect("map");
    drop(m);
    assert_eq!(
        iommu.calls()[1..],
        [Call::Unmap {
            iova: 0x2000,
            size: LEN
        }]
    );
    assert!(
        is_mapped(addr),
        "the device may still reach it: it must stay mapped"
    );

    // The explicit form reports it.
    let mem = region();
    let addr = mem.as_ptr() as usize;
    let m = DmaMapping::new(iommu.clone(), 0x4000, mem).expect("map");
    let err = m.unmap().expect_err("unmap fails");
    assert!(
        matches!(
            err,
            Error::Unmap {
                iova: 0x4000,
                size: LEN,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("leaked"), "{err}");
    assert!(is_mapped(addr));
}

#[test]
fn unmap_gives_the_memory_back_with_its_contents() {
    let _serial = serial();
    let iommu = Arc::new(FakeIommu::default());
    let m = DmaMapping::new(iommu.clone(), 0x8000, region()).expect("map");
    m.memory()
        .as_volatile_slice()
        .write_obj(0x1234_5678_u64, 16)
        .expect("write");
    let mem = m.unmap().expect("unmap");
    assert_eq!(
        mem.as_volatile_slice().read_obj::<u64>(16).expect("read"),
        0x1234_5678
    );
    assert_eq!(iommu.calls().len(), 2);
    drop(mem);
    assert_eq!(iommu.calls().len(), 2, "no second unmap");
}

#[test]
fn a_failed_map_maps_nothing_and_unmaps_nothing() {
    let _serial = serial();
    let iommu = Arc::new(FakeIommu {
        fail_map: true,
        ..FakeIommu::default()
    });
    let err = DmaMapping::new(iommu.clone(), 0x1000, region()).expect_err("map fails");
    assert!(
        matches!(
            err,
            Error::Map {
                iova: 0x1000,
                size: LEN,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(
        iommu.calls().len(),
        1,
        "only the map attempt: {:?}",
        iommu.calls()
    );
}

#[test]
fn borrowed_memory_is_refused_before_anything_is_mapped() {
    let _serial = serial();
    let iommu = Arc::new(FakeIommu::default());
    let owner = region();
    // SAFETY: `owner` keeps the range mapped for the lifetime of `borrowed`, which is dropped
    // (without unmapping: it does not own the range) before `owner`.
    let borrowed =
        unsafe { MmapRegion::<()>::build_raw(owner.as_ptr(), LEN, owner.prot(), owner.flags()) }
            .expect("borrowed region");
    let err = DmaMapping::new(iommu.clone(), 0x1000, borrowed).expect_err("refused");
    assert!(
        matches!(err, Error::BorrowedMemory { iova: 0x1000 }),
        "{err}"
    );
    assert!(iommu.calls().is_empty());
    drop(owner);
}

/// `_IOC(dir, type, nr, size)` of the kernel's `asm-generic/ioctl.h`: the direction in bits
/// 30–31, the size in bits 16–29, the type in bits 8–15, the number in bits 0–7.
fn header_ioc(
    dir: libc::c_ulong,
    ty: libc::c_ulong,
    nr: libc::c_ulong,
    size: libc::c_ulong,
) -> libc::c_ulong {
    (dir << 30) | (size << 16) | (ty << 8) | nr
}

/// `_IOC_NONE`: `_IO` requests carry no data.
const IOC_NONE: libc::c_ulong = 0;

#[test]
fn the_request_numbers_are_the_kernel_headers() {
    // `linux/vfio.h`: `#define VFIO_TYPE (';')`, `#define VFIO_BASE 100`.
    assert_eq!(vfio_bindings::bindings::vfio::VFIO_TYPE, b';');
    assert_eq!(vfio_bindings::bindings::vfio::VFIO_BASE, 100);
    for (name, got, n, header) in [
        // `#define VFIO_DEVICE_SET_IRQS _IO(VFIO_TYPE, VFIO_BASE + 10)`
        (
            "VFIO_DEVICE_SET_IRQS",
            nr::VFIO_DEVICE_SET_IRQS(),
            10,
            0x3B6E,
        ),
        // `#define VFIO_DEVICE_RESET _IO(VFIO_TYPE, VFIO_BASE + 11)`
        ("VFIO_DEVICE_RESET", nr::VFIO_DEVICE_RESET(), 11, 0x3B6F),
        // `#define VFIO_IOMMU_MAP_DMA _IO(VFIO_TYPE, VFIO_BASE + 13)`
        ("VFIO_IOMMU_MAP_DMA", nr::VFIO_IOMMU_MAP_DMA(), 13, 0x3B71),
    ] {
        // `_IO(type, nr)` is `_IOC(_IOC_NONE, type, nr, 0)`.
        assert_eq!(got, header_ioc(IOC_NONE, 0x3B, 100 + n, 0), "{name}");
        assert_eq!(got, header, "{name}");
    }
}
