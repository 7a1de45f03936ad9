//! An NVIDIA GPU through the CUDA driver API, loaded at run time (`cudarc` with dynamic
//! loading: building needs no CUDA; a host without the driver says so through
//! [`driver_present`] and [`CudaError`], it never panics).
//!
//! The safe surface is made so that nothing a GPU reads or writes can go away under it:
//! host memory is registered together with the mapping it lives in ([`HostMemory`] owns an
//! `Arc` of the `vm-memory` region until it is unregistered), device memory is freed only
//! when its [`DeviceMemory`] is dropped, and [`Stream::run`] enqueues a batch of operations
//! on buffers it borrows and synchronizes with the stream before it returns, so no work is
//! in flight once the borrows end. Every range is checked against its buffer first.
//!
//! [`Op::WriteBack`] runs on a second stream, after everything before it in the batch: a
//! result copied out while the GPU computes or copies the next piece (PCIe carries both
//! directions at once), so a write-through costs one piece, not a second pass.
//!
//! Kernels (SAXPY, a deterministic two-pass REDUCE) are CUDA C in this file, compiled by
//! NVRTC when a GPU is opened (without FMA contraction, so SAXPY rounds as the CPU path
//! does); GEMM is cuBLAS's SGEMM (loaded at run time too).

use std::ffi::{CString, c_void};
use std::sync::{Arc, OnceLock};

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use vm_memory::MmapRegion;

mod stream;

pub use stream::{BatchError, Mem, Op, SMALL_WRITE_BACK, SPIN, Stream};

/// The kernels, compiled by NVRTC for the GPU at hand.
const KERNELS: &str = r#"
extern "C" __global__ void sy_saxpy(float a, const float *x, float *y, unsigned long long n) {
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    for (; i < n; i += step) {
        y[i] = __fadd_rn(__fmul_rn(a, x[i]), y[i]);
    }
}

extern "C" __global__ void sy_reduce_partial(const float *x, unsigned long long n, float *partial) {
    __shared__ float s[256];
    unsigned long long per = (n + gridDim.x - 1) / gridDim.x;
    unsigned long long lo = per * blockIdx.x;
    unsigned long long hi = lo + per < n ? lo + per : n;
    float acc = 0.0f;
    for (unsigned long long i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        acc += x[i];
    }
    s[threadIdx.x] = acc;
    __syncthreads();
    for (unsigned int w = blockDim.x / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w) s[threadIdx.x] += s[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = s[0];
}

extern "C" __global__ void sy_reduce_final(const float *partial, unsigned int parts, float *out) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        float acc = 0.0f;
        for (unsigned int i = 0; i < parts; i++) acc += partial[i];
        *out = acc;
    }
}
"#;

/// Threads per block of every kernel.
const BLOCK: u32 = 256;
/// Blocks of the REDUCE's first pass (a fixed count: the same sum for the same input).
pub const REDUCE_PARTS: usize = 512;

/// A CUDA call that failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("CUDA {op} failed: {code}")]
pub struct CudaError {
    /// What was being done.
    pub op: &'static str,
    /// The driver's (or cuBLAS's, NVRTC's) error, by name.
    pub code: String,
    /// The context is unusable from now on (the GPU faulted, fell off the bus, or an earlier
    /// such error): every later call fails too.
    pub sticky: bool,
}

impl CudaError {
    fn new(op: &'static str, code: impl Into<String>, sticky: bool) -> Self {
        Self {
            op,
            code: code.into(),
            sticky,
        }
    }

    fn driver(op: &'static str, e: cu::DriverError) -> Self {
        Self::new(op, format!("{:?}", e.0), is_sticky(e.0))
    }
}

