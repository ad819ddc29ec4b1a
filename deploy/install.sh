#!/usr/bin/env bash
# Installs ckptfs from this checkout on a Debian machine, into a virtual
# environment at .venv. Safe to run again.
#
#   bash deploy/install.sh          # what the daemon and the demo need: FUSE 3
#                                   # (packages), ckptfs and torch==2.13.0 (CPU)
#   bash deploy/install.sh --test   # and the test stack: pytest and its plugins,
#                                   # pyfuse3 (compiled), the pinned frameworks
set -euo pipefail
cd "$(dirname "$0")/.."
TEST=0
case "${1:-}" in
--test) TEST=1 ;;
"") ;;
*) echo "usage: $0 [--test]" >&2; exit 2 ;;
esac
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
PACKAGES=(fuse3 python3-venv)
# For the tests: gcc, python3-dev and libfuse3-dev build pyfuse3 (the tests'
# stand-in NFS server; the daemon needs no compiler); iproute2 and iptables
# make the fault trials' network namespaces and packet loss; util-linux's
# mount(8) runs the mount helper.
[ "$TEST" = 0 ] || PACKAGES+=(libfuse3-dev pkg-config gcc python3-dev rsync openssl iproute2 iptables util-linux)
$SUDO apt-get install -y -qq "${PACKAGES[@]}" >/dev/null
[ -x .venv/bin/python ] || python3 -m venv .venv
PIP=(.venv/bin/pip install -q --disable-pip-version-check)
# torch first and pinned: a bare "torch" requirement would pull a CUDA build.
"${PIP[@]}" torch==2.13.0
if [ "$TEST" = 1 ]; then
    # Real framework code for the tests (Lightning, HF Trainer, safetensors);
    # pinned, with torch==2.13.0 among them so pip fails rather than replace it.
    "${PIP[@]}" -e '.[test,frameworks]'
else
    "${PIP[@]}" -e '.[torch]'
fi
# The editable install runs the sources in place, and nothing writes their
# bytecode where PYTHONDONTWRITEBYTECODE is set (as on CI): every daemon and
# every CLI call would compile ckptfs again, about 0.45 s per daemon start.
.venv/bin/python -m compileall -q __init__.py __main__.py fs peer tools tests >/dev/null
echo "ckptfs installed: $(.venv/bin/ckptfs --version) at .venv/bin/ckptfs"
