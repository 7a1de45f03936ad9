//! What the CUDA backend needs of a GPU, as a trait: the real one (`crate::real`, the CUDA
//! driver through `switchyard-sys`) and the fake executor CI tests the backend's logic with
//! (`crate::fake`).

use std::sync::Arc;

use vm_memory::MmapRegion;

/// A GPU's failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct GpuError {
    /// What failed, in words.
    pub message: String,
    /// The GPU is unusable from now on (a sticky error: it faulted or fell off the bus).
    pub sticky: bool,
    /// Of a failed [`Gpu::run`]: `Some(k)` when its first `k` operations ran to completion
    /// and none after them ran; `None` when how far it got is unknown (any operation may have
    /// run, in part or whole). `Some(0)` for every other failure.
    pub ran: Option<usize>,
}

impl GpuError {
    /// A failure that leaves the GPU usable.
    pub fn transient(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            sticky: false,
            ran: Some(0),
        }
    }

    /// A sticky failure.
    pub fn sticky(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            sticky: true,
            ran: Some(0),
        }
    }

    /// This failure, of a batch that got as far as `ran` (see [`GpuError::ran`]).
    pub fn after(mut self, ran: Option<usize>) -> Self {
        self.ran = ran;
        self
    }
}

/// Which commands a GPU can run (COPY and FILL always: the driver's copies and memsets).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Offload {
    /// Why SAXPY and REDUCE cannot (no kernels: NVRTC missing, or they did not compile or
    /// load), or `None`.
    pub no_kernels: Option<String>,
    /// Why GEMM cannot (no cuBLAS), or `None`.
    pub no_gemm: Option<String>,
}

impl Offload {
    /// Everything runs on the GPU.
    pub fn all(&self) -> bool {
        self.no_kernels.is_none() && self.no_gemm.is_none()
    }

    /// What runs where, in words: "every command", or which run on the CPU and why.
    pub fn describe(&self) -> String {
        let mut cpu = Vec::new();
        if let Some(why) = &self.no_kernels {
            cpu.push(format!("SAXPY and REDUCE ({why})"));
        }
        if let Some(why) = &self.no_gemm {
            cpu.push(format!("GEMM ({why})"));
        }
        if cpu.is_empty() {
            "every command on the GPU".to_owned()
        } else {
            format!("COPY and FILL on the GPU; on the CPU: {}", cpu.join(", "))
        }
    }
}

/// A GPU the backend runs commands on.
pub trait Gpu: Send + Sync + 'static {
    /// Host memory registered for the GPU's DMA (unregistered when dropped).
    type Host: Send + Sync;
    /// GPU memory (freed when dropped).
    type Buf: Send + Sync;
    /// A stream: batches run on it in order.
    type Stream: Send + Sync;

    /// What it is ("cuda GPU-…, NVIDIA H200").
    fn describe(&self) -> String;

    /// Which commands it can run.
    fn offload(&self) -> Offload {
        Offload::default()
    }

    /// Registers all of `region` for DMA; the registration keeps it mapped.
    fn register(&self, region: Arc<MmapRegion<()>>) -> Result<Self::Host, GpuError>;

    /// Allocates `len` bytes of GPU memory.
    fn alloc(&self, len: usize) -> Result<Self::Buf, GpuError>;

    /// A new stream.
    fn stream(&self) -> Result<Self::Stream, GpuError>;

    /// Runs `ops` in order on `stream` and waits for them. A failure says how far the batch
    /// got ([`GpuError::ran`]): an operation that cannot be enqueued stops the batch there,
    /// once everything before it finished.
    fn run(&self, stream: &Self::Stream, ops: &[Op<'_, Self>]) -> Result<(), GpuError>;
}

/// A place in registered host memory or GPU memory.
pub enum Mem<'a, G: Gpu + ?Sized> {
    /// Registered host memory, at an offset.
    Host(&'a G::Host, usize),
    /// GPU memory, at an offset.
    Dev(&'a G::Buf, usize),
}

impl<G: Gpu + ?Sized> Clone for Mem<'_, G> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<G: Gpu + ?Sized> Copy for Mem<'_, G> {}

impl<G: Gpu + ?Sized> std::fmt::Debug for Mem<'_, G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Mem::Host(_, off) => write!(f, "Host+{off:#x}"),
            Mem::Dev(_, off) => write!(f, "Dev+{off:#x}"),
        }
    }
}

/// One operation of a batch. Kernel operands (`Fill32`, `Saxpy`, `Reduce`, `Gemm`) are in
/// GPU memory; `Copy` goes between any two places.
pub enum Op<'a, G: Gpu + ?Sized> {
    /// `len` bytes from `src` to `dst`.
    Copy {
        /// Where to.
        dst: Mem<'a, G>,
        /// Where from.
        src: Mem<'a, G>,
        /// Bytes.
        len: usize,
    },
    /// A copy that starts once every operation before it finished and overlaps those after
    /// it (which neither write `src` nor touch `dst`): a result copied out while the next
    /// piece is computed.
    WriteBack {
        /// Where to.
        dst: Mem<'a, G>,
        /// Where from.
        src: Mem<'a, G>,
        /// Bytes.
        len: usize,
    },
    /// `words` copies of `value` at `dst`.
    Fill32 {
        /// Where.
        dst: Mem<'a, G>,
        /// 32-bit words.
        words: usize,
        /// The pattern.
        value: u32,
    },
    /// `y[i] = a·x[i] + y[i]`, rounded after the product and after the sum.
    Saxpy {
        /// `a`.
        a: f32,
        /// `x`.
        x: Mem<'a, G>,
        /// `y`.
        y: Mem<'a, G>,
        /// Elements.
        n: usize,
    },
    /// `out = Σ x[i]` in a fixed order; `partial` is scratch of
    /// [`REDUCE_PARTS`](switchyard_sys::cuda::REDUCE_PARTS) floats.
    Reduce {
        /// `x`.
        x: Mem<'a, G>,
        /// Elements.
        n: usize,
        /// One float.
        out: Mem<'a, G>,
        /// Scratch.
        partial: Mem<'a, G>,
    },
    /// `C = A·B`, row-major.
    Gemm {
        /// Rows of A and C.
        m: usize,
        /// Columns of B and C.
        n: usize,
        /// Columns of A, rows of B.
        k: usize,
        /// A.
        a: Mem<'a, G>,
        /// B.
        b: Mem<'a, G>,
        /// C.
        c: Mem<'a, G>,
    },
}

impl<G: Gpu + ?Sized> std::fmt::Debug for Op<'_, G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Op::Copy { dst, src, len } => write!(f, "Copy({src:?} -> {dst:?}, {len})"),
            Op::WriteBack { dst, src, len } => write!(f, "WriteBack({src:?} -> {dst:?}, {len})"),
            Op::Fill32 { dst, words, value } => write!(f, "Fill32({dst:?}, {words}, {value:#x})"),
            Op::Saxpy { n, .. } => write!(f, "Saxpy({n})"),
            Op::Reduce { n, .. } => write!(f, "Reduce({n})"),
            Op::Gemm { m, n, k, .. } => write!(f, "Gemm({m}x{n}x{k})"),
        }
    }
}
