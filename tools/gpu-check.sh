#!/usr/bin/env bash
# hivemesh on a GPU: the `cuda` feature's tests, the device bench and the Python CUDA test, in
# one command of under 8 minutes on a machine that has a GPU but no cargo and no network.
#
#   1. Here (cargo, crates.io and PyPI reachable), in the repo root; CPU-heavy, ~15-25 min on
#      2 cores from a warm cache:
#        tools/gpu-check.sh prepare [BUNDLE]          # default BUNDLE=target/gpu-bundle
#      -> BUNDLE/ and BUNDLE.tar.xz: stripped test binaries and a release `hivemesh` built with
#      --features cuda, the Python extension (abi3, --features cuda; WITH_PYTHON=0 skips it)
#      and, with WITH_NVRTC12=1, NVRTC 12 (the GPU machine's own NVRTC 13 is used anyway; with
#      NVRTC 12 the bundle is 59 MB and does not fit the device tool's 64 MiB beside the
#      repository: session 35 carried it separately, see docs/architecture.md, "GPU tensors").
#   2. On the GPU machine, in a copy of the repo root (tests/python is read from it):
#        RESULTS_DIR=$OUT tools/gpu-check.sh run [BUNDLE | BUNDLE.tar.xz]
#      (with the device tool: carry ["target/gpu-bundle.tar.xz"], timeout_s 540)
#      -> RESULTS_DIR (default ./gpu-results): summary.txt, env.txt, all.log.
#      BUDGET_S (default 450) bounds the whole run; each step has its own cap within it. The
#      steps run most needed first (device tests, Python test, bench, NVRTC 12 last), so a short
#      budget drops the expendable ones; SKIP_STEPS="name ..." skips steps by name.
#
# `run` sets HIVEMESH_GPU_REQUIRED=1 and HIVEMESH_NVRTC_REQUIRED=1, so a skipped GPU test is a
# failure. Its exit status is 0 only if every step passed.
set -uo pipefail

die() {
  echo "gpu-check: $*" >&2
  exit 1
}