/// Whether a driver error leaves the context unusable (every later call fails with it): the
/// GPU faulted, fell off the bus, contained a memory error (Hopper's `CONTAINED`), or the
/// context must be torn down (`TENSOR_MEMORY_LEAK`, `EXTERNAL_DEVICE`, `KEY_ROTATION` of
/// confidential computing). Everything else (out of memory, a bad argument, a launch short of
/// resources) leaves the GPU usable.
pub fn is_sticky(code: sys::cudaError_enum) -> bool {
    use sys::cudaError_enum as E;
    matches!(
        code,
        E::CUDA_ERROR_ILLEGAL_ADDRESS
            | E::CUDA_ERROR_LAUNCH_FAILED
            | E::CUDA_ERROR_ECC_UNCORRECTABLE
            | E::CUDA_ERROR_HARDWARE_STACK_ERROR
            | E::CUDA_ERROR_ILLEGAL_INSTRUCTION
            | E::CUDA_ERROR_MISALIGNED_ADDRESS
            | E::CUDA_ERROR_INVALID_ADDRESS_SPACE
            | E::CUDA_ERROR_INVALID_PC
            | E::CUDA_ERROR_ASSERT
            | E::CUDA_ERROR_LAUNCH_TIMEOUT
            | E::CUDA_ERROR_CONTEXT_IS_DESTROYED
            | E::CUDA_ERROR_DEVICE_UNAVAILABLE
            | E::CUDA_ERROR_NVLINK_UNCORRECTABLE
            | E::CUDA_ERROR_CONTAINED
            | E::CUDA_ERROR_TENSOR_MEMORY_LEAK
            | E::CUDA_ERROR_EXTERNAL_DEVICE
            | E::CUDA_ERROR_KEY_ROTATION
            | E::CUDA_ERROR_UNKNOWN
    )
}

/// NVRTC's name of the architecture of a device of compute capability `major.minor`
/// (`sm_90` for 9.0): kernels compiled for it are a CUBIN, loaded without a JIT.
pub fn nvrtc_arch(major: u32, minor: u32) -> String {
    format!("sm_{major}{minor}")
}

/// The options the kernels are compiled with: no fused multiply-add (the CPU backend's
/// rounding), and the device's architecture for a CUBIN (`None`: PTX for NVRTC's default
/// virtual architecture, JIT-compiled by the driver at load).
pub fn nvrtc_options(arch: Option<&str>) -> Vec<String> {
    let mut options = vec!["--fmad=false".to_owned()];
    if let Some(arch) = arch {
        options.push(format!("--gpu-architecture={arch}"));
    }
    options
}

/// The kernels compiled by NVRTC (no context needed), as the driver loads them: a CUBIN for
/// `arch`, or, if this NVRTC cannot make one (it predates the GPU), PTX (NUL-terminated). The
/// second value says which.
fn compile_kernels(arch: &str) -> Result<(Vec<u8>, String), CudaError> {
    if !nvrtc_present() {
        return Err(CudaError::new(
            "compiling the kernels",
            "libnvrtc.so was not found (the CUDA toolkit's NVRTC: add its lib64 to LD_LIBRARY_PATH)",
            false,
        ));
    }
    // cudarc panics when a symbol cannot be loaded (an NVRTC too old for it).
    let run = |arch: Option<&str>| {
        std::panic::catch_unwind(|| nvrtc_compile(arch)).unwrap_or_else(|_| {
            Err(CudaError::new(
                "compiling the kernels",
                "NVRTC could not be loaded",
                false,
            ))
        })
    };
    match run(Some(arch)) {
        Ok(cubin) => Ok((cubin, format!("CUBIN for {arch}"))),
        Err(e) => {
            let ptx = run(None)?;
            Ok((
                ptx,
                format!("PTX, JIT-compiled by the driver ({arch}: {})", e.code),
            ))
        }
    }
}

