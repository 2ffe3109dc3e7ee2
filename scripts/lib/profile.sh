# Sourced by scripts/soak.sh and scripts/chaos.sh: PROFILE (release|dev) to the cargo flag and
# the binaries it builds (STAGEB, LOADGEN). Needs ROOT and PROFILE set.
case "$PROFILE" in
    release) PROFILE_DIR=release; PROFILE_FLAG=(--release) ;;
    dev) PROFILE_DIR=debug; PROFILE_FLAG=() ;;
    *) echo "--profile must be release or dev, not $PROFILE" >&2; exit 2 ;;
esac
STAGEB="$ROOT/target/$PROFILE_DIR/stageb"
LOADGEN="$ROOT/target/$PROFILE_DIR/examples/loadgen"
