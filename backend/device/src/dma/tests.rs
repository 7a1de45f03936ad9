use super::backing::ObjectMap;
use super::*;
use crate::dirty::DirtyLog;
use std::io::Write;

pub(super) fn memfd(size: usize) -> File {
    let mfd = memfd::MemfdOptions::default()
        .create("dma-test")
        .expect("memfd");
    let f = mfd.into_file();
    f.set_len(size as u64).expect("set_len");
    f
}

/// A memfd sealed against shrinking, as QEMU's `memory-backend-memfd` makes them.
fn sealed_memfd(size: usize) -> File {
    let mfd = memfd::MemfdOptions::default()
        .allow_sealing(true)
        .create("dma-test-sealed")
        .expect("memfd");
    mfd.as_file().set_len(size as u64).expect("set_len");
    mfd.add_seals(&[memfd::FileSeal::SealShrink, memfd::FileSeal::SealGrow])
        .expect("seal");
    mfd.into_file()
}

#[test]
fn only_sealed_memfds_are_accessed_directly() {
    let dma = DmaSpace::new(8);
    dma.map(
        0x1000,
        0x1000,
        DmaProt::READ_WRITE,
        Some((sealed_memfd(0x1000), 0)),
    )
    .expect("sealed");
    dma.map(
        0x2000,
        0x1000,
        DmaProt::READ_WRITE,
        Some((memfd(0x1000), 0)),
    )
    .expect("unsealed");
    let tmp = tempfile_in_tmp(0x1000);
    dma.map(0x3000, 0x1000, DmaProt::READ_WRITE, Some((tmp, 0)))
        .expect("plain file");
    let direct: Vec<bool> = dma.mappings().iter().map(|m| m.direct).collect();
    assert_eq!(direct, [true, false, false]);
    // Both paths move the same bytes.
    let data: Vec<u8> = (0..0x3000u32).map(|i| (i * 7) as u8).collect();
    dma.write(0x1000, &data).expect("write across all three");
    let mut back = vec![0u8; 0x3000];
    dma.read(0x1000, &mut back).expect("read back");
    assert_eq!(back, data);
}

fn tempfile_in_tmp(size: u64) -> File {
    let path = std::env::temp_dir().join(format!("sy-dma-{}-{size}", std::process::id()));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .expect("temp file");
    std::fs::remove_file(&path).expect("unlink");
    f.set_len(size).expect("set_len");
    f
}

#[test]
fn a_truncated_file_fails_the_access_instead_of_killing_the_process() {
    let f = memfd(0x10000);
    let client = f.try_clone().expect("clone");
    let dma = DmaSpace::new(8);
    dma.map(0x10000, 0x10000, DmaProt::READ_WRITE, Some((f, 0)))
        .expect("map");
    dma.start_logging(4096).expect("log");
    dma.write_u64(0x1f000, 1).expect("before the truncation");
    client.set_len(0x8000).expect("the client shrinks its file");
    // Below the new end: fine. At or past it: a clean EFAULT, never SIGBUS.
    dma.write_u64(0x17ff8, 2).expect("still backed");
    assert_eq!(dma.read_u64(0x17ff8).expect("read"), 2);
    let e = dma.write_u64(0x18000, 3).expect_err("truncated page");
    assert!(matches!(e, DmaError::Fault { iova: 0x18000 }), "{e:?}");
    assert_eq!(e.errno(), libc::EFAULT);
    let e = dma
        .read(0x17000, &mut [0u8; 0x2000])
        .expect_err("straddles the end");
    assert!(matches!(e, DmaError::Fault { .. }), "{e:?}");
    let mut buf = vec![0u8; 0x100];
    dma.copy_to_slice(0x1f000, &VolatileSlice::from(&mut buf[..]))
        .expect_err("device copy from a truncated page");
    // The window is still there and can be unmapped cleanly.
    assert_eq!(dma.unmap(0x10000, 0x10000).expect("unmap"), 1);
}

