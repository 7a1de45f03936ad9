//! The host's NVIDIA GPUs: through NVML when it is installed (UUID, memory, PCI address,
//! health), else through the CUDA driver (no PCI address or health). Both are loaded at run
//! time; a host with neither has no GPUs, and says why.

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError};
use serde_json::json;
use switchyard_device::kind::HostInventory;

/// A GPU of this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuRecord {
    /// `GPU-…`.
    pub uuid: String,
    /// Product name.
    pub name: String,
    /// Memory, bytes.
    pub memory: u64,
    /// PCI address (`0000:19:00.0`), when NVML says.
    pub pci: Option<String>,
    /// `None`: healthy (or NVML cannot tell); else what is wrong.
    pub problem: Option<String>,
    /// Where the record came from: `nvml` or `cuda`.
    pub source: &'static str,
}

fn nvml_gpus() -> Result<Vec<GpuRecord>, String> {
    let nvml = Nvml::init().map_err(|e| format!("NVML: {e}"))?;
    let n = nvml.device_count().map_err(|e| format!("NVML: {e}"))?;
    let mut out = Vec::new();
    for i in 0..n {
        let d = nvml.device_by_index(i).map_err(|e| format!("NVML: {e}"))?;
        let uuid = d.uuid().map_err(|e| format!("NVML: {e}"))?;
        let mut problem = None;
        if let Ok(n) = d.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
            && n > 0
        {
            problem = Some(format!(
                "{n} uncorrected ECC errors since the driver loaded"
            ));
        }
        if d.are_pages_pending_retired().unwrap_or(false) {
            problem.get_or_insert_with(|| "memory pages pending retirement (reset the GPU)".into());
        }
        out.push(GpuRecord {
            name: d.name().unwrap_or_default(),
            memory: d.memory_info().map(|m| m.total).unwrap_or_default(),
            pci: d.pci_info().ok().map(|p| p.bus_id.to_ascii_lowercase()),
            problem,
            uuid,
            source: "nvml",
        });
    }
    Ok(out)
}

/// Which commands a GPU of this host can run, by the libraries found: the kernels need
/// NVRTC, GEMM cuBLAS (a host with only the driver copies and fills on its GPUs).
pub fn offload_here() -> crate::gpu::Offload {
    use switchyard_sys::cuda;
    crate::gpu::Offload {
        no_kernels: (!cuda::nvrtc_present()).then(|| "libnvrtc.so was not found".to_owned()),
        no_gemm: (!cuda::blas_present()).then(|| "libcublas.so was not found".to_owned()),
    }
}

/// The GPUs of this host, or why none can be listed.
pub fn gpus() -> Result<Vec<GpuRecord>, String> {
    match nvml_gpus() {
        Ok(g) => Ok(g),
        Err(nvml) => {
            let cuda = switchyard_sys::cuda::devices().map_err(|e| format!("{nvml}; {e}"))?;
            Ok(cuda
                .into_iter()
                .map(|g| GpuRecord {
                    uuid: g.uuid,
                    name: g.name,
                    memory: g.memory,
                    pci: None,
                    problem: None,
                    source: "cuda",
                })
                .collect())
        }
    }
}

/// Whether the GPU `which` (UUID, prefix or ordinal) is here and healthy: its identity
/// (the product name; the boards of one pool share it) or why not.
pub fn probe(which: &str) -> Result<String, String> {
    let all = gpus().map_err(|e| format!("no NVIDIA GPU can be listed on this host ({e})"))?;
    let w = which.trim().to_ascii_lowercase();
    let found: Vec<(usize, &GpuRecord)> = all
        .iter()
        .enumerate()
        .filter(|(i, g)| {
            i.to_string() == w
                || g.uuid.eq_ignore_ascii_case(&w)
                || (w.len() >= 8 && g.uuid.to_ascii_lowercase().starts_with(&w))
        })
        .collect();
    match found.as_slice() {
        [(_, g)] => match &g.problem {
            None => Ok(g.name.clone()),
            Some(p) => Err(format!("GPU {} is unhealthy: {p}", g.uuid)),
        },
        [] => Err(format!(
            "no GPU `{which}` on this host (it has: {})",
            if all.is_empty() {
                "none".to_owned()
            } else {
                all.iter()
                    .map(|g| g.uuid.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        )),
        _ => Err(format!("`{which}` names more than one GPU")),
    }
}

/// The GPUs a board can name and which commands run on them (`switchyard inventory --kind
/// cuda`), or why no GPU can be listed.
pub fn host_inventory() -> Result<HostInventory, String> {
    let gpus = gpus().map_err(|e| format!("No NVIDIA GPU can be listed on this host: {e}"))?;
    let offload = offload_here();
    let rows = gpus
        .iter()
        .map(|g| {
            vec![
                g.uuid.clone(),
                g.name.clone(),
                format!("{} GiB", g.memory >> 30),
                g.pci.clone().unwrap_or_else(|| "-".into()),
                g.source.to_owned(),
                g.problem.clone().unwrap_or_else(|| "ok".into()),
            ]
        })
        .collect();
    let json = json!({ "offload": {
        "kernels": offload.no_kernels.is_none(),
        "gemm": offload.no_gemm.is_none(),
        "describe": offload.describe(),
    }, "gpus": gpus.iter().map(|g| json!({
        "uuid": g.uuid,
        "name": g.name,
        "memory": g.memory,
        "pci": g.pci,
        "problem": g.problem,
        "source": g.source,
    })).collect::<Vec<_>>() });
    Ok(HostInventory {
        columns: vec!["uuid", "name", "memory", "pci", "source", "health"],
        rows,
        footer: Some(format!("commands: {}", offload.describe())),
        json,
    })
}
