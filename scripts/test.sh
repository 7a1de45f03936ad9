#!/usr/bin/env bash
# The full test suite — the README's test command, and what CI runs:
#   formatting, clippy -D warnings, unit/property/integration tests against a real server
#   process, guest tests that boot QEMU 11.1 (TCG) guests driving the softgpu, and a bounded
#   fuzz run of the protocol decoder.
# Sets up what it needs (scripts/setup.sh: QEMU, guest kernel, busybox; idempotent).
# cloud-hypervisor is optional (docs/cloud-hypervisor.md): without it in the setup cache the tests
# that need it are left out, said so loudly at the guest tests, and the last line reads
# "all run tests passed; NOT RUN: ..." instead of "all passed". Under CI (CI=true) setup.sh fails
# without it instead.
#
#   scripts/test.sh
#   FUZZ_SECONDS=10 scripts/test.sh      # shorter fuzzing
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib/cloud-hypervisor.sh
. scripts/lib/cloud-hypervisor.sh

step() { printf '\n==> %s [%ds]\n' "$*" "$((SECONDS - start))"; }
start=$SECONDS

# bounded MINUTES WHAT COMMAND...: runs COMMAND, failing it (and saying so) if it is still
# running after MINUTES, so that a hang fails the suite in bounded time instead of holding CI
# until CI is killed without a word. Each guest test also has a watchdog of its own that says
# where it hangs (guest-tests/harness/src/watchdog.rs); this is the fence behind it.
bounded() {
  local minutes=$1 what=$2 rc=0 pid
  shift 2
  # timeout runs COMMAND in a process group of its own, so that a hang's every process is
  # stopped; that group is not the terminal's, so a Ctrl-C (or a TERM) to this script is passed
  # to timeout, which passes it to the group.
  timeout --kill-after=30 "${minutes}m" "$@" &
  pid=$!
  trap 'kill -INT "$pid" 2>/dev/null; wait "$pid"; exit 130' INT
  trap 'kill -TERM "$pid" 2>/dev/null; wait "$pid"; exit 143' TERM
  wait "$pid" || rc=$?
  trap - INT TERM
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    echo "test.sh: error: $what still running after $minutes minutes: a hang; stopped" \
      "(the test running is the last one named above)" >&2
  fi
  return "$rc"
}

# On a fresh checkout (CI) incremental compilation state is never reused, and it is the largest
# part of a clean build's target directory: leave it out there.
case ${CI:-} in
  true|1) export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0} ;;
esac
# A full run needs about DISK_NEEDED_GIB of disk (target directory, guest images, the patched
# QEMU's build). Say so first when there is less, so that a full disk is not mistaken for a bug
# in whatever compiles when it runs out.
DISK_NEEDED_GIB=6
free_gib=$(df -Pk . | awk 'NR == 2 {print int($4 / 1048576)}')
echo "test.sh: $free_gib GiB free on $(df -P . | awk 'NR == 2 {print $6}'); a full run needs about $DISK_NEEDED_GIB GiB"
if [ "${free_gib:-0}" -lt "$DISK_NEEDED_GIB" ]; then
  echo "test.sh: warning: less than $DISK_NEEDED_GIB GiB free: the build may fail with \"No space left on device\"" >&2