#[test]
fn hugetlb_holes_with_no_huge_pages_fail_cleanly() {
    let Ok(mfd) = memfd::MemfdOptions::default()
        .hugetlb(Some(memfd::HugetlbSize::Huge2MB))
        .create("dma-test-huge")
    else {
        panic!("this kernel cannot create hugetlb memfds (CONFIG_HUGETLBFS)");
    };
    let f = mfd.into_file();
    f.set_len(4 << 20).expect("set_len (reserves nothing)");
    let dma = DmaSpace::new(8);
    // A 4 KiB window in the middle of a huge page: the mmap is aligned down and up.
    dma.map(0x5000, 0x1000, DmaProt::READ_WRITE, Some((f, 0x20_3000)))
        .expect("hugetlb window");
    assert!(!dma.mappings()[0].direct, "hugetlbfs is always guarded");
    let free = std::fs::read_to_string("/proc/sys/vm/nr_hugepages").unwrap_or_default();
    match dma.write_u64(0x5008, 7) {
        Ok(()) => {
            // A huge page was free: the bytes must be where they belong.
            assert_ne!(free.trim(), "0");
            assert_eq!(dma.read_u64(0x5008).expect("read"), 7);
        }
        Err(e) => {
            assert!(matches!(e, DmaError::Fault { iova: 0x5008 }), "{e:?}");
        }
    }
}

#[test]
fn windows_of_one_object_share_one_mapping_and_one_open_file() {
    let f = sealed_memfd(0x40000);
    let dma = DmaSpace::new(128);
    for i in 0..64u64 {
        let dup = f.try_clone().expect("dup");
        dma.map(
            0x100000 + i * 0x1000,
            0x1000,
            DmaProt::READ_WRITE,
            Some((dup, i * 0x1000)),
        )
        .expect("map");
    }
    // A read-only window of the same file shares it too.
    dma.map(
        0x200000,
        0x1000,
        DmaProt::READ_ONLY,
        Some((f.try_clone().expect("dup"), 0)),
    )
    .expect("ro map");
    let table = dma.read_table();
    let objs: Vec<&Arc<ObjectMap>> = table
        .maps
        .iter()
        .filter_map(|m| match &m.backing {
            Backing::Fd(w) => Some(&w.obj),
            Backing::Message => None,
        })
        .collect();
    assert_eq!(objs.len(), 65);
    assert!(
        objs.iter().all(|o| Arc::ptr_eq(o, objs[0])),
        "one mapping for all"
    );
    // 65 windows hold it; every duplicate descriptor the "client" sent is closed.
    assert_eq!(Arc::strong_count(objs[0]), 65);
    drop(table);
    // The windows see the file where their offsets say.
    use std::os::unix::fs::FileExt;
    f.write_all_at(&7u64.to_ne_bytes(), 5 * 0x1000 + 8)
        .expect("pwrite");
    assert_eq!(dma.read_u64(0x100000 + 5 * 0x1000 + 8).expect("read"), 7);
    // A window past the end of the first mapping (the file grew) gets a new one.
    f.set_len(0x80000).expect_err("sealed against growing");
    let g = memfd(0x1000);
    dma.map(
        0x300000,
        0x1000,
        DmaProt::READ_WRITE,
        Some((g.try_clone().expect("dup"), 0)),
    )
    .expect("map");
    g.set_len(0x3000).expect("grow");
    dma.map(
        0x301000,
        0x1000,
        DmaProt::READ_WRITE,
        Some((g.try_clone().expect("dup"), 0x2000)),
    )
    .expect("map past the first mapping");
    dma.write_u64(0x301000, 9).expect("write");
    let mut b = [0u8; 8];
    g.read_exact_at(&mut b, 0x2000).expect("pread");
    assert_eq!(u64::from_ne_bytes(b), 9);
}

