#!/usr/bin/env bash
# Installs the Debian packages the system tests need, ahead of time: `.ci/run` starts this in
# the background at the very start of CI, so the downloads and unpacking overlap the build and
# the tests, and waits for it before the system tier.
#
# Best effort and never fatal: a group that is present already is left alone, a group that
# cannot be installed (no apt-get, no root, no package source) is only logged. The system
# tests check for their tools again, install what is still missing themselves, and exit 77
# with the reason where they cannot.
#
# The groups are the ones the scripts install, with the same options:
#   scripts/ci/test-slurm.sh         slurm-wlm munge
#   scripts/ci/test-prometheus.sh    prometheus (no recommends)
#   scripts/lib/report-browser.sh    chromium fonts-liberation fonts-wqy-microhei (no recommends)
#
# usage: scripts/ci/apt-prefetch.sh   (prints what it did; exit 0 unless it was misused)
set -uo pipefail
[[ ":$PATH:" == *:/usr/sbin:* ]] || PATH="$PATH:/usr/sbin"

say() { echo "apt-prefetch[$(date +%T)]: $*"; }
has() { command -v "$1" >/dev/null 2>&1 || [[ -x "/usr/sbin/$1" ]]; }

sudo=""
if [[ "$(id -u)" != 0 ]]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    sudo="sudo -n"
  else
    say "not root and no sudo: nothing installed (the system tests say what they skip)"
    exit 0
  fi
fi
command -v apt-get >/dev/null 2>&1 || { say "no apt-get: nothing installed"; exit 0; }

groups=()
if ! { has sbatch && has srun && has scontrol && has scancel && has sinfo && has slurmctld &&
       has slurmd && has munged; }; then
  groups+=("slurm-wlm munge")
fi
has prometheus && has promtool || groups+=("--no-install-recommends prometheus")
if ! { has "${CHROMIUM:-chromium}" && fc-list :lang=zh 2>/dev/null | grep -q .; }; then
  groups+=("--no-install-recommends chromium fonts-liberation fonts-wqy-microhei")
fi
((${#groups[@]} > 0)) || { say "every package is installed already"; exit 0; }

apt=($sudo apt-get -o DPkg::Lock::Timeout=600)
t0=$SECONDS
if ! "${apt[@]}" update -qq; then
  say "apt-get update failed (no package source?): nothing installed"
  exit 0
fi
for group in "${groups[@]}"; do
  # shellcheck disable=SC2086 # a group is a list of words
  if DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y -qq $group >/dev/null; then
    say "installed: $group"
  else
    say "could not install: $group (its test installs or skips on its own)"
  fi
done
say "done in $((SECONDS - t0)) s"
