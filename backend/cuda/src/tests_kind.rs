//! The device conformance suite (`switchyard-conformance`) on the `cuda` kind, built as a
//! pool builds it (`gpu=fake`: the fake GPU), in both interrupt modes: the softgpu's device
//! with its commands on the accelerator offers what the softgpu does, migration, swap,
//! recovery and moves under its client included (its VRAM is never client-mapped).

use switchyard_conformance::{Groups, Moves, Subject, conformance_tests};

use crate::CudaKind;

fn cuda(options: &str) -> Subject {
    Subject::kind_kv(CudaKind, options)
        .named(format!("cuda({options})"))
        .declares(Groups {
            migration: true,
            swap: true,
            recovery: true,
            relocation: Moves::UnderClient,
            telemetry: true,
        })
}

conformance_tests!(fake_msix, cuda("gpu=fake,vram=4M,queues=2"));

conformance_tests!(fake_msi, cuda("gpu=fake-msi,vram=4M,queues=1,irq=msi"));
