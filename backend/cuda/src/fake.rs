//! A fake GPU for CI (no machine there has one): host registrations and GPU memory as host
//! memory, every operation run on the CPU at once. It counts what the backend registers and
//! allocates, and fails on request, for good (a sticky error) or once (a transient one), so
//! the backend's bookkeeping and its handling of a lost board are tested without a GPU.
//!
//! A write-back ([`Op::WriteBack`]) runs at the end of its batch, the latest a GPU may run it,
//! or, with a seed ([`FakeState::seed`]), at a point among the operations after it that the
//! seed picks: a batch that breaks its contract gets a wrong result here. With a seed, batches
//! in flight on several streams interleave one operation at a time in an order the seed picks
//! (without one, they run at once on their callers' threads).
//!
//! A registration pins pages, as `cuMemHostRegister` does: it allocates the file's pages of
//! its range, and the GPU keeps using *those* pages. Once the file's pages change under it (a
//! hole punched: the file gets new zero pages, the pinned ones are orphaned), the fake's reads
//! through the registration return [`ORPHANED`] bytes (the old pages, which the process no
//! longer sees) and its writes reach nobody, so a backend that punches holes into pinned
//! memory gets wrong results here as on a GPU.
//!
//! Its REDUCE sums in the real kernel's order (fixed blocks, then their partial sums), not
//! the CPU path's, so tests meet the documented tolerance rather than bit equality.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use switchyard_sys::cuda::REDUCE_PARTS;
use vm_memory::{MmapRegion, VolatileMemory};

use crate::gpu::{Gpu, GpuError, Mem, Offload, Op};

/// Counters and switches shared by a fake GPU and its test.
#[derive(Debug, Default)]
pub struct FakeState {
    /// Registrations alive.
    pub registered: AtomicU64,
    /// Registrations ever made.
    pub registrations: AtomicU64,
    /// Bytes of GPU memory allocated and alive.
    pub allocated: AtomicU64,
    /// Batches run.
    pub batches: AtomicU64,
    /// Operations run, by kind: copies, fills, kernels (SAXPY, REDUCE), GEMMs.
    pub copies: AtomicU64,
    /// See `copies`.
    pub fills: AtomicU64,
    /// See `copies`.
    pub kernels: AtomicU64,
    /// See `copies`.
    pub gemms: AtomicU64,
    /// The next batch fails with a sticky error, and every one after it.
    pub lose: AtomicBool,
    /// The next batch fails with a transient error (then the switch resets).
    pub hiccup: AtomicBool,
    /// Where write-backs run among the operations after them: 0, last; else a point this
    /// seed picks per batch (see `run`). With a seed, batches in flight on several streams
    /// also run one operation at a time, in an order it picks.
    pub seed: AtomicU64,
    /// Batches wait this long (µs) before they run: a slow GPU.
    pub delay_us: AtomicU64,
    /// Batches wait here while it is closed: a GPU stuck on a command.
    pub gate: Gate,
    /// The next batch that gets as far as its operation `k` fails there (`(k, sticky)`):
    /// the operations before it ran, in order, each write-back where it is (as soon as a GPU
    /// may run it); none after it ran. Reset once used.
    pub fail_at: Mutex<Option<(usize, bool)>>,
    /// The fake has no kernels (a host without NVRTC): SAXPY and REDUCE fail.
    pub no_kernels: AtomicBool,
    /// The fake has no cuBLAS: GEMM fails.
    pub no_blas: AtomicBool,
    /// A file whose existence makes the next batch lose the GPU (a test in another process
    /// injecting a sticky error).
    lose_when: Mutex<Option<std::path::PathBuf>>,
    /// With a [`FakeState::seed`]: the batches of several streams in flight at once run one
    /// operation at a time, in an order the seed picks.
    turns: Turnstile,
    /// Streams made so far (a stream's id is its rank).
    streams: AtomicU64,
    lost: AtomicBool,
}

impl FakeState {
    /// The GPU is lost at the first batch after `path` exists.
    pub fn lose_when(&self, path: std::path::PathBuf) {
        *self.lose_when.lock().unwrap_or_else(|p| p.into_inner()) = Some(path);
    }

    /// The next batch fails at its operation `k` (see [`FakeState::fail_at`]).
    pub fn fail_at(&self, k: usize, sticky: bool) {
        *self.fail_at.lock().unwrap_or_else(|p| p.into_inner()) = Some((k, sticky));
    }
}

