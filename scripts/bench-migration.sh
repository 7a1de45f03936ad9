#!/usr/bin/env bash
# Live-migration benchmark (guest-tests/harness/src/bin/migration-bench.rs, docs/performance.md
# "Live migration under QEMU"): a TCG guest holding a softgpu migrated between two QEMUs (the
# patched QEMU of scripts/build-qemu.sh) and two `switchyard serve`, against the same guest with
# no device (the floor): QEMU's total time, downtime and stream bytes (the device's share
# apart), and the device's STOP_COPY time and stream from the source server's log.
#
#   scripts/bench-migration.sh            # no device; 256 MiB, 1 GiB, 4 GiB (mapped and trapped) VRAM
#                                         # idle and writing; two 1 GiB devices idle (mapped and
#                                         # trapped); 3 runs each
#   scripts/bench-migration.sh --cap return-path --cap switchover-ack   # the same, QEMU waiting
#                                         # for the destination's ack before the switchover
#   scripts/bench-migration.sh --quick    # CI: no device, 256 MiB idle and writing, once each (~2 min)
#   scripts/bench-migration.sh --json target/bench/migration.json   # also the table as JSON
#   scripts/bench-migration.sh --only 1g-idle --set max-bandwidth=1073741824   # one case, QEMU parameters set
#
# The 4 GiB cases need about 10 GiB of memory (two servers with 3 GiB of VRAM data each, two
# guests). Timings are never asserted: it exits non-zero only when a migration fails (or does not
# converge within the bench's limit) or a guest check fails.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh >/dev/null
scripts/build-qemu.sh
# The static release builds serve both sides: the driver goes into the guest, and the static
# switchyard is the host's server too (the same code as a dynamic release build, one build less).
RUSTFLAGS="-C target-feature=+crt-static" \
  cargo build --release --locked -p sygpu-driver -p switchyard --target x86_64-unknown-linux-gnu
cargo build --release --locked -p switchyard-guest-tests --bin migration-bench
target_dir=$(cargo metadata --format-version 1 --no-deps --locked |
  sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
target_dir=${target_dir:-target}
static=$target_dir/x86_64-unknown-linux-gnu/release
SYGPU_DRIVER=$static/sygpu-driver SWITCHYARD_BIN=$static/switchyard \
  "$target_dir/release/migration-bench" "$@"
