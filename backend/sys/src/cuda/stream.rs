//! Streams and the batches of operations they run ([`Stream::run`]).

use std::ffi::c_void;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::cublas::sys as blas;
use cudarc::driver::result as cu;
use cudarc::driver::sys;

use super::{BLOCK, CudaError, DeviceMemory, Gpu, HostMemory, REDUCE_PARTS};

impl Gpu {
    /// A new stream (and, on first GEMM, a cuBLAS handle bound to it).
    pub fn stream(self: &Arc<Self>) -> Result<Stream, CudaError> {
        self.bind()?;
        let raw = cu::stream::create(cu::stream::StreamKind::NonBlocking)
            .map_err(|e| self.check(CudaError::driver("cuStreamCreate", e)))?;
        let aux = match cu::stream::create(cu::stream::StreamKind::NonBlocking) {
            Ok(aux) => aux,
            Err(e) => {
                // SAFETY: `raw` was created above and is not used again.
                let _ = unsafe { cu::stream::destroy(raw) };
                return Err(self.check(CudaError::driver("cuStreamCreate", e)));
            }
        };
        Ok(Stream {
            gpu: self.clone(),
            raw,
            aux,
            events: Mutex::new(Vec::new()),
            blas: Mutex::new(None),
            misses: AtomicU32::new(0),
            skip: AtomicU32::new(0),
        })
    }
}

/// A place in host or GPU memory.
#[derive(Debug, Clone, Copy)]
pub enum Mem<'a> {
    /// Registered host memory at an offset.
    Host(&'a HostMemory, usize),
    /// GPU memory at an offset.
    Device(&'a DeviceMemory, usize),
}

impl Mem<'_> {
    /// The address of `len` bytes here, checked against the buffer.
    fn range(&self, len: usize) -> Result<sys::CUdeviceptr, CudaError> {
        let (base, size, off) = match *self {
            Mem::Host(h, off) => (h.ptr as u64, h.len, off),
            Mem::Device(d, off) => (d.ptr, d.len, off),
        };
        match off.checked_add(len) {
            Some(end) if end <= size => Ok(base + off as u64),
            _ => Err(CudaError::new(
                "checking a range",
                format!("{len} bytes at {off} exceed a buffer of {size}"),
                false,
            )),
        }
    }

    fn device(&self, len: usize) -> Result<sys::CUdeviceptr, CudaError> {
        match self {
            Mem::Device(..) => self.range(len),
            Mem::Host(..) => Err(CudaError::new(
                "checking a range",
                "a kernel operand in host memory",
                false,
            )),
        }
    }
}

/// One operation of a batch ([`Stream::run`]).
#[derive(Debug, Clone, Copy)]
pub enum Op<'a> {
    /// `len` bytes from `src` to `dst` (any of host and device memory).
    Copy {
        /// Where to.
        dst: Mem<'a>,
        /// Where from.
        src: Mem<'a>,
        /// Bytes.
        len: usize,
    },
    /// `words` × the 32-bit `value` at `dst` (device memory, 4-byte aligned).
    Fill32 {
        /// Where.
        dst: Mem<'a>,
        /// 32-bit words.
        words: usize,
        /// The pattern.
        value: u32,
    },
    /// `y[i] = a·x[i] + y[i]` for `n` floats (device memory), rounded as two operations.
    Saxpy {
        /// `a`.
        a: f32,
        /// `x`.
        x: Mem<'a>,
        /// `y`.
        y: Mem<'a>,
        /// Elements.
        n: usize,
    },
    /// `out = Σ x[i]` for `n` floats (device memory), with `partial` ([`REDUCE_PARTS`]
    /// floats) as scratch: a fixed order, so the same input always sums the same.
    Reduce {
        /// `x`.
        x: Mem<'a>,
        /// Elements.
        n: usize,
        /// One float.
        out: Mem<'a>,
        /// Scratch.
        partial: Mem<'a>,
    },
    /// `len` bytes from `src` to `dst` on the stream's second queue: it starts once every
    /// operation before it in the batch finished and overlaps with those after it, which
    /// must neither write `src` nor touch `dst`. The batch ends when it ends too.
    WriteBack {
        /// Where to.
        dst: Mem<'a>,
        /// Where from.
        src: Mem<'a>,
        /// Bytes.
        len: usize,
    },
    /// `C = A·B`, row-major `m×k`, `k×n`, `m×n` floats (device memory), by cuBLAS SGEMM.
    Gemm {
        /// Rows of A and C.
        m: usize,
        /// Columns of B and C.
        n: usize,
        /// Columns of A, rows of B.
        k: usize,
        /// A.
        a: Mem<'a>,
        /// B.
        b: Mem<'a>,
        /// C.
        c: Mem<'a>,
    },
}