#[test]
fn dirty_logs_are_allocated_at_start_within_the_budget() {
    let dma = DmaSpace::new(8);
    // 16 TiB of sparse memfd is free for a client; mapping it costs no log memory.
    let f = memfd(0);
    f.set_len(1 << 44).expect("sparse");
    dma.map(1 << 44, 1 << 44, DmaProt::READ_WRITE, Some((f, 0)))
        .expect("huge window");
    assert_eq!(
        dma.log_bytes(),
        0,
        "nothing allocated before logging starts"
    );
    let e = dma
        .start_logging(4096)
        .expect_err("1 GiB of bitmaps is over budget");
    assert!(matches!(e, DmaError::LogBudget { .. }), "{e:?}");
    assert_eq!(e.errno(), libc::ENOMEM);
    assert_eq!(dma.logging(), None, "no session was started");
    assert_eq!(dma.log_bytes(), 0);
    // A budget that fits: allocated then, and given back at unmap.
    dma.unmap(1 << 44, 1 << 44).expect("unmap");
    let f = memfd(0);
    f.set_len(1 << 36).expect("sparse");
    dma.map(1 << 44, 1 << 36, DmaProt::READ_WRITE, Some((f, 0)))
        .expect("64 GiB window");
    dma.set_log_budget(DirtyLog::bytes_for(1 << 36));
    dma.start_logging(4096).expect("within the budget");
    assert_eq!(dma.log_bytes(), DirtyLog::bytes_for(1 << 36));
    // A window mapped during the session needs its log too: refused beyond the budget.
    dma.set_log_budget(dma.log_bytes() + 10);
    let e = dma
        .map(
            0x10000,
            0x100000,
            DmaProt::READ_WRITE,
            Some((memfd(0x100000), 0)),
        )
        .expect_err("over budget");
    assert_eq!(e.errno(), libc::ENOMEM);
    assert_eq!(dma.mappings().len(), 1, "the refused window was not mapped");
    dma.unmap(1 << 44, 1 << 36).expect("unmap");
    assert_eq!(dma.log_bytes(), 0);
}

#[test]
fn mappings_are_bounded_by_an_address_space_budget() {
    let dma = DmaSpace::new(8);
    let huge = |len: u64| {
        let f = memfd(0);
        f.set_len(len).expect("sparse");
        f
    };
    // Two windows of 32 TiB fill the budget; a third is refused before it is mapped.
    dma.map(0, 1 << 45, DmaProt::READ_WRITE, Some((huge(1 << 45), 0)))
        .expect("first");
    dma.map(
        1 << 45,
        1 << 45,
        DmaProt::READ_WRITE,
        Some((huge(1 << 45), 0)),
    )
    .expect("second");
    let e = dma
        .map(
            2 << 45,
            1 << 40,
            DmaProt::READ_WRITE,
            Some((huge(1 << 40), 0)),
        )
        .expect_err("over the budget");
    assert_eq!(e.errno(), libc::ENOMEM);
    // Unmapping gives the address space back.
    dma.unmap(0, 1 << 45).expect("unmap");
    dma.map(
        2 << 45,
        1 << 40,
        DmaProt::READ_WRITE,
        Some((huge(1 << 40), 0)),
    )
    .expect("room again");
}

#[test]
fn a_window_larger_than_the_address_space_is_refused() {
    let dma = DmaSpace::new(8);
    let f = memfd(0);
    f.set_len(1 << 50).expect("sparse");
    let e = dma
        .map(0, 1 << 50, DmaProt::READ_WRITE, Some((f, 0)))
        .expect_err("cannot be mapped");
    assert_eq!(e.errno(), libc::ENOMEM);
    assert!(dma.mappings().is_empty());
}

#[test]
fn map_rejects_overlap_and_empty() {
    let dma = DmaSpace::new(8);
    dma.map(
        0x1000,
        0x2000,
        DmaProt::READ_WRITE,
        Some((memfd(0x2000), 0)),
    )
    .expect("map");
    for (iova, size) in [
        (0x0, 0x1001),
        (0x2fff, 0x10),
        (0x1800, 0x10),
        (0x0, 0x10000),
    ] {
        let e = dma
            .map(iova, size, DmaProt::READ_WRITE, None)
            .expect_err("overlap");
        assert_eq!(e.errno(), libc::EEXIST, "{iova:#x}+{size:#x}");
    }
    assert_eq!(
        dma.map(0x5000, 0, DmaProt::READ_WRITE, None)
            .expect_err("empty")
            .errno(),
        libc::EINVAL
    );
    assert_eq!(
        dma.map(u64::MAX - 10, 0x100, DmaProt::READ_WRITE, None)
            .expect_err("wrap")
            .errno(),
        libc::EINVAL
    );
    // Adjacent windows are fine.
    dma.map(0x0, 0x1000, DmaProt::READ_WRITE, None)
        .expect("adjacent below");
    dma.map(0x3000, 0x1000, DmaProt::READ_WRITE, None)
        .expect("adjacent above");
    assert_eq!(dma.mappings().len(), 3);
}