fi

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy (-D warnings)"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "MSRV (scripts/check-msrv.sh; std APIs are checked by clippy's incompatible_msrv above)"
scripts/check-msrv.sh

step "cargo doc (-D warnings)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked

step "error messages are sentence case (thiserror #[error(...)] starts with a capital)"
if grep -rn --include='*.rs' '#\[error("[a-z]' backend vmm-integration guest-tests; then
  echo "test.sh: error: the #[error] messages above start in lower case" >&2
  exit 1
fi

step "unsafe code lives only in backend/sys (every other crate root, test and example forbids it)"
# Integration tests and examples are crate roots of their own: tests/NAME.rs, tests/NAME/main.rs,
# examples/NAME.rs and examples/NAME/main.rs of every crate (backend/CRATE, ...); so are binaries,
# src/bin/NAME.rs and src/bin/NAME/main.rs (the other files of such a directory are its modules).
missing=$(
  {
    find backend vmm-integration guest-tests -path '*/target' -prune -o \
      \( -path '*/src/lib.rs' -o -path '*/src/main.rs' -o -path '*/src/bin/*/main.rs' \
         -o \( -path '*/src/bin/*.rs' -not -path '*/src/bin/*/*' \) \) -print
    find backend vmm-integration guest-tests -mindepth 3 -maxdepth 3 \
      \( -path '*/tests/*.rs' -o -path '*/examples/*.rs' \) -print
    find backend vmm-integration guest-tests -mindepth 4 -maxdepth 4 \
      \( -path '*/tests/*/main.rs' -o -path '*/examples/*/main.rs' \) -print
  } | grep -v '^backend/sys/' | xargs grep -L '^#!\[forbid(unsafe_code)\]' || true)
if [ -n "$missing" ]; then
  echo "test.sh: error: these crate roots lack #![forbid(unsafe_code)]:" $missing >&2
  exit 1
fi

step "no import cycles between a crate's modules (scripts/check-module-cycles.py)"
python3 scripts/check-module-cycles.py

step "no source file over 900 lines (tests and the in-guest driver excepted)"
long=$(find backend vmm-integration guest-tests -path '*/target' -prune -o -name '*.rs' \
    -path '*/src/*' -not -path 'guest-tests/driver/*' -not -path '*/tests/*' \
    -not -name 'tests.rs' -print | xargs wc -l | awk '$2 != "total" && $1 > 900 {print $2 " (" $1 ")"}')
if [ -n "$long" ]; then
  echo "test.sh: error: split these files along their seams:" $long >&2
  exit 1
fi

step "scripts/gpu-check.sh's step budgets fit the GPU host's 300 s (--budget)"
scripts/gpu-check.sh --budget

step "guest prerequisites (scripts/setup.sh)"
scripts/setup.sh

step "libvirt and the cluster packages for the libvirt and cluster guest tests (scripts/install-libvirt.sh --cluster; apt, about 20 MB, as root)"
# Without root and without them, those tests are left out (said here and in the last line);
# under CI they must run.
LIBVIRT_TESTS=(libvirt_runs_the_driver_workload_across_a_worker_restart
               cluster_places_vms_by_their_gpu_needs
               cluster_restarts_the_vm_of_a_failed_node_on_a_survivor
               cluster_live_migrates_a_soaking_vm_there_and_back
               cluster_standby_live_migrates_the_nodes_vm_away)
LIBVIRT_NOT_RUN=""
if [ "$(id -u)" = 0 ]; then
  scripts/install-libvirt.sh --cluster
elif ! scripts/install-libvirt.sh --cluster --check; then
  case ${CI:-} in
    true|1) echo "test.sh: error: libvirt is not installed and this is not root (CI=$CI)" >&2; exit 1 ;;
  esac
  LIBVIRT_NOT_RUN="${LIBVIRT_TESTS[*]}"
  echo "test.sh: NOT RUN (libvirt or the cluster packages not installed, not root to install them): $LIBVIRT_NOT_RUN; run scripts/install-libvirt.sh --cluster as root"
fi

step "patched QEMU for the live-migration guest tests (scripts/build-qemu.sh: Debian's source + vmm-integration/qemu/patches; about 5 minutes on 2 cores the first time, then cached outside the clone)"
scripts/build-qemu.sh

step "static guest binaries (driver; server, sy-nested and edu-client for the nested and passthrough guests)"
RUSTFLAGS="-C target-feature=+crt-static" \
  cargo build --release --locked -p sygpu-driver -p switchyard -p sy-nested -p edu-client \
  --target x86_64-unknown-linux-gnu
export SYGPU_DRIVER=$PWD/target/x86_64-unknown-linux-gnu/release/sygpu-driver
export SWITCHYARD_STATIC_BIN=$PWD/target/x86_64-unknown-linux-gnu/release/switchyard
export SY_NESTED_BIN=$PWD/target/x86_64-unknown-linux-gnu/release/sy-nested
export EDU_CLIENT=$PWD/target/x86_64-unknown-linux-gnu/release/edu-client

step "package: build the .deb from the static binary, unpack it into a scratch root, verify the unit (docs/packaging.md)"
deb=$(scripts/package.sh --binary "$SWITCHYARD_STATIC_BIN" | tail -n 1)
scripts/check-package.sh "$deb"

step "unit, property and integration tests"
# `fake-gpu`: `--device cuda,gpu=fake` (cuda boards on the fake GPU) for the pool's cuda tests;
# the package above is built without it.
cargo build --locked -p switchyard --features fake-gpu
export SWITCHYARD_BIN=$PWD/target/debug/switchyard
bounded 30 "the unit, property and integration tests" \
  cargo test --no-fail-fast --workspace --locked --exclude switchyard-guest-tests \
  --features switchyard/fake-gpu

step "tests that need root (#[ignore = \"needs root\"], run by name: scripts/run-root-tests.sh)"
# A plain `cargo test` lists them as ignored; here each runs by name, and the suite fails unless
# every one of them ran and passed. Without root (a developer's own run) they are NOT RUN, said
# here and in the last line; CI runs as root, and under CI=true their absence fails.
ROOT_NOT_RUN=
if [ "$(id -u)" = 0 ]; then
  bounded 10 "the tests that need root" scripts/run-root-tests.sh
elif [ "${CI:-}" = true ] || [ "${CI:-}" = 1 ]; then
  echo "test.sh: error: CI must run as root (the tests that need root)" >&2
  exit 1