/// One NVRTC compilation of the kernels: a CUBIN for `arch`, or PTX without one.
fn nvrtc_compile(arch: Option<&str>) -> Result<Vec<u8>, CudaError> {
    use cudarc::nvrtc::{result as rtc, sys as rtc_sys};
    let fail = |what: &'static str| {
        move |e: rtc::NvrtcError| {
            CudaError::new("compiling the kernels", format!("{what}: {e:?}"), false)
        }
    };
    let src = CString::new(KERNELS)
        .map_err(|_| CudaError::new("compiling the kernels", "source with a NUL byte", false))?;
    let prog = rtc::create_program(&src, None).map_err(fail("nvrtcCreateProgram"))?;
    let options = nvrtc_options(arch);
    // SAFETY: `prog` was created above and is destroyed below, after its last use; `src`
    // outlives it.
    unsafe {
        let compiled = rtc::compile_program(prog, &options).map_err(|e| {
            let log = rtc::get_program_log(prog)
                .map(|l| l.iter().map(|&c| c as u8 as char).collect::<String>())
                .unwrap_or_default();
            CudaError::new(
                "compiling the kernels",
                format!("{e:?}: {}", log.trim_end_matches('\0').trim()),
                false,
            )
        });
        let image = compiled.and_then(|()| {
            if arch.is_some() {
                let mut size = 0usize;
                rtc_sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(fail("nvrtcGetCUBINSize"))?;
                let mut cubin = vec![0u8; size];
                rtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast())
                    .result()
                    .map_err(fail("nvrtcGetCUBIN"))?;
                Ok(cubin)
            } else {
                let ptx = rtc::get_ptx(prog).map_err(fail("nvrtcGetPTX"))?;
                let mut ptx: Vec<u8> = ptx.iter().map(|&c| c as u8).collect();
                if ptx.last() != Some(&0) {
                    ptx.push(0);
                }
                Ok(ptx)
            }
        });
        let _ = rtc::destroy_program(prog);
        image
    }
}

/// Loads the kernels' image (a CUBIN or NUL-terminated PTX) into the current context.
fn load_kernels(image: &[u8]) -> Result<Kernels, CudaError> {
    // SAFETY: `image` is a complete CUBIN or NUL-terminated PTX that outlives the call; the
    // module is unloaded in Gpu's Drop, after every user of its functions is gone, or below.
    let module = unsafe { cu::module::load_data(image.as_ptr().cast()) }
        .map_err(|e| CudaError::driver("cuModuleLoadData", e))?;
    let function = |name: &str| {
        let name = CString::new(name).unwrap_or_default();
        // SAFETY: `module` was loaded above and `name` is NUL-terminated.
        unsafe { cu::module::get_function(module, name) }
            .map_err(|e| CudaError::driver("cuModuleGetFunction", e))
    };
    let functions = (|| {
        Ok::<_, CudaError>(Kernels {
            module,
            saxpy: function("sy_saxpy")?,
            reduce_partial: function("sy_reduce_partial")?,
            reduce_final: function("sy_reduce_final")?,
        })
    })();
    if functions.is_err() {
        // SAFETY: loaded above, used by nothing.
        let _ = unsafe { cu::module::unload(module) };
    }
    functions
}

/// Whether NVRTC (`libnvrtc.so`, the toolkit's run-time compiler the kernels need) can be
/// loaded on this host.
pub fn nvrtc_present() -> bool {
    // SAFETY: dlopen()s candidate names of the library and closes it again; no symbol is
    // called.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Whether cuBLAS (`libcublas.so`, GEMM's library) can be loaded on this host.
pub fn blas_present() -> bool {
    // SAFETY: as for `nvrtc_present`.
    unsafe { cudarc::cublas::sys::is_culib_present() }
}

/// Whether the CUDA driver library (`libcuda.so`) can be loaded on this host.
pub fn driver_present() -> bool {
    // SAFETY: dlopen()s candidate names of the driver library (running its initializers,
    // which the driver supports in any process) and closes it again; no symbol is called.
    unsafe { sys::is_culib_present() }
}

fn init() -> Result<(), CudaError> {
    static INIT: OnceLock<Result<(), CudaError>> = OnceLock::new();
    INIT.get_or_init(|| {
        if !driver_present() {
            return Err(CudaError::new(
                "loading the driver",
                "libcuda.so was not found (no NVIDIA driver on this host)",
                false,
            ));
        }
        cu::init().map_err(|e| CudaError::driver("cuInit", e))
    })
    .clone()
}

/// A GPU as the driver lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// Its ordinal in this process.
    pub ordinal: usize,
    /// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as `nvidia-smi -L` prints it.
    pub uuid: String,
    /// The product name.
    pub name: String,
    /// Memory, bytes.
    pub memory: u64,
    /// Compute capability (major, minor).
    pub compute: (u32, u32),
}

