#!/usr/bin/env bash
# The full test suite: formatting, lints, unit/property/integration tests, and a bounded fuzz run
# of the protocol decoder. This is the command the README names and CI runs.
#
#   scripts/test.sh            # everything
#   FUZZ_SECONDS=10 scripts/test.sh
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }
start=$SECONDS

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy (-D warnings)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "cargo test"
cargo test --workspace --locked 2>&1 | tee target/test-output.txt
if grep -q "test result: FAILED" target/test-output.txt; then
    echo "test failures" >&2
    exit 1
fi

step "fuzz: protocol decoder (${FUZZ_SECONDS:-60}s, bounded)"
cargo run --release --locked -p switchyard-proto --example fuzz_decode -- --seconds "${FUZZ_SECONDS:-60}" --seed "${FUZZ_SEED:-$RANDOM}"

step "done in $((SECONDS - start))s"