#[test]
fn unmap_removes_whole_windows_only() {
    let dma = DmaSpace::new(8);
    dma.map(0x1000, 0x2000, DmaProt::READ_WRITE, None)
        .expect("map");
    assert_eq!(
        dma.unmap(0x1000, 0x1000).expect_err("partial").errno(),
        libc::EINVAL
    );
    assert_eq!(
        dma.unmap(0x9000, 0x1000)
            .expect("never mapped: nothing to do"),
        0,
        "like type1, an unmap of nothing succeeds"
    );
    assert_eq!(dma.unmap(0x1000, 0x2000).expect("exact"), 1);
    assert!(dma.mappings().is_empty());
    // One large range removes every window inside it (vIOMMU invalidation).
    for i in 0..4u64 {
        dma.map(0x10000 * (i + 1), 0x1000, DmaProt::READ_WRITE, None)
            .expect("map");
    }
    assert_eq!(dma.unmap(0, 1 << 39).expect("range"), 4);
    assert!(dma.mappings().is_empty());
    // A range that ends exactly at 2^64 is valid.
    dma.map(0xfff0_0000, 0x1000, DmaProt::READ_WRITE, None)
        .expect("map");
    assert_eq!(
        dma.unmap(0xfef0_0000, 0u64.wrapping_sub(0xfef0_0000))
            .expect("to the top"),
        1
    );
    assert_eq!(dma.unmap(0, u64::MAX).expect("nothing left"), 0);
}

#[test]
fn access_spans_windows_and_lands_in_the_file() {
    let f1 = memfd(0x1000);
    let f2 = memfd(0x1000);
    let mut f1c = f1.try_clone().expect("clone");
    let dma = DmaSpace::new(8);
    dma.map(0x10000, 0x1000, DmaProt::READ_WRITE, Some((f1, 0)))
        .expect("map1");
    dma.map(0x11000, 0x1000, DmaProt::READ_WRITE, Some((f2, 0)))
        .expect("map2");
    let data: Vec<u8> = (0..0x200u32).map(|i| i as u8).collect();
    dma.write(0x10f00, &data).expect("write across the seam");
    let mut back = vec![0u8; 0x200];
    dma.read(0x10f00, &mut back).expect("read back");
    assert_eq!(back, data);
    // The bytes really are in the client's file.
    use std::os::unix::fs::FileExt;
    let mut head = [0u8; 4];
    f1c.read_exact_at(&mut head, 0xf00).expect("pread");
    assert_eq!(head, [0, 1, 2, 3]);
    f1c.flush().expect("flush");
}

#[test]
fn bad_accesses_fail_before_writing_anything() {
    let f = memfd(0x1000);
    let fc = f.try_clone().expect("clone");
    let dma = DmaSpace::new(8);
    dma.map(0x1000, 0x1000, DmaProt::READ_WRITE, Some((f, 0)))
        .expect("map");
    dma.map(0x3000, 0x1000, DmaProt::READ_ONLY, None)
        .expect("ro map");
    // Runs off the end of the window into a hole.
    let e = dma.write(0x1ff0, &[0xaa; 0x20]).expect_err("hole");
    assert_eq!(e.errno(), libc::EFAULT);
    use std::os::unix::fs::FileExt;
    let mut b = [0u8; 0x10];
    fc.read_exact_at(&mut b, 0xff0).expect("pread");
    assert_eq!(
        b, [0u8; 0x10],
        "nothing may be written when the access is invalid"
    );
    assert_eq!(
        dma.write(0x3000, &[1]).expect_err("ro").errno(),
        libc::EPERM
    );
    assert_eq!(
        dma.read(u64::MAX - 1, &mut [0; 4])
            .expect_err("wrap")
            .errno(),
        libc::EFAULT
    );
}

