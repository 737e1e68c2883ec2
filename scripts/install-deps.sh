#!/usr/bin/env bash
# install-deps.sh — what spotune needs to build and run its tests on Debian 12:
# the C toolchain and the libraries (apt-get), and a Python virtual
# environment in .venv for the data-preparation scripts (pip). Idempotent and
# quick when everything is present. Needs root or sudo for apt-get.
#
# usage: scripts/install-deps.sh [--python [--hf]]
#   --python: also the .venv (scripts/requirements-data.txt, -plot.txt, and
#             -build.txt: the cuDNN frontend's headers, for the CUDA build)
#   --hf:     and in it the Hugging Face reference stack the tests compare
#             against (scripts/requirements-hf.txt: torch, PEFT, bitsandbytes;
#             about 5 GB; scripts/test.sh asks for it)
set -euo pipefail
cd "$(dirname "$0")/.."

PKGS="build-essential cmake ninja-build pkg-config git libyaml-dev libjansson-dev
libhdf5-dev hdf5-tools libopenblas-openmp-dev libcriterion-dev libopenmpi-dev openmpi-bin
libcurl4-openssl-dev libssl-dev libxml2-dev python3 python3-venv python3-pip ca-certificates"

missing=""
for p in $PKGS; do
  st=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [ "$st" = "install ok installed" ] || missing="$missing $p"
done
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; fi
if [ -n "$missing" ]; then
  echo "install-deps: installing$missing"
  $SUDO apt-get update -q
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing
fi

python=0 hf=0
for a in "$@"; do
  case "$a" in
    --python) python=1 ;;
    --hf) hf=1 ;;
    *) echo "usage: scripts/install-deps.sh [--python [--hf]]" >&2; exit 2 ;;
  esac
done
if [ "$hf" = 1 ] && [ "$python" = 0 ]; then
  echo "install-deps: --hf installs into the .venv: give --python too" >&2; exit 2
fi
if [ "$python" = 1 ]; then
  if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
  fi
  want=$(cat scripts/requirements-data.txt scripts/requirements-plot.txt \
    scripts/requirements-build.txt | sha256sum | cut -c1-16)
  if [ "$(cat .venv/.installed 2>/dev/null || true)" != "$want" ]; then
    echo "install-deps: pip install into .venv (data preparation, plots, build headers)"
    .venv/bin/pip install -q --disable-pip-version-check \
      -r scripts/requirements-data.txt -r scripts/requirements-plot.txt
    # headers only: the frontend's own dependencies are for its Python side
    .venv/bin/pip install -q --disable-pip-version-check --no-deps \
      -r scripts/requirements-build.txt
    echo "$want" > .venv/.installed
  fi
  if [ "$hf" = 1 ]; then
    want=$(sha256sum < scripts/requirements-hf.txt | cut -c1-16)
    if [ "$(cat .venv/.installed-hf 2>/dev/null || true)" != "$want" ]; then
      echo "install-deps: pip install into .venv (torch, PEFT, bitsandbytes: the tests' reference)"
      .venv/bin/pip install -q --disable-pip-version-check -r scripts/requirements-hf.txt \
        -r scripts/requirements-data.txt
      echo "$want" > .venv/.installed-hf
    fi
  fi
fi