/// Holds batches back while closed (a GPU stuck on a command, a stream synchronization that
/// does not return), until a test opens it: every stream's, or one stream's.
#[derive(Debug, Default)]
pub struct Gate {
    /// (closed: `Some(None)` for every stream, `Some(Some(id))` for one; batches waiting).
    state: Mutex<(Option<Option<u64>>, u64)>,
    cv: Condvar,
}

impl Gate {
    /// Batches from now on wait.
    pub fn close(&self) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).0 = Some(None);
    }

    /// Batches of stream `id` (the `id`-th stream made, from 0) from now on wait.
    pub fn close_stream(&self, id: u64) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).0 = Some(Some(id));
    }

    /// Lets every waiting batch run, and those after.
    pub fn open(&self) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).0 = None;
        self.cv.notify_all();
    }

    /// Batches waiting now.
    pub fn held(&self) -> u64 {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).1
    }

    /// Waits (at most `timeout`) until `n` batches wait at the gate; whether they do.
    pub fn wait_held(&self, n: u64, timeout: Duration) -> bool {
        let g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let (g, _) = self
            .cv
            .wait_timeout_while(g, timeout, |(_, held)| *held < n)
            .unwrap_or_else(|p| p.into_inner());
        g.1 >= n
    }

    fn pass(&self, stream: u64) {
        let holds =
            |closed: Option<Option<u64>>| closed.is_some_and(|s| s.is_none_or(|s| s == stream));
        let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if !holds(g.0) {
            return;
        }
        g.1 += 1;
        self.cv.notify_all();
        while holds(g.0) {
            g = self.cv.wait(g).unwrap_or_else(|p| p.into_inner());
        }
        g.1 -= 1;
    }
}

/// Faults every page of `region` in for writing, as pinning does: a page of the file that
/// is a hole gets one (an atomic add of 0 to its first word: a write that changes nothing,
/// whatever writes it races with). The 0 goes through `black_box`: an add of a known 0 is
/// compiled to a bare fence in an optimized build, which touches no page (the holes stayed,
/// and every registration then read as orphaned). An allocating `fallocate` would not do: a
/// page it allocates is still a hole to `SEEK_HOLE` on tmpfs until it is written.
fn pin(region: &MmapRegion<()>) -> Result<(), GpuError> {
    use rustix::fs::{SeekFrom, seek};
    const PAGE: usize = 4096;
    let Some(f) = region.file_offset() else {
        return Ok(());
    };
    let (start, size) = (f.start(), region.size());
    let mut off = 0usize;
    while off < size {
        let at = start + off as u64;
        let hole = match seek(f.file(), SeekFrom::Hole(at)) {
            Ok(h) => usize::try_from(h - start).unwrap_or(size),
            Err(_) => size,
        };
        if hole >= size {
            break;
        }
        let data = match seek(f.file(), SeekFrom::Data(start + hole as u64)) {
            Ok(d) => usize::try_from(d - start).unwrap_or(size).min(size),
            Err(_) => size,
        };
        let mut page = hole / PAGE * PAGE;
        while page < data {
            region
                .get_atomic_ref::<std::sync::atomic::AtomicU32>(page)
                .map_err(|e| GpuError::transient(format!("cannot pin a page: {e}")))?
                .fetch_add(std::hint::black_box(0), Ordering::SeqCst);
            page += PAGE;
        }
        off = data.max(hole + 1);
    }
    Ok(())
}

/// Interleaves the operations of the batches in flight on different streams: one runs at a
/// time, and after each the next is the seed's pick among the streams with a batch in flight
/// (a GPU's streams progress in an order nobody chooses; a seed makes one order repeatable).
#[derive(Debug, Default)]
struct Turnstile {
    /// Streams with a batch in flight, whose turn it is, the picker's state.
    state: Mutex<(Vec<u64>, Option<u64>, u64)>,
    cv: Condvar,
}

/// A stream's batch in the turnstile; leaves it when dropped.
struct Turn<'a> {
    turns: &'a Turnstile,
    stream: u64,
}

impl Turnstile {
    fn enter(&self, stream: u64, seed: u64) -> Turn<'_> {
        let mut g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if g.2 == 0 {
            g.2 = seed | 1;
        }
        g.0.push(stream);
        g.1.get_or_insert(stream);
        Turn {
            turns: self,
            stream,
        }
    }

    /// The next turn: a stream in flight, by xorshift64.
    fn pick(g: &mut (Vec<u64>, Option<u64>, u64)) {
        g.2 ^= g.2 << 13;
        g.2 ^= g.2 >> 7;
        g.2 ^= g.2 << 17;
        g.1 = (!g.0.is_empty()).then(|| g.0[(g.2 % g.0.len() as u64) as usize]);
    }
}