fn uuid_string(u: &sys::CUuuid) -> String {
    let b: Vec<u8> = u.bytes.iter().map(|&c| c as u8).collect();
    let hex = |r: std::ops::Range<usize>| {
        b.get(r)
            .unwrap_or_default()
            .iter()
            .map(|x| format!("{x:02x}"))
            .collect::<String>()
    };
    format!(
        "GPU-{}-{}-{}-{}-{}",
        hex(0..4),
        hex(4..6),
        hex(6..8),
        hex(8..10),
        hex(10..16)
    )
}

/// The GPUs of this host.
pub fn devices() -> Result<Vec<GpuInfo>, CudaError> {
    init()?;
    let n = cu::device::get_count().map_err(|e| CudaError::driver("cuDeviceGetCount", e))?;
    let mut out = Vec::new();
    for ordinal in 0..n {
        let dev = cu::device::get(ordinal).map_err(|e| CudaError::driver("cuDeviceGet", e))?;
        let name =
            cu::device::get_name(dev).map_err(|e| CudaError::driver("cuDeviceGetName", e))?;
        let uuid =
            cu::device::get_uuid(dev).map_err(|e| CudaError::driver("cuDeviceGetUuid", e))?;
        // SAFETY: `dev` was returned by cuDeviceGet.
        let memory = unsafe { cu::device::total_mem(dev) }
            .map_err(|e| CudaError::driver("cuDeviceTotalMem", e))?;
        let attr = |a| {
            // SAFETY: `dev` was returned by cuDeviceGet.
            unsafe { cu::device::get_attribute(dev, a) }
                .map_err(|e| CudaError::driver("cuDeviceGetAttribute", e))
                .map(|v| u32::try_from(v).unwrap_or_default())
        };
        use sys::CUdevice_attribute as A;
        let compute = (
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        );
        out.push(GpuInfo {
            ordinal: usize::try_from(ordinal).unwrap_or_default(),
            uuid: uuid_string(&uuid),
            name,
            memory: memory as u64,
            compute,
        });
    }
    Ok(out)
}

/// An open GPU: its primary context (blocking synchronization: a thread that waits for the
/// GPU sleeps), the kernels, and whether it was lost.
pub struct Gpu {
    info: GpuInfo,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    /// The kernels, or why there are none (no NVRTC on the host, a compilation or load that
    /// failed): the GPU then copies and fills, and SAXPY and REDUCE fail as transient errors.
    kernels: Result<Kernels, CudaError>,
    /// What the kernels were loaded as ("CUBIN for sm_90", or PTX and why).
    kernel_image: String,
    /// The first sticky error: every later call fails with it.
    lost: OnceLock<CudaError>,
}

/// The loaded module and its functions.
struct Kernels {
    module: sys::CUmodule,
    saxpy: sys::CUfunction,
    reduce_partial: sys::CUfunction,
    reduce_final: sys::CUfunction,
}

// SAFETY: the driver API's handles (device, context, module, functions) may be used from any
// thread; each call binds the context to the calling thread first (`bind`).
unsafe impl Send for Gpu {}
// SAFETY: as for Send; nothing in `Gpu` is mutated through `&self` but the OnceLock.
unsafe impl Sync for Gpu {}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