/// A CUDA stream: batches of operations run in order on it.
pub struct Stream {
    gpu: Arc<Gpu>,
    raw: sys::CUstream,
    /// Where write-backs run.
    aux: sys::CUstream,
    /// Events that order write-backs after their batch's earlier operations, reused.
    events: Mutex<Vec<sys::CUevent>>,
    blas: Mutex<Option<blas::cublasHandle_t>>,
    /// Spins in a row that ended before the batch did, and batches left to wait without
    /// spinning (see [`SPIN`]).
    misses: AtomicU32,
    skip: AtomicU32,
}

/// Longest a batch's wait polls its streams before it sleeps in a blocking synchronization
/// (an interrupt and a wake-up): a small job is done within it. A stream whose batches keep
/// outlasting it spins less often (after `k` misses in a row, one batch in `2^k`, at most one
/// in 64), and again on every batch once one finished within it.
pub const SPIN: Duration = Duration::from_micros(50);

/// Write-backs up to this size run on the batch's own stream, in order (a copy of a few
/// pages costs less than the event and the second stream's wait that would overlap it).
pub const SMALL_WRITE_BACK: usize = 64 << 10;

// SAFETY: a stream handle may be used from any thread (the context is bound per call); the
// cuBLAS handle is used under its mutex only.
unsafe impl Send for Stream {}
// SAFETY: as for Send.
unsafe impl Sync for Stream {}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream")
            .field("gpu", &self.gpu.info.uuid)
            .finish_non_exhaustive()
    }
}

fn c_int(v: usize) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| {
        CudaError::new(
            "checking a size",
            format!("{v} exceeds cuBLAS's int"),
            false,
        )
    })
}

/// A cuBLAS failure: never sticky by itself (an internal error or a failed launch may be
/// cuBLAS's own). Whether the GPU is gone is the context's to say: [`Stream::run`]
/// synchronizes both streams after any failure, and a context with a sticky error fails that
/// with it, which then stands for the batch.
fn blas_error(op: &'static str, s: blas::cublasStatus_t) -> CudaError {
    CudaError::new(op, format!("{s:?}"), false)
}

/// A batch that failed ([`Stream::run`]): the error, and how far the batch got.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{error}")]
pub struct BatchError {
    /// What failed.
    #[source]
    pub error: CudaError,
    /// `Some(k)`: the first `k` operations ran to completion and none after them ran (the
    /// `k`-th could not be enqueued). `None`: unknown (the streams failed while they ran:
    /// any of the batch's operations may have run, in part or whole).
    pub ran: Option<usize>,
}

impl From<CudaError> for BatchError {
    /// A failure before the batch's first operation.
    fn from(error: CudaError) -> Self {
        Self {
            error,
            ran: Some(0),
        }
    }
}

