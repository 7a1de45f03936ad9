#!/usr/bin/env bash
# Runs every test marked `#[ignore = "needs root"]` by name, one at a time
# (`cargo test -p PACKAGE --test FILE -- --ignored --exact NAME`), and fails unless each of them
# ran and passed. A plain `cargo test` lists them as ignored; scripts/test.sh calls this as root.
#
#   scripts/run-root-tests.sh          # run them
#   scripts/run-root-tests.sh --list   # print PACKAGE FILE NAME per test, run nothing
set -euo pipefail
cd "$(dirname "$0")/.."

# PACKAGE FILE NAME for each marked test in an integration test file (tests/*.rs): the marker
# and then, before the next item, its `fn`.
list() {
  local file dir pkg
  while IFS= read -r file; do
    dir=${file%/tests/*}
    pkg=$(sed -n 's/^name = "\(.*\)"$/\1/p' "$dir/Cargo.toml" | head -n 1)
    awk -v pkg="$pkg" -v test="$(basename "$file" .rs)" '
      /^[ \t]*#\[ignore = "needs root"\]/ { marked = 1; next }
      marked && match($0, /fn [A-Za-z0-9_]+/) {
        print pkg, test, substr($0, RSTART + 3, RLENGTH - 3); marked = 0
      }' "$file"
  done < <(grep -rl --include='*.rs' '#\[ignore = "needs root"\]' backend vmm-integration guest-tests |
    grep '/tests/[^/]*\.rs$' | sort)
}

if [ "${1:-}" = --list ]; then
  list
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "run-root-tests.sh: error: the tests marked \"needs root\" need root" >&2
  exit 1
fi

mapfile -t tests < <(list)
if [ ${#tests[@]} = 0 ]; then
  echo "run-root-tests.sh: error: no test marked \"needs root\" found; the marker changed?" >&2
  exit 1
fi
failed=() out=$(mktemp)
trap 'rm -f "$out"' EXIT
for t in "${tests[@]}"; do
  read -r pkg file name <<<"$t"
  echo "run-root-tests.sh: $pkg --test $file $name"
  rc=0
  # The features scripts/test.sh builds the binary with, so that it is not rebuilt without.
  features=()
  [ "$pkg" = switchyard ] && features=(--features fake-gpu)
  cargo test --locked -q -p "$pkg" "${features[@]}" --test "$file" -- --ignored --exact "$name" 2>&1 |
    tee "$out" || rc=$?
  # Exactly this one test ran and passed (a renamed test would run none and say "0 passed").
  if [ "$rc" != 0 ] || ! grep -q '^test result: ok\. 1 passed' "$out"; then
    failed+=("$pkg --test $file $name")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "run-root-tests.sh: error: ${#failed[@]} of ${#tests[@]} did not run and pass:" >&2
  printf '  %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "run-root-tests.sh: all ${#tests[@]} tests that need root ran and passed"
