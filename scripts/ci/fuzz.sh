#!/usr/bin/env bash
# Coverage-guided fuzzing of every parser of untrusted bytes (libFuzzer through cargo-fuzz):
# builds the targets of fuzz/ with the nightly toolchain, runs each for a given time and
# prints one table: executions, coverage (libFuzzer's `cov:` edges and `ft:` features), the
# working corpus and the crashes, per target. See docs/FUZZING.md.
#
#   scripts/ci/fuzz.sh [--seconds N] [--target NAME]... [--smoke] [--no-build] [--install]
#
#   --seconds N   time per target (default 60)
#   --target NAME only this target (repeatable; default: every target in fuzz/fuzz_targets)
#   --smoke       CI's run: 5 s per target (every target together in well under 2 minutes,
#                 the build not counted), built without optimization or AddressSanitizer
#                 (`--dev -s none`: about 4 minutes cold on 2 cores against 28 for the
#                 sanitizer build); the invariants are assertions, so a broken one still fails
#   --no-build    run what the last build left (fails if a target is missing)
#   --install     install cargo-fuzz first where it is missing (crates.io, about 2 minutes)
#
# Each target starts from its committed seeds (fuzz/corpus/<target>/, never written to) and
# grows a working corpus under fuzz/target/corpus/<target>/ that later runs continue from.
# Crash inputs land in fuzz/artifacts/<target>/; `cargo +nightly fuzz run <target> <file>`
# replays one. Logs: fuzz/target/logs/<target>.log.
#
# Exit codes: 0 no crash; 1 a target crashed (or timed out, or ran out of memory); 2 bad
# usage or build failure; 77 SKIPPED: no nightly toolchain or no cargo-fuzz (the product
# itself builds on stable; fuzzing needs nightly for the sanitizer flags).
set -uo pipefail
cd "$(dirname "$0")/../.."

SKIPPED=77
seconds=60
targets=()
build=1
install=0
# The build's flags, passed to `cargo fuzz run` too (other flags would rebuild).
build_flags=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --seconds) seconds="${2:?--seconds needs a number}"; shift 2 ;;
        --target) targets+=("${2:?--target needs a name}"); shift 2 ;;
        --smoke) seconds=5; build_flags=(--dev --sanitizer none); shift ;;
        --no-build) build=0; shift ;;
        --install) install=1; shift ;;
        -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
        *) echo "fuzz.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
[[ "$seconds" =~ ^[0-9]+$ && "$seconds" -gt 0 ]] || { echo "fuzz.sh: --seconds must be a positive integer" >&2; exit 2; }

if ! cargo +nightly --version >/dev/null 2>&1; then
    echo "fuzz.sh: SKIPPED: no nightly toolchain (rustup toolchain install nightly); fuzzing needs it for -Zsanitizer" >&2
    exit "$SKIPPED"
fi
# CI lints the workspace through clippy-driver (.ci/run); neither cargo-fuzz nor fuzz/ is
# built under it.
unset RUSTC_WORKSPACE_WRAPPER CLIPPY_ARGS
if [[ "$install" -eq 1 ]] && ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "fuzz.sh: installing cargo-fuzz"
    cargo install cargo-fuzz --locked --quiet || { echo "fuzz.sh: SKIPPED: cargo install cargo-fuzz failed" >&2; exit "$SKIPPED"; }
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "fuzz.sh: SKIPPED: cargo-fuzz is not installed (cargo +stable install cargo-fuzz --locked)" >&2
    exit "$SKIPPED"
fi

explicit=("${targets[@]}")
if [[ ${#targets[@]} -eq 0 ]]; then
    for f in fuzz/fuzz_targets/*.rs; do targets+=("$(basename "$f" .rs)"); done
fi
for t in "${targets[@]}"; do
    [[ -f "fuzz/fuzz_targets/$t.rs" ]] || { echo "fuzz.sh: no target $t (fuzz/fuzz_targets/$t.rs)" >&2; exit 2; }
done

if [[ "$build" -eq 1 ]]; then
    echo "fuzz.sh: building ${#targets[@]} target(s) with $(cargo +nightly --version) ${build_flags[*]}"
    start=$(date +%s)
    if [[ ${#explicit[@]} -eq 0 ]]; then
        # Every target in one cargo invocation (they share the dependencies' build).
        cargo +nightly fuzz build "${build_flags[@]}" || { echo "fuzz.sh: build failed" >&2; exit 2; }
    else
        for t in "${targets[@]}"; do
            cargo +nightly fuzz build "${build_flags[@]}" "$t" || { echo "fuzz.sh: build of $t failed" >&2; exit 2; }
        done
    fi
    echo "fuzz.sh: built in $(( $(date +%s) - start )) s"
fi

mkdir -p fuzz/target/logs
rows=()
crashed=0
for t in "${targets[@]}"; do
    work="fuzz/target/corpus/$t"
    artifacts="fuzz/artifacts/$t"
    log="fuzz/target/logs/$t.log"
    mkdir -p "$work" "$artifacts"
    before=$(find "$artifacts" -type f | wc -l)
    echo "fuzz.sh: $t for ${seconds} s"
    # The working corpus first (libFuzzer writes new inputs there), the seeds read only.
    # -timeout: one input taking 10 s is a hang; -rss_limit_mb: a reader holding 2 GiB for a
    # small input breaks its budget.
    cargo +nightly fuzz run "${build_flags[@]}" "$t" "$work" "fuzz/corpus/$t" -- \
        -max_total_time="$seconds" -print_final_stats=1 -timeout=10 -rss_limit_mb=2048 \
        >"$log" 2>&1
    rc=$?
    after=$(find "$artifacts" -type f | wc -l)
    new=$(( after - before ))
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | tail -n1 | grep -o '[0-9]*$')
    rss=$(grep -o 'stat::peak_rss_mb: *[0-9]*' "$log" | tail -n1 | grep -o '[0-9]*$')
    last=$(grep -E '#[0-9]+.*cov: [0-9]+' "$log" | tail -n1)
    cov=$(grep -o 'cov: [0-9]*' <<<"$last" | grep -o '[0-9]*')
    ft=$(grep -o 'ft: [0-9]*' <<<"$last" | grep -o '[0-9]*')
    corp=$(grep -o 'corp: [0-9]*' <<<"$last" | grep -o '[0-9]*')
    status="ok"
    if [[ $rc -ne 0 || $new -gt 0 ]]; then
        status="CRASH rc=$rc (+$new in $artifacts; log $log)"
        crashed=1
        grep -m1 -E 'panicked at|ERROR: libFuzzer|ERROR: AddressSanitizer' "$log" >&2
    fi
    rows+=("$(printf '%-20s %6s %12s %10s %6s %7s %6s %8s  %s' \
        "$t" "$seconds" "${execs:-?}" "$(( ${execs:-0} / seconds ))" "${cov:-?}" "${ft:-?}" \
        "${corp:-?}" "${rss:-?}" "$status")")
done

echo
printf '%-20s %6s %12s %10s %6s %7s %6s %8s  %s\n' target seconds execs 'exec/s' cov ft corpus rss_mb result
for r in "${rows[@]}"; do echo "$r"; done
exit "$crashed"
