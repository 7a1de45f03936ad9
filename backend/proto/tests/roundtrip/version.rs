//! VERSION strategies.

use super::*;

pub(crate) fn version_data() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(Vec::new()),
        "[ -~]{0,64}".prop_map(|s| {
            let mut v = s.into_bytes();
            v.push(0);
            v
        }),
        (any::<u32>(), 1u32..=1024, any::<bool>()).prop_map(|(x, fds, wm)| {
            Capabilities {
                max_msg_fds: fds,
                max_data_xfer_size: (x % MAX_DATA_XFER_SIZE_LIMIT) + 1,
                write_multiple: wm,
                ..Capabilities::default()
            }
            .to_version_data()
        }),
    ]
}
