//! The device conformance suite (`switchyard-conformance`) on the softgpu kind, in both
//! interrupt modes and both VRAM policies: VRAM the guest may map moves only detached (a
//! client mapping cannot be re-pointed), VRAM it may not map moves under the client.
#![forbid(unsafe_code)]

use switchyard_conformance::{Groups, Moves, Subject, conformance_tests};
use switchyard_softgpu::SoftGpuKind;

/// What a softgpu offers besides the core, moving as `relocation` says.
fn softgpu(options: &str, relocation: Moves) -> Subject {
    Subject::kind_kv(SoftGpuKind, options)
        .named(format!("softgpu({options})"))
        .declares(Groups {
            migration: true,
            swap: true,
            recovery: true,
            relocation,
            telemetry: true,
        })
}

conformance_tests!(msix_mapped, softgpu("vram=4M,queues=2", Moves::Detached));

conformance_tests!(
    msi_unmapped,
    softgpu("vram=4M,queues=1,irq=msi,vram_mmap=off", Moves::UnderClient)
);