impl Turn<'_> {
    /// Runs `f` in this stream's turn, then lets the seed pick the next.
    fn run<T>(&self, f: impl FnOnce() -> T) -> T {
        let t = self.turns;
        let mut g = t.state.lock().unwrap_or_else(|p| p.into_inner());
        while g.1 != Some(self.stream) {
            g = t.cv.wait(g).unwrap_or_else(|p| p.into_inner());
        }
        drop(g);
        let out = f();
        let mut g = t.state.lock().unwrap_or_else(|p| p.into_inner());
        Turnstile::pick(&mut g);
        drop(g);
        t.cv.notify_all();
        out
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let t = self.turns;
        let mut g = t.state.lock().unwrap_or_else(|p| p.into_inner());
        g.0.retain(|&s| s != self.stream);
        if g.1 == Some(self.stream) || g.1.is_none() {
            Turnstile::pick(&mut g);
        }
        drop(g);
        t.cv.notify_all();
    }
}

/// A fake GPU.
#[derive(Debug, Clone, Default)]
pub struct FakeGpu {
    /// Its counters and switches.
    pub state: Arc<FakeState>,
}

/// What the fake GPU reads through a registration whose pages were orphaned (see the
/// module docs).
pub const ORPHANED: u8 = 0xdb;

/// A fake registration.
#[derive(Debug)]
pub struct FakeHost {
    region: Arc<MmapRegion<()>>,
    state: Arc<FakeState>,
    /// The file's pages changed under the registration: the GPU's are not the file's.
    orphaned: AtomicBool,
}

impl FakeHost {
    /// Whether the pinned pages are orphaned: a hole in the registered range of the file
    /// (checked at each use: pinning allocated all of it).
    fn orphaned(&self) -> bool {
        if self.orphaned.load(Ordering::Relaxed) {
            return true;
        }
        let Some(f) = self.region.file_offset() else {
            return false;
        };
        let end = f.start().saturating_add(self.region.size() as u64);
        let hole = rustix::fs::seek(f.file(), rustix::fs::SeekFrom::Hole(f.start()));
        let orphaned = hole.is_ok_and(|h| h < end);
        if orphaned {
            self.orphaned.store(true, Ordering::Relaxed);
        }
        orphaned
    }
}

