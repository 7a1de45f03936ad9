#!/usr/bin/env bash
# The full test suite — the README's test command, and what CI runs:
#   formatting, clippy -D warnings, unit/property/integration tests against a real server
#   process, guest tests that boot QEMU 11.1 (TCG) guests driving the softgpu, and a bounded
#   fuzz run of the protocol decoder.
# Sets up what it needs (scripts/setup.sh: QEMU, guest kernel, busybox; idempotent).
#
#   scripts/test.sh
#   FUZZ_SECONDS=10 scripts/test.sh      # shorter fuzzing
set -euo pipefail
cd "$(dirname "$0")/.."

# The full suite always runs the guest tests: an inherited skip switch would let every guest
# test pass without booting anything.
if [ "${SWITCHYARD_SKIP_GUEST_TESTS:-}" = 1 ]; then
  echo "test.sh: error: SWITCHYARD_SKIP_GUEST_TESTS=1 is set, but the full suite never skips" \
    "guest tests; unset it (it is only for running cargo test by hand)" >&2
  exit 2
fi
unset SWITCHYARD_SKIP_GUEST_TESTS

step() { printf '\n==> %s [%ds]\n' "$*" "$((SECONDS - start))"; }
start=$SECONDS

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy (-D warnings)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "MSRV (scripts/check-msrv.sh; std APIs are checked by clippy's incompatible_msrv above)"
scripts/check-msrv.sh

step "cargo doc (-D warnings)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked

step "guest prerequisites (scripts/setup.sh)"
scripts/setup.sh

step "static in-guest driver"
RUSTFLAGS="-C target-feature=+crt-static" \
  cargo build --release --locked -p sygpu-driver --target x86_64-unknown-linux-gnu
export SYGPU_DRIVER=$PWD/target/x86_64-unknown-linux-gnu/release/sygpu-driver

step "unit, property and integration tests"
cargo build --locked -p switchyard
export SWITCHYARD_BIN=$PWD/target/debug/switchyard
cargo test --workspace --locked --exclude switchyard-guest-tests

step "guest tests (QEMU 11.1, TCG; one guest at a time)"
cargo test --locked -p switchyard-guest-tests -- --test-threads=1

step "benchmarks, short mode (checks they run; timings are never asserted)"
scripts/bench.sh --quick

step "fuzz: protocol decoder (${FUZZ_SECONDS:-60}s, bounded)"
cargo run --release --locked -p switchyard-proto --example fuzz_decode -- \
  --seconds "${FUZZ_SECONDS:-60}" --seed "${FUZZ_SEED:-$RANDOM}"

step "all passed"
