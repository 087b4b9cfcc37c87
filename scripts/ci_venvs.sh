#!/usr/bin/env bash
# The venvs of `make test`'s last two tiers (the torch-free tier's, the GPU rehearsal's),
# made while the torch tier runs: pip's downloads, unpacking and disk writes beside its
# tests instead of at the start of those tiers (about 20 s each there).
#
#   scripts/ci_venvs.sh start DIR   make both under DIR in the background (DIR emptied first)
#   scripts/ci_venvs.sh wait DIR    wait for both; print a failure's log and fail as it did
set -uo pipefail
cd "$(dirname "$0")/.."
what=$1
dir=$2
case "$what" in
  start)
    rm -rf "$dir"
    mkdir -p "$dir"
    for tier in notorch:scripts/test_without_torch.sh gpu:scripts/gpu_rehearsal.sh; do
      name=${tier%%:*}
      (
        bash "${tier#*:}" --venv-only "$dir/$name" >"$dir/$name.log" 2>&1
        echo $? >"$dir/$name.rc"
      ) </dev/null >/dev/null 2>&1 &
    done
    ;;
  wait)
    status=0
    for name in notorch gpu; do
      while [ ! -f "$dir/$name.rc" ]; do sleep 1; done
      rc=$(cat "$dir/$name.rc")
      if [ "$rc" != 0 ]; then
        echo "ci_venvs: the $name venv failed ($rc):" >&2
        cat "$dir/$name.log" >&2
        status=$rc
      fi
    done
    exit $status
    ;;
  *)
    echo "usage: scripts/ci_venvs.sh start|wait DIR" >&2
    exit 2
    ;;
esac
