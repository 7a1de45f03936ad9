//! DEVICE_SET_IRQS strategies.

use super::*;
use crate::requests::{OIrqData, OReq};

fn irq_action() -> impl Strategy<Value = IrqAction> {
    prop_oneof![
        Just(IrqAction::Mask),
        Just(IrqAction::Unmask),
        Just(IrqAction::Trigger)
    ]
}

pub(crate) fn set_irqs() -> impl Strategy<Value = OReq> {
    prop_oneof![
        argsz_at_least(20).prop_map(|argsz| OReq::SetIrqs {
            argsz,
            action: IrqAction::Trigger,
            data: OIrqData::None,
            index: 2,
            start: 0,
            count: 0,
            nfds: 0
        }),
        (
            argsz_at_least(20),
            irq_action(),
            any::<u32>(),
            0u32..4096,
            1u32..=16,
            0u8..3,
            any::<bool>()
        )
            .prop_flat_map(|(argsz, action, index, start, count, kind, with_fds)| {
                prop::collection::vec(any::<u8>(), count as usize).prop_map(move |bools| {
                    let (data, nfds) = match kind {
                        0 => (OIrqData::None, 0),
                        1 => (OIrqData::Bool(bools), 0),
                        _ => (OIrqData::Eventfd, if with_fds { count as usize } else { 0 }),
                    };
                    OReq::SetIrqs {
                        argsz,
                        action,
                        data,
                        index,
                        start,
                        count,
                        nfds,
                    }
                })
            }),
    ]
}