# ------------------------------------------------------------------------------------------
prepare() {
  local b=${1:-target/gpu-bundle}
  command -v cargo >/dev/null || die "prepare needs cargo (run it on the build machine)"
  [[ -f Cargo.toml && -d src/cuda ]] || die "run prepare in the hivemesh repo root"
  [[ -n $b && $b != . && $b != / ]] || die "bad bundle directory '$b'"
  rm -rf "$b" "$b.tar.xz" && mkdir -p "$b/bin" "$b/nvrtc12" "$b/wheels" || exit 1
  export CARGO_TERM_COLOR=never
  # The bench: release. The tests: the dev profile, as the README runs them (its build cache
  # is reused; the debug info is stripped below).
  cargo build --release --locked --features cuda --bin hivemesh || die "cargo build failed"
  cargo test --locked --features cuda --no-run --lib --test cuda \
    --message-format=json >"$b/cargo-test.json" || die "cargo test --no-run failed"
  python3 - "$b/cargo-test.json" "$b/bin" <<'PY' || die "test executables not found"
import json, shutil, sys
found = {}
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable") or not m["profile"]["test"]:
        continue
    kind, name = m["target"]["kind"], m["target"]["name"]
    if "lib" in kind and name == "hivemesh":
        found["lib-tests"] = m["executable"]      # unittests src/lib.rs (cuda::, ...)
    elif kind == ["test"] and name == "cuda":
        found["cuda-tests"] = m["executable"]     # tests/cuda.rs
for k, p in found.items():
    shutil.copy2(p, f"{sys.argv[2]}/{k}")
    print(f"{k} <- {p}")
sys.exit(0 if len(found) == 2 else 1)
PY
  rm -f "$b/cargo-test.json"
  cp target/release/hivemesh "$b/bin/hivemesh"
  # Keep the symbol table (names in backtraces), drop DWARF.
  strip --strip-debug "$b"/bin/*
  if [[ ${WITH_NVRTC12:-0} == 1 ]]; then
    # NVRTC 12 beside the GPU machine's NVRTC 13: the kernels are tested with both.
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$b/wheels" nvidia-cuda-nvrtc-cu12 || die "pip download of NVRTC 12 failed"
    python3 - "$b" <<'PY' || die "NVRTC extraction failed"
import glob, os, sys, zipfile
b = sys.argv[1]
whl = glob.glob(f"{b}/wheels/nvidia_cuda_nvrtc_cu12-*.whl")[0]
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        base = os.path.basename(n)
        if base == "libnvrtc.so.12" or (base.startswith("libnvrtc-builtins.so.12") and ".alt." not in base):
            with open(f"{b}/nvrtc12/{base}", "wb") as f:
                f.write(z.read(n))
os.remove(whl)   # only the two files above are needed
PY
  fi
  if [[ ${WITH_PYTHON:-1} == 1 ]]; then
    local venv=target/gpu-maturin-venv
    { [[ -x $venv/bin/maturin ]] || { python3 -m venv "$venv" && "$venv/bin/pip" install -q 'maturin>=1.9,<2'; }; } &&
      "$venv/bin/maturin" build --release --features cuda --compatibility linux --strip \
        --out "$b/wheels" || die "maturin build failed"
  fi
  {
    echo "built on: $(ldd --version | head -1), $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
    for f in "$b"/bin/*; do
      echo "$(basename "$f") needs $(objdump -T "$f" | grep -o 'GLIBC_[0-9.]*' | sort -Vu | tail -1)"
    done
    ls "$b/nvrtc12" "$b/wheels"
  } | tee "$b/BUILDINFO"
  tar -C "$b" -cf - . | xz -T0 -6 >"$b.tar.xz" || die "packing failed"
  du -ab "$b" | sort -n | tail -8
  ls -l "$b.tar.xz"
  local size
  size=$(stat -c %s "$b.tar.xz")
  ((size < 56 * 1024 * 1024)) ||
    echo "gpu-check: WARNING: $b.tar.xz is $((size >> 20)) MiB; the device tool carries 64 MiB with the repo (leave WITH_NVRTC12 unset: 28 MB)" >&2
}

# ------------------------------------------------------------------------------------------
# The GPU machine's own NVRTC for the driver's major version (a toolkit's, or a pip wheel's).
find_nvrtc() {
  local major=$1 p
  for p in $(ldconfig -p 2>/dev/null | awk -v m="libnvrtc.so.$major" '$1 == m {print $NF}') \
    /usr/local/cuda/lib64/libnvrtc.so."$major" /usr/local/cuda-*/lib64/libnvrtc.so."$major" \
    /usr/local/cuda/targets/x86_64-linux/lib/libnvrtc.so."$major"; do
    [[ -e $p ]] && { echo "$p"; return 0; }
  done
  python3 - "$major" 2>/dev/null <<'PY'
import glob, os, site, sys
for d in site.getsitepackages():
    for p in sorted(glob.glob(os.path.join(d, "nvidia", "**", f"libnvrtc.so.{sys.argv[1]}"), recursive=True)):
        print(p)
        sys.exit(0)
sys.exit(1)
PY
}