impl Stream {
    /// Enqueues `ops` in order and waits for them all: when this returns, every operation
    /// finished, or the batch failed and [`BatchError::ran`] says how far it got.
    pub fn run(&self, ops: &[Op<'_>]) -> Result<(), BatchError> {
        self.gpu.bind()?;
        let mut events = self.events.lock().unwrap_or_else(|p| p.into_inner());
        let mut used = 0;
        let mut result = Ok(());
        for (i, op) in ops.iter().enumerate() {
            let r = match *op {
                Op::WriteBack { dst, src, len } if len > SMALL_WRITE_BACK => {
                    self.write_back(dst, src, len, &mut events, &mut used)
                }
                _ => self.enqueue(op),
            };
            if let Err(e) = r {
                result = Err(BatchError {
                    error: self.gpu.check(e),
                    ran: Some(i),
                });
                break;
            }
        }
        if result.is_ok() {
            self.spin();
        }
        // Both streams drained, whatever happened: nothing may run once the borrows end.
        for (s, what) in [
            (self.raw, "cuStreamSynchronize"),
            (self.aux, "cuStreamSynchronize (write-backs)"),
        ] {
            // SAFETY: the streams are ours and live.
            let synced = unsafe { cu::stream::synchronize(s) };
            if let Err(e) = synced {
                // Work already enqueued failed as it ran: how far it got is unknown.
                let e = self.gpu.check(CudaError::driver(what, e));
                match &mut result {
                    Ok(()) => {
                        result = Err(BatchError {
                            error: e,
                            ran: None,
                        })
                    }
                    Err(b) => {
                        b.ran = None;
                        // The context's own failure outranks the call's (a cuBLAS error
                        // caused by a GPU fault is the fault's).
                        if e.sticky && !b.error.sticky {
                            b.error = e;
                        }
                    }
                }
            }
        }
        result
    }

    /// Polls both streams for at most [`SPIN`] (when this stream spins now), so that a small
    /// batch is seen done without the blocking synchronization's sleep.
    fn spin(&self) {
        if self
            .skip
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok()
        {
            return;
        }
        let start = Instant::now();
        let done = loop {
            // SAFETY: the streams are ours and live; a query only reads their state.
            let (raw, aux) =
                unsafe { (sys::cuStreamQuery(self.raw), sys::cuStreamQuery(self.aux)) };
            let ready = sys::CUresult::CUDA_SUCCESS;
            let busy = sys::CUresult::CUDA_ERROR_NOT_READY;
            if raw == ready && aux == ready {
                break true;
            }
            // A failure: the synchronization reports it.
            if (raw != ready && raw != busy) || (aux != ready && aux != busy) {
                break true;
            }
            if start.elapsed() >= SPIN {
                break false;
            }
            std::hint::spin_loop();
        };
        if done {
            self.misses.store(0, Ordering::Relaxed);
        } else {
            let k = self
                .misses
                .fetch_add(1, Ordering::Relaxed)
                .saturating_add(1)
                .min(6);
            self.skip.store((1 << k) - 1, Ordering::Relaxed);
        }
    }

    /// Enqueues a [`Op::WriteBack`]: an event after what is enqueued so far, the second
    /// stream waiting for it, the copy there.
    fn write_back(
        &self,
        dst: Mem<'_>,
        src: Mem<'_>,
        len: usize,
        events: &mut Vec<sys::CUevent>,
        used: &mut usize,
    ) -> Result<(), CudaError> {
        if len == 0 {
            return Ok(());
        }
        let (d, s) = (dst.range(len)?, src.range(len)?);
        if *used == events.len() {
            let e = cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(|e| CudaError::driver("cuEventCreate", e))?;
            events.push(e);
        }
        let event = events[*used];
        *used += 1;
        // SAFETY: the event and both streams are ours and live; the ranges were checked
        // against buffers the caller's borrows keep alive until `run` synchronized both
        // streams. An event recorded again before the second stream's wait consumed it
        // is not possible: each write-back of a batch has its own event.
        unsafe {
            cu::event::record(event, self.raw)
                .map_err(|e| CudaError::driver("cuEventRecord", e))?;
            cu::stream::wait_event(
                self.aux,
                event,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
            .map_err(|e| CudaError::driver("cuStreamWaitEvent", e))?;
            sys::cuMemcpyAsync(d, s, len, self.aux)
                .result()
                .map_err(|e| CudaError::driver("cuMemcpyAsync (write-back)", e))
        }
    }

    fn enqueue(&self, op: &Op<'_>) -> Result<(), CudaError> {
        match *op {
            Op::Copy { dst, src, len } | Op::WriteBack { dst, src, len } => {
                if len == 0 {
                    return Ok(());
                }
                let (d, s) = (dst.range(len)?, src.range(len)?);
                // SAFETY: both ranges were checked against live buffers that the caller's
                // borrows keep alive until `run` has synchronized.
                unsafe { sys::cuMemcpyAsync(d, s, len, self.raw) }
                    .result()
                    .map_err(|e| CudaError::driver("cuMemcpyAsync", e))
            }
            Op::Fill32 { dst, words, value } => {
                if words == 0 {
                    return Ok(());
                }
                let d = dst.device(words.saturating_mul(4))?;
                // SAFETY: as for Copy.
                unsafe { sys::cuMemsetD32Async(d, value, words, self.raw) }
                    .result()
                    .map_err(|e| CudaError::driver("cuMemsetD32Async", e))
            }
            Op::Saxpy { a, x, y, n } => {
                if n == 0 {
                    return Ok(());
                }
                let bytes = n.saturating_mul(4);
                let (mut a, mut xp, mut yp, mut n64) =
                    (a, x.device(bytes)?, y.device(bytes)?, n as u64);
                let grid = n.div_ceil(BLOCK as usize).clamp(1, 65_535) as u32;
                let mut params = [
                    (&raw mut a).cast::<c_void>(),
                    (&raw mut xp).cast(),
                    (&raw mut yp).cast(),
                    (&raw mut n64).cast(),
                ];
                // SAFETY: the kernel's parameters match its signature (float, two device
                // pointers to `n` floats checked above, u64); the values are read at launch.
                unsafe {
                    cu::launch_kernel(
                        self.gpu.kernels()?.saxpy,
                        (grid, 1, 1),
                        (BLOCK, 1, 1),
                        0,
                        self.raw,
                        &mut params,
                    )
                }
                .map_err(|e| CudaError::driver("launching SAXPY", e))
            }
            Op::Reduce { x, n, out, partial } => {
                let (mut xp, mut n64) = (x.device(n.saturating_mul(4))?, n as u64);
                let (mut op_, mut pp) = (out.device(4)?, partial.device(REDUCE_PARTS * 4)?);
                let mut first = [
                    (&raw mut xp).cast::<c_void>(),
                    (&raw mut n64).cast(),
                    (&raw mut pp).cast(),
                ];
                // SAFETY: as for SAXPY: `x` holds `n` floats, `partial` REDUCE_PARTS.
                unsafe {
                    cu::launch_kernel(
                        self.gpu.kernels()?.reduce_partial,
                        (REDUCE_PARTS as u32, 1, 1),
                        (BLOCK, 1, 1),
                        0,
                        self.raw,
                        &mut first,
                    )
                }
                .map_err(|e| CudaError::driver("launching REDUCE", e))?;
                let mut parts = REDUCE_PARTS as u32;
                let mut second = [
                    (&raw mut pp).cast::<c_void>(),
                    (&raw mut parts).cast(),
                    (&raw mut op_).cast(),
                ];
                // SAFETY: as above; `out` holds one float.
                unsafe {
                    cu::launch_kernel(
                        self.gpu.kernels()?.reduce_final,
                        (1, 1, 1),
                        (32, 1, 1),
                        0,
                        self.raw,
                        &mut second,
                    )
                }
                .map_err(|e| CudaError::driver("launching REDUCE", e))
            }
            Op::Gemm { m, n, k, a, b, c } => {
                if m == 0 || n == 0 {
                    return Ok(());
                }
                let ap = a.device(m.saturating_mul(k).saturating_mul(4))?;
                let bp = b.device(k.saturating_mul(n).saturating_mul(4))?;
                let cp = c.device(m.saturating_mul(n).saturating_mul(4))?;
                let handle = self.blas()?;
                let (alpha, beta) = (1.0f32, 0.0f32);
                // Row-major C = A·B is column-major Cᵀ = Bᵀ·Aᵀ: cuBLAS computes an n×m
                // result from B (n×k, ld n) and A (k×m, ld k).
                // SAFETY: the three ranges were checked for m·k, k·n and m·n floats; the
                // handle is bound to this stream; alpha and beta outlive the call (host
                // pointer mode reads them before it returns).
                let s = unsafe {
                    blas::cublasSgemm_v2(
                        handle,
                        blas::cublasOperation_t::CUBLAS_OP_N,
                        blas::cublasOperation_t::CUBLAS_OP_N,
                        c_int(n)?,
                        c_int(m)?,
                        c_int(k)?,
                        &alpha,
                        bp as *const f32,
                        c_int(n)?,
                        ap as *const f32,
                        c_int(k.max(1))?,
                        &beta,
                        cp as *mut f32,
                        c_int(n)?,
                    )
                };
                match s {
                    blas::cublasStatus_t::CUBLAS_STATUS_SUCCESS => Ok(()),
                    s => Err(blas_error("cublasSgemm", s)),
                }
            }
        }
    }

    /// The stream's cuBLAS handle, created on first use.
    fn blas(&self) -> Result<blas::cublasHandle_t, CudaError> {
        let mut slot = self.blas.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(h) = *slot {
            return Ok(h);
        }
        // SAFETY: only checks whether the library can be dlopen()ed.
        if !unsafe { blas::is_culib_present() } {
            return Err(CudaError::new(
                "loading cuBLAS",
                "libcublas.so was not found",
                false,
            ));
        }
        let mut h = std::ptr::null_mut();
        // SAFETY: creates a handle in the current context (bound by `run`); destroyed in Drop.
        let s = unsafe { blas::cublasCreate_v2(&mut h) };
        if s != blas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(blas_error("cublasCreate", s));
        }
        // SAFETY: `h` is the handle just created and `raw` our live stream.
        let s = unsafe { blas::cublasSetStream_v2(h, self.raw as blas::cudaStream_t) };
        if s != blas::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            // SAFETY: `h` was created above and is not used again.
            unsafe { blas::cublasDestroy_v2(h) };
            return Err(blas_error("cublasSetStream", s));
        }
        *slot = Some(h);
        Ok(h)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.gpu.bind().is_err() {
            return;
        }
        let handle = self.blas.lock().unwrap_or_else(|p| p.into_inner()).take();
        let events = std::mem::take(&mut *self.events.lock().unwrap_or_else(|p| p.into_inner()));
        // SAFETY: the handle, the events and the streams are ours; `run` left no work in
        // flight.
        unsafe {
            if let Some(h) = handle {
                blas::cublasDestroy_v2(h);
            }
            for e in events {
                let _ = cu::event::destroy(e);
            }
            let _ = cu::stream::destroy(self.aux);
            let _ = cu::stream::destroy(self.raw);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cublas_failure_is_never_sticky_by_itself() {
        // An internal error or a failed launch may be cuBLAS's own; a GPU fault behind it
        // surfaces as the context's sticky error at the synchronization after it.
        for s in [
            blas::cublasStatus_t::CUBLAS_STATUS_INTERNAL_ERROR,
            blas::cublasStatus_t::CUBLAS_STATUS_EXECUTION_FAILED,
            blas::cublasStatus_t::CUBLAS_STATUS_ALLOC_FAILED,
        ] {
            let e = blas_error("cublasSgemm", s);
            assert!(!e.sticky, "{e}");
            assert!(e.to_string().contains(&format!("{s:?}")), "{e}");
        }
    }
}