#[test]
fn message_windows_go_through_the_remote() {
    struct Echo(std::sync::Mutex<Vec<u8>>);
    impl RemoteDma for Echo {
        fn read(&self, iova: u64, buf: &mut [u8]) -> std::result::Result<(), i32> {
            let mem = self.0.lock().map_err(|_| libc::EIO)?;
            let off = iova as usize - 0x8000;
            buf.copy_from_slice(mem.get(off..off + buf.len()).ok_or(libc::EFAULT)?);
            Ok(())
        }
        fn write(&self, iova: u64, data: &[u8]) -> std::result::Result<(), i32> {
            let mut mem = self.0.lock().map_err(|_| libc::EIO)?;
            let off = iova as usize - 0x8000;
            mem.get_mut(off..off + data.len())
                .ok_or(libc::EFAULT)?
                .copy_from_slice(data);
            Ok(())
        }
    }
    let dma = DmaSpace::new(8);
    dma.map(0x8000, 0x1000, DmaProt::READ_WRITE, None)
        .expect("map");
    assert_eq!(
        dma.write_u64(0x8000, 7).expect_err("no remote").errno(),
        libc::ENOTCONN
    );
    dma.set_remote(Some(Arc::new(Echo(std::sync::Mutex::new(vec![0; 0x1000])))));
    dma.write_u64(0x8010, 0xdead_beef).expect("remote write");
    assert_eq!(dma.read_u64(0x8010).expect("remote read"), 0xdead_beef);
}

/// Pages (relative to the report's start, in report pages) whose bit is set.
pub(super) fn set_bits(bitmap: &[u8]) -> Vec<u64> {
    (0..bitmap.len() as u64 * 8)
        .filter(|k| bitmap[(k / 8) as usize] >> (k % 8) & 1 == 1)
        .collect()
}

#[test]
fn device_writes_are_logged_dirty() {
    let dma = DmaSpace::new(8);
    dma.map(
        0x100000,
        0x10000,
        DmaProt::READ_WRITE,
        Some((memfd(0x10000), 0)),
    )
    .expect("map");
    dma.write(0x100000, &[1]).expect("write before the session");
    assert_eq!(
        dma.start_logging(512).expect("start"),
        4096,
        "4 KiB at least"
    );
    dma.write(0x100000 + 0x3000 + 5, &[1, 2, 3])
        .expect("write page 3");
    dma.write_u64(0x100000 + 0xfff8, 9).expect("write page 15");
    dma.read_u64(0x100000 + 0x5000)
        .expect("reads are not logged");
    let mut bits = [0u8; 8];
    dma.report_dirty(0x100000, 0x10000, 4096, &mut bits)
        .expect("report");
    assert_eq!(
        set_bits(&bits),
        [3, 15],
        "the write before START is forgotten"
    );
    dma.report_dirty(0x100000, 0x10000, 4096, &mut bits)
        .expect("report again");
    assert!(set_bits(&bits).is_empty(), "a report reads and clears");
    dma.write(0x100000 + 0x9000, &[1]).expect("write page 9");
    dma.report_dirty(0x100000, 0x10000, 0x8000, &mut bits)
        .expect("coarse report");
    assert_eq!(
        set_bits(&bits),
        [1],
        "page 9 of 4K is in the second 32K page"
    );
}

#[test]
fn reports_need_a_session_a_page_size_and_room() {
    let dma = DmaSpace::new(8);
    dma.map(
        0x10000,
        0x10000,
        DmaProt::READ_WRITE,
        Some((memfd(0x10000), 0)),
    )
    .expect("map");
    let mut bits = [0u8; 8];
    let e = dma
        .report_dirty(0x10000, 0x10000, 4096, &mut bits)
        .expect_err("no session");
    assert_eq!(e.errno(), libc::EINVAL);
    assert_eq!(
        dma.start_logging(3).expect_err("page size").errno(),
        libc::EINVAL
    );
    dma.start_logging(4096).expect("start");
    assert_eq!(
        dma.start_logging(4096).expect_err("twice").errno(),
        libc::EBUSY
    );
    dma.write(0x10000 + 0x2000, &[1]).expect("write page 2");
    for (page, room) in [(2048, 8), (4096 + 1, 8), (4096, 7)] {
        let e = dma
            .report_dirty(0x10000, 0x10000, page, &mut bits[..room])
            .expect_err("bad report");
        assert_eq!(e.errno(), libc::EINVAL, "page {page} room {room}");
    }
    let e = dma
        .report_dirty(u64::MAX - 0xfff, 0x2000, 4096, &mut bits)
        .expect_err("wraps");
    assert_eq!(e.errno(), libc::EINVAL);
    // Nothing was cleared by the failed calls.
    dma.report_dirty(0x10000, 0x10000, 4096, &mut bits)
        .expect("report");
    assert_eq!(set_bits(&bits), [2]);
    dma.stop_logging();
    assert_eq!(dma.logging(), None);
    dma.report_dirty(0x10000, 0x10000, 4096, &mut bits)
        .expect_err("stopped");
    dma.start_logging(4096).expect("a new session");
}