else
  ROOT_NOT_RUN="$(scripts/run-root-tests.sh --list | wc -l) tests that need root"
  echo "test.sh: NOT RUN (not root): $ROOT_NOT_RUN: scripts/run-root-tests.sh --list"
fi

step "guest tests (QEMU 11.1, TCG; one guest at a time)"
# The guest tests are #[ignore]d so that a plain `cargo test` shows them as ignored instead of
# passing them; here they all run, and a test that did not run fails the suite. Only the tests
# that need cloud-hypervisor are left out (--skip: filtered out, not ignored) when setup.sh
# installed none, and that is said here and in the last line.
sy_ch_plan "$(sy_cache "$PWD")"
if [ -n "$SY_CH_NOT_RUN" ]; then
  echo "test.sh: NOT RUN (cloud-hypervisor not installed): $SY_CH_NOT_RUN; see docs/cloud-hypervisor.md"
fi
SKIP=("${SY_CH_SKIP[@]}")
if [ -n "$LIBVIRT_NOT_RUN" ]; then
  [ ${#SKIP[@]} -gt 0 ] || SKIP=(--exact)
  for t in "${LIBVIRT_TESTS[@]}"; do SKIP+=(--skip "$t"); done
fi
# The two-host migration makes network namespaces: root only (CI is root: see above).
HOSTS_NOT_RUN=
if [ "$(id -u)" != 0 ]; then
  [ ${#SKIP[@]} -gt 0 ] || SKIP=(--exact)
  SKIP+=(--skip a_migration_between_two_hosts_hands_the_lease_over)
  HOSTS_NOT_RUN="the two-host migration guest test"
  echo "test.sh: NOT RUN (not root): $HOSTS_NOT_RUN"
fi
NOT_RUN=$SY_CH_NOT_RUN${SY_CH_NOT_RUN:+ (cloud-hypervisor not installed; docs/cloud-hypervisor.md)}
NOT_RUN+=${LIBVIRT_NOT_RUN:+${NOT_RUN:+, }$LIBVIRT_NOT_RUN (libvirt not installed; scripts/install-libvirt.sh --cluster)}
NOT_RUN+=${ROOT_NOT_RUN:+${NOT_RUN:+, }$ROOT_NOT_RUN (not root; scripts/run-root-tests.sh)}
NOT_RUN+=${HOSTS_NOT_RUN:+${NOT_RUN:+, }$HOSTS_NOT_RUN (not root)}
guest_out=$(mktemp)
trap 'rm -f "$guest_out"' EXIT
# Every guest test binary runs even after one fails (--no-fail-fast); the failures are listed
# at the end.
guest_rc=0
bounded 65 "the guest tests" \
  cargo test --no-fail-fast --locked -p switchyard-guest-tests -- --test-threads=1 \
  --include-ignored "${SKIP[@]}" 2>&1 | tee "$guest_out" || guest_rc=$?
if [ "$guest_rc" != 0 ]; then
  echo "test.sh: error: guest tests failed (exit $guest_rc):" >&2
  grep -E '^test .* \.\.\. FAILED$|^error: .*(failed|target)' "$guest_out" >&2 || true
  exit 1
fi
if grep -Eq '; [1-9][0-9]* ignored;' "$guest_out"; then
  echo "test.sh: error: some guest tests did not run (ignored); see above" >&2
  exit 1
fi

step "benchmarks, short mode (checks they run; timings are never asserted)"
bounded 20 "scripts/bench.sh --quick" scripts/bench.sh --quick
bounded 15 "scripts/bench-migration.sh --quick" scripts/bench-migration.sh --quick
if [ -z "$SY_CH_NOT_RUN" ]; then
  bounded 20 "scripts/bench-nested.sh --quick" scripts/bench-nested.sh --quick
else
  echo "test.sh: scripts/bench-nested.sh NOT RUN (it needs cloud-hypervisor; see above)"
fi

step "scripts/gpu-check.sh without a GPU: seconds, each GPU step failing with its reason (scripts/check-gpu-check.sh)"
# With the binaries built above (the debug cuda_backend test binary, switchyard and
# switchyard-bench); on a host with an NVIDIA driver it checks only the budget and --only.
bounded 3 "scripts/check-gpu-check.sh" scripts/check-gpu-check.sh

step "fuzz: protocol decoder (${FUZZ_SECONDS:-60}s, bounded)"
cargo run --release --locked -p switchyard-proto --example fuzz_decode -- \
  --seconds "${FUZZ_SECONDS:-60}" --seed "${FUZZ_SEED:-$RANDOM}"

if [ -n "$NOT_RUN" ]; then
  step "all run tests passed; NOT RUN: $NOT_RUN"
else
  step "all passed"
fi
