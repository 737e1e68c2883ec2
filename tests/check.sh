# shellcheck shell=bash
# tests/check.sh — what the shell tests share (sourced): a scratch directory
# $tmp, removed at exit; check NAME STATUS DETAIL prints "ok   NAME" or
# "FAIL NAME: DETAIL" and counts the failures in $fails; has TEXT STRING is
# true when TEXT holds STRING.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
check() { # check NAME CONDITION_RESULT DETAIL
    if [[ $2 -eq 0 ]]; then echo "ok   $1"; else echo "FAIL $1: $3"; fails=$((fails + 1)); fi
}
has() { grep -qF -- "$2" <<<"$1"; }
