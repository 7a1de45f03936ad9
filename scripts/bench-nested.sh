#!/usr/bin/env bash
# Nested-host benchmark (guest-tests/harness/src/bin/nested-bench.rs, docs/performance.md
# "Nested host"): MMIO read latency from an L2 guest under the real cloud-hypervisor, on a
# directly assigned device, a VMM-emulated register and the softgpu over vfio-user, with
# ratios against floors measured in the same run. Boots one TCG L1 (about a minute).
#
#   scripts/bench-nested.sh            # 2000 reads per path
#   scripts/bench-nested.sh --quick    # CI: 200 reads per path, timings never asserted
#
# Needs cloud-hypervisor in the setup cache (optional in scripts/setup.sh: docs/cloud-hypervisor.md);
# without it this fails at once (scripts/test.sh does not run it then, and says so).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/cloud-hypervisor.sh
. scripts/lib/cloud-hypervisor.sh
scripts/setup.sh >/dev/null
if ! sy_ch_installed "$(sy_cache "$PWD")"; then
  echo "bench-nested.sh: error: the L2 under test runs under cloud-hypervisor, which is not installed in $(sy_cache "$PWD") (set SWITCHYARD_CH_DIR and run scripts/setup.sh; see docs/cloud-hypervisor.md)" >&2
  exit 1
fi
RUSTFLAGS="-C target-feature=+crt-static" \
  cargo build --release --locked -p sygpu-driver -p switchyard -p sy-nested --target x86_64-unknown-linux-gnu
cargo build --release --locked -p switchyard -p switchyard-guest-tests --bin nested-bench
target_dir=$(cargo metadata --format-version 1 --no-deps --locked |
  sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
target_dir=${target_dir:-target}
static=$target_dir/x86_64-unknown-linux-gnu/release
SYGPU_DRIVER=$static/sygpu-driver SWITCHYARD_STATIC_BIN=$static/switchyard SY_NESTED_BIN=$static/sy-nested \
  SWITCHYARD_BIN=$target_dir/release/switchyard \
  "$target_dir/release/nested-bench" "$@"