run() {
  local src=${1:-target/gpu-bundle}
  local t_start=$SECONDS budget=${BUDGET_S:-450}
  local res=${RESULTS_DIR:-$PWD/gpu-results}
  local logs=/tmp/hm-logs
  rm -rf "$logs"
  mkdir -p "$res" "$logs" || exit 1
  : >"$res/summary.txt"
  : >"$res/all.log"
  log() { echo "$*" | tee -a "$res/summary.txt"; }
  left() { echo $((budget - (SECONDS - t_start))); }
  local failed=0
  # step NAME CAP CMD...: runs CMD under min(CAP, time left - 15 s); its log goes to all.log.
  step() {
    local name=$1 cap=$2
    shift 2
    if [[ " ${SKIP_STEPS:-} " == *" $name "* ]]; then
      log "SKIPPED  $name (SKIP_STEPS)"
      return 0
    fi
    local lim=$(($(left) - 15))
    ((lim > cap)) && lim=$cap
    if ((lim < 20)); then
      log "SKIP     $name (time budget spent)"
      failed=1
      return 1
    fi
    local t0=$SECONDS rc st
    timeout -k 10 "$lim" "$@" >"$logs/$name.log" 2>&1
    rc=$?
    case $rc in
      0) st=PASS ;;
      124 | 137) st="TIMEOUT>${lim}s"; failed=1 ;;
      *) st="FAIL(rc=$rc)"; failed=1 ;;
    esac
    log "$(printf '%-14s %-22s %4d s' "$st" "$name" $((SECONDS - t0)))"
    ((rc == 0)) || grep -hE -A1 'panicked at|^Error|error:' "$logs/$name.log" | grep -vE '^(--|note:)' |
      sort -u | head -4 | sed 's/^/    /' | tee -a "$res/summary.txt"
    { echo "===== $name: $* -> rc=$rc"; cat "$logs/$name.log"; } >>"$res/all.log"
    return $rc
  }

  # --- the bundle -------------------------------------------------------------------------
  local B=$src
  if [[ -f $src && $src == *.tar.xz ]]; then
    B=/tmp/hm-bundle
    rm -rf "$B"
    mkdir -p "$B" && tar -C "$B" -xJf "$src" || die "unpacking $src"
  fi
  for f in hivemesh lib-tests cuda-tests; do
    [[ -x $B/bin/$f ]] || die "$B/bin/$f missing: run 'tools/gpu-check.sh prepare' on a build machine"
  done

  # --- environment ------------------------------------------------------------------------
  {
    echo "date: $(date -u +%FT%TZ)  host: $(uname -srm)  $(ldd --version 2>&1 | head -1)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>&1
    echo "--- ldconfig: libcuda / libnvrtc"
    ldconfig -p | grep -E 'libcuda\.so|libnvrtc' || echo "(none in the cache)"
    echo "--- LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
    [[ -f $B/BUILDINFO ]] && { echo "--- BUILDINFO"; cat "$B/BUILDINFO"; }
  } >"$res/env.txt" 2>&1
  cat "$res/env.txt"
  "$B/bin/hivemesh" --version >/dev/null 2>"$logs/load.err" ||
    die "the prebuilt binaries do not start here: $(head -3 "$logs/load.err") (build on a glibc <= this one's)"

  # libcuda: the driver's, never a toolkit's stub (cudarc tries libcuda.so before libcuda.so.1;
  # a stub fails cuInit with CUDA_ERROR_STUB_LIBRARY, which the tests report as a failure).
  local p ld=""
  local -a parts
  IFS=: read -r -a parts <<<"${LD_LIBRARY_PATH:-}"
  for p in "${parts[@]}"; do [[ -n $p && $p != *stubs* ]] && ld+="${ld:+:}$p"; done
  if ! ldconfig -p | grep -q 'libcuda\.so\.1 '; then
    for p in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu /usr/lib64; do
      [[ -e $p/libcuda.so.1 ]] && { ld="$p${ld:+:$ld}"; break; }
    done
  fi
  export LD_LIBRARY_PATH=$ld
  unset HIVEMESH_PERF_CTL HIVEMESH_NVRTC
  export HIVEMESH_GPU_REQUIRED=1 HIVEMESH_NVRTC_REQUIRED=1 RUST_BACKTRACE=1

  # NVRTC: hivemesh picks the driver's major version first (libnvrtc.so.13 beside driver 580).
  # The machine's own goes on the path, so the default choice is what is tested first.
  local driver_major nv_own="" nv12=""
  driver_major=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
  case ${driver_major%%.*} in
    5[8-9][0-9] | 6[0-9][0-9]) driver_major=13 ;;
    *) driver_major=12 ;;
  esac
  nv_own=$(find_nvrtc "$driver_major") || nv_own=$(find_nvrtc 12) || nv_own=""
  if [[ -n $nv_own ]]; then
    export LD_LIBRARY_PATH="$(dirname "$(readlink -f "$nv_own")")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    log "NVRTC here: $nv_own"
  fi
  if [[ -f $B/nvrtc12/libnvrtc.so.12 ]]; then
    nv12=$B/nvrtc12/libnvrtc.so.12
  fi
  [[ -n $nv_own || -n $nv12 ]] || die "no NVRTC here and none carried (prepare with WITH_NVRTC12=1)"
  if [[ -z $nv_own ]]; then
    export HIVEMESH_NVRTC=$nv12 LD_LIBRARY_PATH="$B/nvrtc12:$LD_LIBRARY_PATH"
    log "no NVRTC of the machine's found: using the bundle's NVRTC 12 throughout"
  fi

  # --- 1. which libraries the process loads, and the device smoke test ---------------------
  step probe 60 env LD_DEBUG=libs "$B/bin/cuda-tests" --exact device_tensors_round_trip_through_the_host --nocapture
  grep -E 'calling init: .*(libcuda|libnvrtc)' "$logs/probe.log" | sed 's/^[[:space:]]*[0-9]*:[[:space:]]*//' | sort -u |
    sed 's/^/  loaded: /' | tee -a "$res/summary.txt"
  grep -E 'round_trip: CudaDevice' "$logs/probe.log" | head -1 | sed 's/^/  /' | tee -a "$res/summary.txt"

  # --- 2. the Rust tests of the GPU path (a skip fails them here) --------------------------
  step lib-cuda-tests 120 "$B/bin/lib-tests" cuda:: averager::devices tensor::dlpack --nocapture
  step cuda-integration 240 "$B/bin/cuda-tests" --nocapture
  # --- 3. the Python CUDA tests (the bundle's wheel, the machine's CUDA torch) -------------
  local whl
  whl=$(ls "$B"/wheels/hivemesh-*.whl 2>/dev/null | head -1)
  if [[ -n $whl && -d tests/python ]]; then
    rm -rf /tmp/hm-site && python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall("/tmp/hm-site")' "$whl"
    step python-cuda 120 env PYTHONPATH=/tmp/hm-site PYTHONUNBUFFERED=1 python3 -m pytest -q -p no:cacheprovider \
      tests/python/test_cuda_training.py \
      "tests/python/test_averaging.py::test_cuda_tensors_average_on_the_device" -rs
  else
    log "FAIL     python-cuda (no hivemesh wheel in the bundle or no tests/python here)"
    failed=1
  fi

  # --- 4. the bench: host tensors beside device tensors ------------------------------------
  local args=(bench allreduce --peers 4 --mib 64 --rounds 3)
  step bench-cpu 60 "$B/bin/hivemesh" "${args[@]}" --device cpu
  step bench-cuda 60 "$B/bin/hivemesh" "${args[@]}" --device cuda
  step bench-cpu-f16 60 "$B/bin/hivemesh" "${args[@]}" --device cpu --compression float16
  step bench-cuda-f16 60 "$B/bin/hivemesh" "${args[@]}" --device cuda --compression float16

  # --- 5. NVRTC 12's kernels (last: the most expendable when time is short)
  if [[ -n $nv12 && -n $nv_own ]]; then
    # The same kernels from NVRTC 12 (what CI compiles with): compile for every target, and
    # the bit-exact snapshot/apply test on the device.
    step nvrtc12 90 env HIVEMESH_NVRTC="$nv12" LD_LIBRARY_PATH="$B/nvrtc12:$LD_LIBRARY_PATH" \
      "$B/bin/lib-tests" cuda::staging --nocapture
    step nvrtc12-compile 60 env HIVEMESH_NVRTC="$nv12" LD_LIBRARY_PATH="$B/nvrtc12:$LD_LIBRARY_PATH" \
      "$B/bin/cuda-tests" --exact kernels_compile_for_every_architecture_we_target --nocapture
  fi

  # --- report -------------------------------------------------------------------------------
  {
    echo "--- test results"
    for n in probe lib-cuda-tests cuda-integration nvrtc12 nvrtc12-compile; do
      [[ -f $logs/$n.log ]] && grep -E '^test result:' "$logs/$n.log" | sed "s/^/  $n: /"
    done
    [[ -f $logs/python-cuda.log ]] && grep -E '[0-9]+ (passed|failed|skipped|error)' "$logs/python-cuda.log" | tail -1 | sed 's/^/  python-cuda: /'
    grep -hE 'NVRTC [0-9]+\.[0-9]+' "$logs"/*.log 2>/dev/null | sort -u | head -6 | sed 's/^/  /'
    grep -hE '^(failures:|---- .* ----$)|panicked at|skipped' "$logs"/*.log 2>/dev/null | sort -u | head -40 | sed 's/^/  /'
    echo "--- bench (median of 3 timed rounds; staging/blocked/apply from the device runs)"
    for n in bench-cpu bench-cuda bench-cpu-f16 bench-cuda-f16; do
      [[ -f $logs/$n.log ]] && grep -E '^hivemesh(_device)? ' "$logs/$n.log" | sed "s/^/  $n: /"
    done
    nvidia-smi --query-gpu=name,memory.used,temperature.gpu --format=csv,noheader 2>&1 | sed 's/^/  after: /'
    echo "total $((SECONDS - t_start)) s; $( ((failed)) && echo 'SOMETHING FAILED' || echo 'all passed')"
  } | tee -a "$res/summary.txt"
  return $failed
}

case ${1:-} in
  prepare) shift; prepare "$@" ;;
  run) shift; run "$@" ;;
  *) die "usage: $0 prepare [BUNDLE] | run [BUNDLE | BUNDLE.tar.xz]" ;;
esac
