# Sourced by scripts/ci/soak.sh, scripts/ci/chaos.sh and scripts/bench/bench-resume.sh: PROFILE
# (release|dev) to the cargo flag and the binaries it builds (STAGEB, LOADGEN), and the PIDS
# killed on exit. Needs ROOT and PROFILE set.
case "$PROFILE" in
    release) PROFILE_DIR=release; PROFILE_FLAG=(--release) ;;
    dev) PROFILE_DIR=debug; PROFILE_FLAG=() ;;
    *) echo "--profile must be release or dev, not $PROFILE" >&2; exit 2 ;;
esac
STAGEB="$ROOT/target/$PROFILE_DIR/stageb"
LOADGEN="$ROOT/target/$PROFILE_DIR/examples/loadgen"
