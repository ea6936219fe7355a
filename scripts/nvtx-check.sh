#!/usr/bin/env bash
# Checks Erase's NVTX ranges and names under NVIDIA's profilers, from a bundle made by
# scripts/gpu-bundle.sh (erase-ctr in the bundle folder):
#   0. a bad NVTX_INJECTION64_PATH: one warning, and training still runs;
#   1. ncu --nvtx --nvtx-include "bwd:cross/": kernels are profiled inside that range;
#   2. nsys profile --trace=cuda,nvtx, then nsys stats's NVTX summary (the importer may
#      fail on this machine for want of libdw.so.1: reported, not fatal).
# Writes logs to $OUT (default <bundle>/out) and prints a short table last.
#   bash nvtx-check.sh [BUNDLE]
# For step 2 on a machine whose nsys importer lacks libdw.so.1, put Debian's packages in
# BUNDLE/debs first (on any Debian/Ubuntu amd64 machine: apt-get download libdw1 libelf1).
set -u
bundle="$(cd "${1:-$(dirname "$0")}" && pwd)"
out="${OUT:-$bundle/out}"
mkdir -p "$out"
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:/usr/local/cuda/lib64"
exe="$bundle/erase-ctr"
run=(train --device cuda --preset small --steps 5 --eval-every 0 --dispatch blocking)
summary=()
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"

# 0. a library that does not load leaves NVTX off with one warning
NVTX_INJECTION64_PATH=/nonexistent/libNoTool.so timeout 120 "$exe" "${run[@]}" \
  >"$out/nvtx-badpath.log" 2>&1
rc=$?
warns=$(grep -c 'warning: NVTX is off' "$out/nvtx-badpath.log")
grep 'warning: NVTX' "$out/nvtx-badpath.log" | head -3
summary+=("bad NVTX_INJECTION64_PATH: rc $rc (want 0), $warns warning line(s) (want 1)")

# 1. Nsight Compute: only kernels issued inside a bwd:cross range
if command -v ncu >/dev/null; then
  timeout 300 ncu --nvtx --nvtx-include "bwd:cross/" --launch-count 3 \
    --metrics gpu__time_duration.sum "$exe" "${run[@]}" >"$out/ncu-nvtx.log" 2>&1
  rc=$?
  profiled=$(grep -c '==PROF== Profiling' "$out/ncu-nvtx.log")
  grep -E '==PROF==|==WARNING==|==ERROR==' "$out/ncu-nvtx.log" | head -12
  grep -E 'gpu__time_duration.sum' "$out/ncu-nvtx.log" | head -3
  echo "kernels profiled inside bwd:cross: $profiled"
  summary+=("ncu --nvtx-include bwd:cross/: rc $rc, $profiled kernel(s) profiled (want 3)")
else
  summary+=("ncu: not found")
fi

# 2. Nsight Systems: record, then the NVTX summary. nsys may live off PATH (inside an
# Nsight Compute install, say); NSYS names it. Its importer needs libdw.so.1: where the
# bundle has a debs/ folder (Debian's libdw1 and libelf1), they are unpacked into the
# bundle and put on the library path.
nsys="${NSYS:-$(command -v nsys || ls /opt/nvidia/nsight-systems*/*/bin/nsys /opt/nvidia/nsight-compute/*/host/*/nsys 2>/dev/null | head -1)}"
if [ -d "$bundle/debs" ] && command -v dpkg >/dev/null; then
  mkdir -p "$bundle/libdw"
  for f in "$bundle"/debs/*.deb; do dpkg -x "$f" "$bundle/libdw"; done
  export LD_LIBRARY_PATH="$bundle/libdw/usr/lib/x86_64-linux-gnu:$LD_LIBRARY_PATH"
fi

if [ -n "$nsys" ] && [ -x "$nsys" ]; then
  echo "nsys: $nsys"
  rm -f "$out/erase.nsys-rep" "$out/erase.qdstrm" "$out/erase.sqlite"
  timeout 300 "$nsys" profile --trace=cuda,nvtx --force-overwrite true -o "$out/erase" \
    "$exe" "${run[@]}" >"$out/nsys-profile.log" 2>&1
  rc=$?
  tail -5 "$out/nsys-profile.log"
  ls -la "$out"/erase.* 2>/dev/null
  summary+=("nsys profile: rc $rc; $(ls "$out"/erase.* 2>/dev/null | xargs -n1 basename 2>/dev/null | tr '\n' ' ')")
  if [ -f "$out/erase.nsys-rep" ]; then
    timeout 300 "$nsys" stats --report nvtx_sum "$out/erase.nsys-rep" >"$out/nsys-nvtx-sum.log" 2>&1
    rc=$?
    head -40 "$out/nsys-nvtx-sum.log"
    ranges=$(grep -cE 'step [0-9]+|fwd:|bwd:|optim' "$out/nsys-nvtx-sum.log")
    summary+=("nsys stats nvtx_sum: rc $rc, $ranges line(s) naming step/fwd/bwd/optim ranges")
    # the names given by NameOsThreadA and NameCuStreamA land in the exported strings
    if [ -f "$out/erase.sqlite" ] && python3 -c 'import sqlite3' 2>/dev/null; then
      python3 - "$out/erase.sqlite" <<'EOF' | tee "$out/nsys-names.log"
import sqlite3, sys
db = sqlite3.connect(sys.argv[1])
try:
    strings = {r[0] for r in db.execute("select value from StringIds")}
except sqlite3.Error as e:
    print(f"no StringIds table: {e}")
    sys.exit(0)
try:
    strings |= {r[0] for r in db.execute("select distinct text from NVTX_EVENTS where text is not null")}
except sqlite3.Error:
    pass
for name in ["erase-main", "erase-loader", "main", "side1", "copy", "bwd:cross", "step 1"]:
    print(f"  string {name!r}: {'found' if name in strings else 'missing'}")
EOF
      summary+=("nsys names: $(grep -c found "$out/nsys-names.log" 2>/dev/null) found, $(grep -c missing "$out/nsys-names.log" 2>/dev/null) missing (see nsys-names.log)")
    fi
  else
    summary+=("nsys stats: no .nsys-rep to read (importer failed? see nsys-profile.log)")
  fi
else
  summary+=("nsys: not found")
fi

echo
echo "== summary =="
for s in "${summary[@]}"; do echo "  $s"; done
