#!/usr/bin/env bash
# Installs what ckptfs needs on a Debian machine: FUSE 3 (packages), and a
# virtual environment at .venv with ckptfs, torch==2.13.0 (CPU) and the test
# tools. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# gcc and python3-dev: pyfuse3, which the tests' stand-in store uses (the daemon
# needs no compiler);
# iproute2 and iptables: the fault trials' network namespaces and packet loss.
$SUDO apt-get install -y -qq fuse3 libfuse3-dev pkg-config gcc python3-dev rsync openssl iproute2 iptables >/dev/null
[ -x .venv/bin/python ] || python3 -m venv .venv
# torch first and pinned: a bare "torch" requirement would pull a CUDA build.
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/pip install -q --disable-pip-version-check -e '.[test]'
# Real framework code for the tests (Lightning, HF Trainer, safetensors); pinned,
# and torch==2.13.0 is listed there too so pip fails rather than replace it.
.venv/bin/pip install -q --disable-pip-version-check -r tests/requirements-frameworks.txt
# The editable install runs the sources in place, and nothing writes their
# bytecode where PYTHONDONTWRITEBYTECODE is set (as on CI): every daemon and
# every CLI call would compile ckptfs again, about 0.45 s per daemon start.
.venv/bin/python -m compileall -q __init__.py __main__.py fs peer tools tests >/dev/null
echo "ckptfs installed: $(.venv/bin/ckptfs --help >/dev/null && echo .venv/bin/ckptfs)"
