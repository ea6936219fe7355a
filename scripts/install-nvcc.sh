#!/usr/bin/env bash
# Installs a CUDA 13.0 nvcc from PyPI wheels into .tools/cuda (no GPU, no system CUDA
# needed). Every wheel is pinned: unpinned, pip mixes in a newer NVVM whose PTX a CUDA
# 13.0 driver refuses. build.rs finds this install by itself.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="${1:-$root/.tools/cuda}"
nvcc="$dest/nvidia/cu13/bin/nvcc"
if [ -x "$nvcc" ] && "$nvcc" --version | grep -q "release 13.0"; then
  echo "nvcc already installed: $nvcc"
  exit 0
fi
command -v g++ >/dev/null || { echo "install-nvcc: nvcc needs a host C++ compiler (g++); install it first" >&2; exit 1; }
python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --target "$dest" \
  nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
  nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85
"$nvcc" --version | tail -2
echo "nvcc installed: $nvcc"
