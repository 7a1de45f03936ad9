//! VRAM belongs to the slot (the context's memory objects), not to the device.

use std::os::unix::fs::MetadataExt;
use std::sync::Arc;

use switchyard_device::{DeviceContext, DmaSpace, Interrupts};

use crate::{SoftGpu, SoftGpuConfig, SoftGpuError, StateError};

fn ctx() -> DeviceContext {
    DeviceContext {
        dma: Arc::new(DmaSpace::new(8)),
        irqs: Arc::new(Interrupts::new(&[1, 1, 2048, 1, 1])),
        waits: Default::default(),
        memory: Default::default(),
    }
}

fn ino(gpu: &SoftGpu) -> u64 {
    gpu.vram_file().metadata().expect("stat").ino()
}

#[test]
fn devices_of_one_slot_are_lent_its_vram() {
    let config = SoftGpuConfig {
        vram_size: 4 << 20,
        ..SoftGpuConfig::default()
    };
    let slot = ctx();
    let first = SoftGpu::new(config, slot.clone()).expect("first");
    let next = SoftGpu::successor(config, slot.clone()).expect("successor");
    assert_eq!(
        ino(&first),
        ino(&next),
        "the successor is lent the slot's VRAM"
    );
    drop(first);
    let again = SoftGpu::new(config, slot.clone()).expect("a new device in the slot");
    assert_eq!(ino(&again), ino(&next), "the VRAM outlives the devices");
    // Another slot has VRAM of its own.
    let elsewhere = SoftGpu::new(config, ctx()).expect("another slot");
    assert_ne!(ino(&elsewhere), ino(&next));
    // A device whose VRAM would differ from the slot's is refused.
    let bigger = SoftGpuConfig {
        vram_size: 8 << 20,
        ..config
    };
    let refused = |r: Result<SoftGpu, SoftGpuError>, why: &str| match r {
        Err(SoftGpuError::State(StateError::Inconsistent(m))) => assert!(m.contains(why), "{m}"),
        other => panic!("expected an inconsistent-state refusal, got {other:?}"),
    };
    refused(SoftGpu::new(bigger, slot.clone()), "another configuration");
    refused(SoftGpu::successor(bigger, slot), "another configuration");
    // A successor needs a slot that has VRAM.
    refused(SoftGpu::successor(config, ctx()), "no softgpu VRAM");
}