/// A tiny deterministic generator for the model tests.
struct XorShift(u64);
impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
fn reports_of_any_range_match_a_model() {
    const PAGE: u64 = 4096;
    // Windows at awkward places: word-aligned, misaligned, a message-only one, holes.
    let windows: [(u64, u64, bool); 5] = [
        (0, 64 * PAGE, true),
        (64 * PAGE, 100 * PAGE, true),
        (200 * PAGE, 7 * PAGE, true),
        (207 * PAGE, 3 * PAGE, false),
        (300 * PAGE, 130 * PAGE, true),
    ];
    let dma = DmaSpace::new(8);
    for (iova, size, fd) in windows {
        let backing = fd.then(|| (memfd(size as usize), 0));
        dma.map(iova, size, DmaProt::READ_WRITE, backing)
            .expect("map");
    }
    dma.start_logging(PAGE).expect("start");
    let mapped = |p: u64| {
        windows
            .iter()
            .any(|&(i, s, fd)| fd && p * PAGE >= i && p * PAGE < i + s)
    };
    let mut model = std::collections::BTreeSet::new();
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    for round in 0..400 {
        for _ in 0..rng.below(40) {
            let p = rng.below(430);
            if mapped(p) {
                dma.mark_dirty(p * PAGE + rng.below(PAGE), 1).expect("mark");
                model.insert(p);
            }
        }
        let shift = [0u32, 0, 0, 1, 3][rng.below(5) as usize];
        let page_size = PAGE << shift;
        let first = rng.below(430);
        let pages = 1 + rng.below(430 - first);
        let (iova, len) = (first * PAGE, pages * PAGE);
        let mut out = vec![0xa5u8; 8 * (pages.div_ceil(64) as usize) + 16];
        dma.report_dirty(iova, len, page_size, &mut out)
            .expect("report");
        let want: Vec<u64> = model
            .range(first..first + pages)
            .map(|p| (p - first) / (1 << shift))
            .collect::<std::collections::BTreeSet<u64>>()
            .into_iter()
            .collect();
        let used = 8 * (len.div_ceil(page_size).div_ceil(64) as usize);
        assert_eq!(
            set_bits(&out[..used]),
            want,
            "round {round}: {iova:#x}+{len:#x}/{page_size:#x}"
        );
        assert!(
            out[used..].iter().all(|&b| b == 0xa5),
            "round {round}: wrote past the bitmap"
        );
        // Pages inside the range are reported; the rest stays logged.
        model.retain(|&p| p < first || p >= first + pages);
    }
}

#[test]
fn writes_racing_with_reports_are_never_lost() {
    const PAGES: u64 = 4096;
    let dma = Arc::new(DmaSpace::new(8));
    dma.map(
        0,
        PAGES * 4096,
        DmaProt::READ_WRITE,
        Some((memfd((PAGES * 4096) as usize), 0)),
    )
    .expect("map");
    dma.start_logging(4096).expect("start");
    let writer = {
        let dma = Arc::clone(&dma);
        std::thread::spawn(move || {
            for p in 0..PAGES {
                dma.write_u64(p * 4096, p).expect("write");
            }
        })
    };
    let mut seen = vec![false; PAGES as usize];
    let mut out = vec![0u8; (PAGES / 8) as usize];
    let mut collect = |dma: &DmaSpace, seen: &mut Vec<bool>| {
        dma.report_dirty(0, PAGES * 4096, 4096, &mut out)
            .expect("report");
        for k in set_bits(&out) {
            assert!(
                !seen[k as usize],
                "page {k} reported twice but written once"
            );
            seen[k as usize] = true;
        }
    };
    while !writer.is_finished() {
        collect(&dma, &mut seen);
    }
    writer.join().expect("writer");
    collect(&dma, &mut seen);
    assert!(
        seen.iter().all(|&s| s),
        "every page written was reported exactly once"
    );
}