impl Gpu {
    /// Opens the GPU whose UUID (`GPU-…`, or a unique prefix of it) or ordinal is `which`.
    pub fn open(which: &str) -> Result<Arc<Gpu>, CudaError> {
        let all = devices()?;
        let wanted = which.trim();
        let matches: Vec<&GpuInfo> = all
            .iter()
            .filter(|g| {
                g.ordinal.to_string() == wanted
                    || (wanted.len() >= 8
                        && g.uuid
                            .to_ascii_lowercase()
                            .starts_with(&wanted.to_ascii_lowercase()))
                    || g.uuid.eq_ignore_ascii_case(wanted)
            })
            .collect();
        let info = match matches.as_slice() {
            [one] => (*one).clone(),
            [] => {
                let have: Vec<String> = all.iter().map(|g| g.uuid.clone()).collect();
                return Err(CudaError::new(
                    "opening the GPU",
                    format!("no GPU `{wanted}` (this host has: {})", have.join(", ")),
                    false,
                ));
            }
            _ => {
                return Err(CudaError::new(
                    "opening the GPU",
                    format!("`{wanted}` names more than one GPU"),
                    false,
                ));
            }
        };
        let ordinal = i32::try_from(info.ordinal).unwrap_or_default();
        let dev = cu::device::get(ordinal).map_err(|e| CudaError::driver("cuDeviceGet", e))?;
        // SAFETY: `dev` comes from cuDeviceGet; the flags only choose how waits behave and
        // apply when the primary context is first made active.
        unsafe {
            let _ = sys::cuDevicePrimaryCtxSetFlags_v2(
                dev,
                sys::CUctx_flags::CU_CTX_SCHED_BLOCKING_SYNC as u32,
            );
        }
        // SAFETY: `dev` comes from cuDeviceGet; the reference is released in Drop, or below
        // if the context cannot be made current.
        let ctx = unsafe { cu::primary_ctx::retain(dev) }
            .map_err(|e| CudaError::driver("cuDevicePrimaryCtxRetain", e))?;
        // SAFETY: `ctx` is the live primary context retained above.
        if let Err(e) = unsafe { cu::ctx::set_current(ctx) } {
            // SAFETY: the reference retained above, used by nothing.
            let _ = unsafe { cu::primary_ctx::release(dev) };
            return Err(CudaError::driver("cuCtxSetCurrent", e));
        }
        let arch = nvrtc_arch(info.compute.0, info.compute.1);
        let (kernels, kernel_image) = match compile_kernels(&arch) {
            Ok((image, what)) => (load_kernels(&image), what),
            Err(e) => (Err(e), "none".to_owned()),
        };
        Ok(Arc::new(Gpu {
            info,
            dev,
            ctx,
            kernels,
            kernel_image,
            lost: OnceLock::new(),
        }))
    }

    /// Why the GPU has no kernels (SAXPY and REDUCE then run on the CPU), if it has none.
    pub fn kernels_missing(&self) -> Option<&CudaError> {
        self.kernels.as_ref().err()
    }

    /// What the kernels were loaded as: "CUBIN for sm_90", or PTX and why.
    pub fn kernel_image(&self) -> &str {
        &self.kernel_image
    }

    fn kernels(&self) -> Result<&Kernels, CudaError> {
        self.kernels.as_ref().map_err(|e| {
            CudaError::new(
                "launching a kernel",
                format!("the GPU has no kernels ({e})"),
                false,
            )
        })
    }

    /// What the GPU is.
    pub fn info(&self) -> &GpuInfo {
        &self.info
    }

    /// The sticky error the GPU was lost with, if it was.
    pub fn lost(&self) -> Option<&CudaError> {
        self.lost.get()
    }

    /// Makes the context current on this thread; fails once the GPU is lost.
    fn bind(&self) -> Result<(), CudaError> {
        if let Some(e) = self.lost.get() {
            return Err(e.clone());
        }
        // SAFETY: `ctx` is retained until Drop.
        unsafe { cu::ctx::set_current(self.ctx) }
            .map_err(|e| self.check(CudaError::driver("cuCtxSetCurrent", e)))
    }

    /// Latches a sticky error.
    fn check(&self, e: CudaError) -> CudaError {
        if e.sticky {
            let _ = self.lost.set(e.clone());
        }
        e
    }

