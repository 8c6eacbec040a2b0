#!/usr/bin/env bash
# Every test: the Rust crate's (`cargo test --features cuda`, extra arguments go to it) and the
# Python bindings' (pytest in tests/python, against the package installed with `pip install .`
# into a virtual environment, target/python-venv unless HIVEMESH_VENV says otherwise).
#
# The `cuda` feature builds anywhere (cudarc loads the driver and NVRTC at run time): its host
# tests run here, its kernels compile where NVRTC is on LD_LIBRARY_PATH, and its device tests
# print `skipped: ...` without a GPU. One build serves both this run and CI's GPU-path phase,
# which runs the same tests with NVRTC required (.ci/run).
#
# The first run creates the environment and installs maturin, pytest, numpy, msgpack and torch from
# the package index (torch is large: a few minutes). The extension is built in the dev profile
# here, which reuses most of `cargo test`'s dependencies; a plain `pip install .` builds it
# optimized.
set -euo pipefail
cd "$(dirname "$0")"

cargo test --locked --features cuda "$@"

venv=${HIVEMESH_VENV:-target/python-venv}
if [[ ! -x $venv/bin/python ]]; then
  echo "== creating $venv"
  "${PYTHON:-python3}" -m venv "$venv"
fi
py=$(cd "$venv" && pwd)/bin/python
"$py" -m pip install -q --disable-pip-version-check maturin pytest numpy msgpack
if ! "$py" -c "import torch" 2>/dev/null; then
  echo "== installing torch into $venv (large; once)"
  "$py" -m pip install -q --disable-pip-version-check torch
fi
# The optimizer, example and tensor tests skip themselves without torch (importorskip, for a
# bare environment); here torch was installed, so an import that still fails is an error, not
# a reason to skip them.
if ! err=$("$py" -c "import torch" 2>&1); then
  echo "torch is installed in $venv but does not import:" >&2
  echo "$err" | tail -n 5 >&2
  exit 1
fi
echo "== pip install . (the Python bindings)"
PATH="$(dirname "$py"):$PATH" MATURIN_PEP517_ARGS="--profile dev" "$py" -m pip install -q --disable-pip-version-check \
  --no-build-isolation --force-reinstall --no-deps .
echo "== pytest tests/python"
"$py" -m pytest -q tests/python
