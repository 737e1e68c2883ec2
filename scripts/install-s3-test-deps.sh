#!/usr/bin/env bash
# install-s3-test-deps.sh — Debian packages for the local S3 test server
# (OpenStack Swift + s3api, see scripts/swift-s3.sh) and awscli, used by the
# S3 tests and scripts/bench_store.sh. Idempotent: returns at once when every
# package is already installed. Needs root (or sudo).
#
# Usage: scripts/install-s3-test-deps.sh
set -euo pipefail

PKGS="swift-proxy swift-account swift-container swift-object curl awscli"

missing=""
for p in $PKGS; do
  st=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [ "$st" = "install ok installed" ] || missing="$missing $p"
done
if [ -z "$missing" ]; then
  echo "install-s3-test-deps: all present ($PKGS)"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; fi

# The packages ship init scripts and systemd units: keep them from starting
# stock services on ports 8080 and 6200-6202 during the install.
rm_policy=""
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
  $SUDO chmod +x /usr/sbin/policy-rc.d
  rm_policy=1
fi
cleanup() { if [ -n "$rm_policy" ]; then $SUDO rm -f /usr/sbin/policy-rc.d; fi; }
trap cleanup EXIT

echo "install-s3-test-deps: installing$missing"
$SUDO apt-get update -q
# --no-install-recommends: 78 packages instead of 171 (no GTK, keyring, keystone)
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing
