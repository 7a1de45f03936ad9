//! The device conformance suite (`switchyard-conformance`) on the scratchpad kind: no
//! migration, replacement under a client, recovery, relocation under the client (its RAM is
//! never mapped), telemetry.
#![forbid(unsafe_code)]

use switchyard_conformance::{Groups, Moves, Subject, conformance_tests};
use switchyard_scratchpad::ScratchpadKind;

fn scratchpad(options: &str) -> Subject {
    Subject::kind_kv(ScratchpadKind, options)
        .named(format!("scratchpad({options})"))
        .declares(Groups {
            migration: false,
            swap: true,
            recovery: true,
            relocation: Moves::UnderClient,
            telemetry: true,
        })
}

conformance_tests!(smallest, scratchpad("size=4K"));

conformance_tests!(default_size, scratchpad(""));