impl Drop for FakeHost {
    fn drop(&mut self) {
        self.state.registered.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Fake GPU memory.
#[derive(Debug)]
pub struct FakeBuf {
    bytes: Mutex<Vec<u8>>,
    state: Arc<FakeState>,
}

impl Drop for FakeBuf {
    fn drop(&mut self) {
        let len = self.bytes.lock().unwrap_or_else(|p| p.into_inner()).len();
        self.state.allocated.fetch_sub(len as u64, Ordering::SeqCst);
    }
}

fn range_error(len: usize, off: usize, size: usize) -> GpuError {
    GpuError::transient(format!("{len} bytes at {off} exceed a buffer of {size}"))
}

fn read(m: Mem<'_, FakeGpu>, len: usize) -> Result<Vec<u8>, GpuError> {
    let mut out = vec![0u8; len];
    match m {
        Mem::Host(h, off) => {
            let s = h
                .region
                .get_slice(off, len)
                .map_err(|_| range_error(len, off, h.region.size()))?;
            if h.orphaned() {
                out.fill(ORPHANED);
            } else {
                s.copy_to(&mut out);
            }
        }
        Mem::Dev(d, off) => {
            let b = d.bytes.lock().unwrap_or_else(|p| p.into_inner());
            let src = off
                .checked_add(len)
                .and_then(|end| b.get(off..end))
                .ok_or_else(|| range_error(len, off, b.len()))?;
            out.copy_from_slice(src);
        }
    }
    Ok(out)
}

fn write(m: Mem<'_, FakeGpu>, data: &[u8]) -> Result<(), GpuError> {
    match m {
        Mem::Host(h, off) => {
            let s = h
                .region
                .get_slice(off, data.len())
                .map_err(|_| range_error(data.len(), off, h.region.size()))?;
            if !h.orphaned() {
                s.copy_from(data);
            }
        }
        Mem::Dev(d, off) => {
            let mut b = d.bytes.lock().unwrap_or_else(|p| p.into_inner());
            let size = b.len();
            let dst = off
                .checked_add(data.len())
                .and_then(|end| b.get_mut(off..end))
                .ok_or_else(|| range_error(data.len(), off, size))?;
            dst.copy_from_slice(data);
        }
    }
    Ok(())
}

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn to_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// REDUCE of `xs` as the fake GPU runs it, in the real kernel's order: [`REDUCE_PARTS`]
/// blocks of consecutive elements each summed, then the blocks' sums in order. Returns the
/// blocks' sums and the total. The CPU path sums in another order, so a test that gets this
/// total bit for bit (where the two differ) knows that the command ran on the fake GPU.
pub fn reduce_in_kernel_order(xs: &[f32]) -> (Vec<f32>, f32) {
    let per = xs.len().div_ceil(REDUCE_PARTS).max(1);
    let parts: Vec<f32> = xs.chunks(per).map(|c| c.iter().sum()).collect();
    let total = parts.iter().sum();
    (parts, total)
}

impl FakeGpu {
    /// A fake GPU with fresh counters.
    pub fn new() -> Self {
        Self::default()
    }

    fn device(m: Mem<'_, FakeGpu>) -> Result<(), GpuError> {
        match m {
            Mem::Dev(..) => Ok(()),
            Mem::Host(..) => Err(GpuError::transient("a kernel operand in host memory")),
        }
    }

    fn op(&self, op: &Op<'_, Self>) -> Result<(), GpuError> {
        let s = &self.state;
        match *op {
            Op::Copy { dst, src, len } | Op::WriteBack { dst, src, len } => {
                s.copies.fetch_add(1, Ordering::Relaxed);
                let data = read(src, len)?;
                write(dst, &data)
            }
            Op::Fill32 { dst, words, value } => {
                s.fills.fetch_add(1, Ordering::Relaxed);
                Self::device(dst)?;
                let data: Vec<u8> = std::iter::repeat_n(value.to_le_bytes(), words)
                    .flatten()
                    .collect();
                write(dst, &data)
            }
            Op::Saxpy { .. } | Op::Reduce { .. } if s.no_kernels.load(Ordering::SeqCst) => {
                Err(GpuError::transient(
                    "CUDA launching a kernel failed: the GPU has no kernels (fake)",
                ))
            }
            Op::Gemm { .. } if s.no_blas.load(Ordering::SeqCst) => Err(GpuError::transient(
                "CUDA cublasCreate failed: libcublas.so was not found (fake)",
            )),
            Op::Saxpy { a, x, y, n } => {
                s.kernels.fetch_add(1, Ordering::Relaxed);
                Self::device(x)?;
                Self::device(y)?;
                let xs = floats(&read(x, n * 4)?);
                let mut ys = floats(&read(y, n * 4)?);
                for (yv, xv) in ys.iter_mut().zip(xs) {
                    *yv += a * xv;
                }
                write(y, &to_bytes(&ys))
            }
            Op::Reduce { x, n, out, partial } => {
                s.kernels.fetch_add(1, Ordering::Relaxed);
                Self::device(x)?;
                Self::device(out)?;
                Self::device(partial)?;
                let (parts, total) = reduce_in_kernel_order(&floats(&read(x, n * 4)?));
                write(partial, &to_bytes(&parts))?;
                write(out, &total.to_le_bytes())
            }
            Op::Gemm { m, n, k, a, b, c } => {
                s.gemms.fetch_add(1, Ordering::Relaxed);
                for op in [a, b, c] {
                    Self::device(op)?;
                }
                let av = floats(&read(a, m * k * 4)?);
                let bv = floats(&read(b, k * n * 4)?);
                let mut cv = vec![0f32; m * n];
                for i in 0..m {
                    for j in 0..n {
                        // A blocked order, as a GPU's: pairs of products summed.
                        let mut acc = 0f32;
                        let mut p = 0;
                        while p < k {
                            let mut pair = av[i * k + p] * bv[p * n + j];
                            if p + 1 < k {
                                pair += av[i * k + p + 1] * bv[(p + 1) * n + j];
                            }
                            acc += pair;
                            p += 2;
                        }
                        cv[i * n + j] = acc;
                    }
                }
                write(c, &to_bytes(&cv))
            }
        }
    }
}

impl Gpu for FakeGpu {
    type Host = FakeHost;
    type Buf = FakeBuf;
    /// Its rank among the streams made.
    type Stream = u64;

    fn describe(&self) -> String {
        "fake GPU".into()
    }

    fn offload(&self) -> Offload {
        let s = &self.state;
        Offload {
            no_kernels: s
                .no_kernels
                .load(Ordering::SeqCst)
                .then(|| "libnvrtc.so was not found (fake)".to_owned()),
            no_gemm: s
                .no_blas
                .load(Ordering::SeqCst)
                .then(|| "libcublas.so was not found (fake)".to_owned()),
        }
    }

    fn register(&self, region: Arc<MmapRegion<()>>) -> Result<FakeHost, GpuError> {
        if self.state.lost.load(Ordering::SeqCst) {
            return Err(GpuError::sticky("the fake GPU is lost"));
        }
        pin(&region)?;
        self.state.registered.fetch_add(1, Ordering::SeqCst);
        self.state.registrations.fetch_add(1, Ordering::SeqCst);
        Ok(FakeHost {
            region,
            state: self.state.clone(),
            orphaned: AtomicBool::new(false),
        })
    }

    fn alloc(&self, len: usize) -> Result<FakeBuf, GpuError> {
        self.state.allocated.fetch_add(len as u64, Ordering::SeqCst);
        Ok(FakeBuf {
            bytes: Mutex::new(vec![0u8; len]),
            state: self.state.clone(),
        })
    }

    fn stream(&self) -> Result<u64, GpuError> {
        Ok(self.state.streams.fetch_add(1, Ordering::SeqCst))
    }

    fn run(&self, stream: &u64, ops: &[Op<'_, Self>]) -> Result<(), GpuError> {
        let s = &self.state;
        let trigger = s
            .lose_when
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if s.lose.load(Ordering::SeqCst) || trigger.is_some_and(|t| t.exists()) {
            s.lost.store(true, Ordering::SeqCst);
        }
        if s.lost.load(Ordering::SeqCst) {
            return Err(GpuError::sticky(
                "CUDA cuStreamSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS (fake)",
            ));
        }
        if s.hiccup.swap(false, Ordering::SeqCst) {
            return Err(GpuError::transient(
                "CUDA cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY (fake)",
            ));
        }
        s.gate.pass(*stream);
        let delay = s.delay_us.load(Ordering::Relaxed);
        if delay > 0 {
            std::thread::sleep(std::time::Duration::from_micros(delay));
        }
        s.batches.fetch_add(1, Ordering::Relaxed);
        let seed = s.seed.load(Ordering::Relaxed);
        let turn = (seed != 0).then(|| s.turns.enter(*stream, seed));
        let exec = |op: &Op<'_, Self>| match &turn {
            Some(turn) => turn.run(|| self.op(op)),
            None => self.op(op),
        };
        let fail = {
            let mut f = s.fail_at.lock().unwrap_or_else(|p| p.into_inner());
            f.take_if(|(k, _)| *k < ops.len())
        };
        if let Some((k, sticky)) = fail {
            // What a GPU did before the operation it could not take: everything before it,
            // a write-back as soon as what precedes it finished.
            for op in ops.iter().take(k) {
                exec(op).map_err(|e| e.after(None))?;
            }
            let e = if sticky {
                s.lost.store(true, Ordering::SeqCst);
                GpuError::sticky(format!(
                    "CUDA cuMemcpyAsync failed: CUDA_ERROR_CONTAINED (fake, at operation {k})"
                ))
            } else {
                GpuError::transient(format!(
                    "CUDA launching SAXPY failed: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES (fake, at \
                     operation {k})"
                ))
            };
            return Err(e.after(Some(k)));
        }
        // A write-back runs on a second stream once everything before it finished, anywhere
        // among what follows: with no seed, last (the latest a GPU may run it); with one, at
        // a point the seed picks for each batch. A batch that writes a write-back's source
        // or touches its destination after it gets another result here than in order.
        let mut rng = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ s.batches.load(Ordering::Relaxed);
        let mut coin = || {
            // xorshift64*: any fixed sequence will do.
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            seed != 0 && rng.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 63 == 1
        };
        let mut pending = std::collections::VecDeque::new();
        for op in ops {
            while !pending.is_empty() && coin() {
                if let Some(wb) = pending.pop_front() {
                    exec(wb).map_err(|e| e.after(None))?;
                }
            }
            match op {
                Op::WriteBack { .. } => pending.push_back(op),
                _ => exec(op).map_err(|e| e.after(None))?,
            }
        }
        for op in pending {
            exec(op).map_err(|e| e.after(None))?;
        }
        Ok(())
    }
}
