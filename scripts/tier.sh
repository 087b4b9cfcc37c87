#!/usr/bin/env bash
# `scripts/tier.sh NAME CMD...`: run one tier of `make test` and say how long it took, so a
# CI log shows where its minutes go.
set -u
name=$1
shift
start=$(date +%s)
"$@"
rc=$?
echo "make test: $name $([ $rc -eq 0 ] && echo passed || echo "FAILED ($rc)") in $(($(date +%s) - start)) s"
exit $rc