#[test]
fn unmap_with_dirty_bitmap_outside_a_session_reports_everything() {
    let dma = DmaSpace::new(8);
    dma.map(
        0x10000,
        0x4000,
        DmaProt::READ_WRITE,
        Some((memfd(0x4000), 0)),
    )
    .expect("map");
    let mut bits = [0u8; 8];
    dma.unmap_take_dirty(0x10000, 0x4000, 4096, &mut bits)
        .expect("unmap");
    assert_eq!(
        set_bits(&bits),
        [0, 1, 2, 3],
        "never logged: every page may be dirty"
    );
}

#[test]
fn unmap_with_dirty_bitmap_is_all_or_nothing() {
    let dma = DmaSpace::new(8);
    dma.map(
        0x10000,
        0x4000,
        DmaProt::READ_WRITE,
        Some((memfd(0x4000), 0)),
    )
    .expect("map");
    dma.start_logging(4096).expect("log");
    dma.write(0x10000 + 0x3000, &[1]).expect("write page 3");
    let mut bits = [0u8; 8];
    let e = dma
        .unmap_take_dirty(0x10000, 0x2000, 4096, &mut bits)
        .expect_err("splits the window");
    assert_eq!(e.errno(), libc::EINVAL);
    assert_eq!(dma.mappings().len(), 1, "window kept");
    assert_eq!(
        dma.unmap_take_dirty(0x10000, 0x4000, 4096, &mut bits)
            .expect("unmap"),
        1
    );
    assert_eq!(set_bits(&bits), [3], "bits survived the failed call");
    assert!(dma.mappings().is_empty());
}

#[test]
fn windows_past_the_end_of_the_file_are_refused() {
    let dma = DmaSpace::new(8);
    let e = dma
        .map(
            0x1000,
            0x2000,
            DmaProt::READ_WRITE,
            Some((memfd(0x1000), 0)),
        )
        .expect_err("file too short");
    assert_eq!(e.errno(), libc::EINVAL);
    let e = dma
        .map(
            0x1000,
            0x1000,
            DmaProt::READ_WRITE,
            Some((memfd(0x1000), 0x1000)),
        )
        .expect_err("offset at the end");
    assert_eq!(e.errno(), libc::EINVAL);
    assert!(dma.mappings().is_empty());
}

#[test]
fn only_regular_files_on_local_filesystems_can_back_dma() {
    let dma = DmaSpace::new(8);
    // A device node: mmap would "work" and give no memory of the client's at all.
    let zero = File::options()
        .read(true)
        .write(true)
        .open("/dev/zero")
        .expect("/dev/zero");
    let e = dma
        .map(0x1000, 0x1000, DmaProt::READ_WRITE, Some((zero, 0)))
        .expect_err("a device node");
    assert!(matches!(e, DmaError::UnsupportedBacking { .. }), "{e:?}");
    assert_eq!(e.errno(), libc::EINVAL);
    // A pipe.
    let (r, _w) = rustix::pipe::pipe().expect("pipe");
    let e = dma
        .map(0x1000, 0x1000, DmaProt::READ_ONLY, Some((File::from(r), 0)))
        .expect_err("a pipe");
    assert!(matches!(e, DmaError::UnsupportedBacking { .. }), "{e:?}");
    // procfs: not a local filesystem with memory behind it.
    let proc = File::open("/proc/self/status").expect("procfs file");
    let e = dma
        .map(0x1000, 0x1000, DmaProt::READ_ONLY, Some((proc, 0)))
        .expect_err("procfs");
    assert!(
        matches!(&e, DmaError::UnsupportedBacking { what, .. } if what.contains("0x9fa0")),
        "{e:?}"
    );
    assert!(dma.mappings().is_empty());
}