    /// Registers `region` (its whole mapping) with the GPU for DMA. The registration keeps
    /// the region mapped until it is dropped.
    pub fn register(
        self: &Arc<Self>,
        region: Arc<MmapRegion<()>>,
    ) -> Result<HostMemory, CudaError> {
        self.bind()?;
        let ptr = region.as_ptr() as usize;
        let len = region.size();
        // SAFETY: `[ptr, ptr+len)` is the mapping of `region`, which the returned HostMemory
        // keeps alive (the Arc) until it unregisters it; the driver pins its pages.
        unsafe {
            sys::cuMemHostRegister_v2(
                ptr as *mut c_void,
                len,
                sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        }
        .result()
        .map_err(|e| self.check(CudaError::driver("cuMemHostRegister", e)))?;
        Ok(HostMemory {
            gpu: self.clone(),
            region,
            ptr,
            len,
        })
    }

    /// Allocates `len` bytes of GPU memory.
    pub fn alloc(self: &Arc<Self>, len: usize) -> Result<DeviceMemory, CudaError> {
        self.bind()?;
        // SAFETY: a plain allocation; freed in DeviceMemory's Drop.
        let ptr = unsafe { cu::malloc_sync(len.max(1)) }
            .map_err(|e| self.check(CudaError::driver("cuMemAlloc", e)))?;
        Ok(DeviceMemory {
            gpu: self.clone(),
            ptr,
            len,
        })
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // SAFETY: every HostMemory, DeviceMemory and Stream holds an Arc of this Gpu, so none
        // is left; the module and the context reference are ours.
        unsafe {
            let _ = cu::ctx::set_current(self.ctx);
            if let Ok(k) = &self.kernels {
                let _ = cu::module::unload(k.module);
            }
            let _ = cu::primary_ctx::release(self.dev);
        }
    }
}

/// Host memory registered with a GPU (pinned, reachable by its DMA engines).
pub struct HostMemory {
    gpu: Arc<Gpu>,
    region: Arc<MmapRegion<()>>,
    ptr: usize,
    len: usize,
}

// SAFETY: the registration is an address range; the driver allows unregistering it from any
// thread, and the region is Send + Sync.
unsafe impl Send for HostMemory {}
// SAFETY: as for Send.
unsafe impl Sync for HostMemory {}

impl std::fmt::Debug for HostMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostMemory")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl HostMemory {
    /// Its length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The region it registers.
    pub fn region(&self) -> &Arc<MmapRegion<()>> {
        &self.region
    }
}

impl Drop for HostMemory {
    fn drop(&mut self) {
        // A lost context cannot unregister; its pins go with the process's context.
        if self.gpu.bind().is_ok() {
            // SAFETY: `ptr` was registered by `Gpu::register` and no stream work uses it
            // (Stream::run synchronizes before its borrows end).
            let r = unsafe { sys::cuMemHostUnregister(self.ptr as *mut c_void) }.result();
            if let Err(e) = r {
                let _ = self.gpu.check(CudaError::driver("cuMemHostUnregister", e));
            }
        }
    }
}

/// GPU memory.
pub struct DeviceMemory {
    gpu: Arc<Gpu>,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl std::fmt::Debug for DeviceMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceMemory")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl DeviceMemory {
    /// Its length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: allocated by `Gpu::alloc`; no stream work uses it any more.
            let _ = unsafe { cu::free_sync(self.ptr) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sys::cudaError_enum as E;

    #[test]
    fn kernels_are_compiled_for_the_devices_own_architecture_without_fma() {
        assert_eq!(nvrtc_arch(9, 0), "sm_90", "H100, H200");
        assert_eq!(nvrtc_arch(8, 6), "sm_86");
        assert_eq!(nvrtc_arch(12, 0), "sm_120");
        assert_eq!(
            nvrtc_options(Some("sm_90")),
            ["--fmad=false", "--gpu-architecture=sm_90"]
        );
        assert_eq!(
            nvrtc_options(None),
            ["--fmad=false"],
            "PTX for NVRTC's default"
        );
    }

    #[test]
    fn errors_that_end_the_context_are_sticky_and_the_rest_are_not() {
        for sticky in [
            E::CUDA_ERROR_ILLEGAL_ADDRESS,
            E::CUDA_ERROR_ECC_UNCORRECTABLE,
            E::CUDA_ERROR_CONTAINED,
            E::CUDA_ERROR_TENSOR_MEMORY_LEAK,
            E::CUDA_ERROR_EXTERNAL_DEVICE,
            E::CUDA_ERROR_KEY_ROTATION,
        ] {
            assert!(is_sticky(sticky), "{sticky:?}");
        }
        for transient in [
            E::CUDA_ERROR_OUT_OF_MEMORY,
            E::CUDA_ERROR_INVALID_VALUE,
            E::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,
            E::CUDA_ERROR_NOT_READY,
        ] {
            assert!(!is_sticky(transient), "{transient:?}");
        }
    }
}
