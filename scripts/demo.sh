#!/usr/bin/env bash
# The Switchyard demo: on a fresh Debian 12 machine, set up QEMU 11.1 and a guest kernel (once),
# build the server and the static in-guest driver, serve a softgpu, boot a guest that drives it
# through VFIO, and print a result table. Exits 0 when every result was verified.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
echo "==> building switchyard and the in-guest driver"
cargo build --release --locked -p switchyard -p switchyard-guest-tests --bin switchyard --bin demo
RUSTFLAGS="-C target-feature=+crt-static" cargo build --release --locked -p sygpu-driver --target x86_64-unknown-linux-gnu
echo "==> running the demo"
SWITCHYARD_BIN=$PWD/target/release/switchyard \
SYGPU_DRIVER=$PWD/target/x86_64-unknown-linux-gnu/release/sygpu-driver \
  exec target/release/demo
