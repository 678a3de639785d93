#!/usr/bin/env bash
# build.sh: builds torch_anchor (PyTorch's native caching allocator and
# cudaMallocAsync, measured like `tidalloc micro`) against the PyTorch that
# python3 imports, with the CUDA runtime that PyTorch itself loads, so that
# one runtime serves both anchors. Fails loudly when PyTorch, its CUDA
# libraries or a C++ compiler are missing.
#   bench/gpu/build.sh [OUTDIR]      (default build/bench-gpu)
#   OUTDIR/torch_anchor > anchors.csv
# Environment: CXX (default g++), CUDA_HOME (headers when PyTorch's CUDA
# runtime comes without them; default: where nvcc is, else /usr/local/cuda).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
outdir=${1:-build/bench-gpu}
cxx=${CXX:-g++}

die() {
  printf 'bench/gpu/build.sh: %s\n' "$*" >&2
  exit 1
}

command -v "$cxx" >/dev/null || die "no C++ compiler ($cxx); set CXX"
command -v python3 >/dev/null || die "python3 is not installed"
torch_info=$(python3 - <<'EOF'
import os, sys
try:
    import torch
except Exception as e:  # noqa: BLE001 - any import failure means no torch
    sys.exit(f"PyTorch cannot be imported by python3: {e}")
if not torch.version.cuda:
    sys.exit(f"this PyTorch ({torch.__version__}) is built without CUDA")
print(os.path.dirname(torch.__file__))
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(torch.__version__)
print(torch.version.cuda)
EOF
) || die "PyTorch with CUDA is required (see above)"
{
  read -r torch_dir
  read -r cxx11_abi
  read -r torch_version
  read -r torch_cuda
} <<<"$torch_info"

for lib in libc10.so libc10_cuda.so; do
  [[ -e $torch_dir/lib/$lib ]] || die "$torch_dir/lib/$lib is missing: not a CUDA build of PyTorch?"
done
[[ -e $torch_dir/include/c10/cuda/CUDACachingAllocator.h ]] ||
  die "$torch_dir/include has no c10/cuda/CUDACachingAllocator.h: PyTorch's headers are missing"

cuda_home=${CUDA_HOME:-}
if [[ -z $cuda_home ]] && command -v nvcc >/dev/null; then
  cuda_home=$(dirname "$(dirname "$(command -v nvcc)")")
fi
cuda_home=${cuda_home:-/usr/local/cuda}

# The CUDA runtime that libc10_cuda.so loads (a pip wheel's, or the system's);
# if PyTorch carries it statically, the toolkit's.
cudart=$(ldd "$torch_dir/lib/libc10_cuda.so" | awk '/libcudart/ { print $3; exit }')
if [[ -z $cudart || ! -e $cudart ]]; then
  cudart=$(ls "$cuda_home"/lib64/libcudart.so.[0-9]* "$cuda_home"/lib/libcudart.so.[0-9]* 2>/dev/null | head -1 || true)
  [[ -n $cudart ]] || die "no libcudart: $torch_dir/lib/libc10_cuda.so names none, and $cuda_home has none (set CUDA_HOME)"
  echo "torch_anchor: PyTorch does not load libcudart dynamically; using $cudart" >&2
fi

# Headers of that runtime: the toolkit's when there is one (pip's wheels can
# ship cuda_runtime.h without the crt/ headers it includes), else beside the
# runtime (pip's nvidia/<package>/include, with the other packages' headers).
cuda_inc=$cuda_home/include
extra_inc=()
if [[ ! -e $cuda_inc/crt/host_config.h ]]; then
  cuda_inc=$(dirname "$cudart")/../include
  if [[ $cudart == */nvidia/* ]]; then
    for dir in "$(dirname "$cudart")"/../../*/include; do
      [[ -d $dir ]] && extra_inc+=(-isystem "$dir")
    done
  fi
fi
[[ -e $cuda_inc/cuda_runtime_api.h ]] || die "no cuda_runtime_api.h found (set CUDA_HOME)"

mkdir -p "$outdir"
echo "torch_anchor: PyTorch $torch_version (CUDA $torch_cuda, C++11 ABI $cxx11_abi) at $torch_dir"
echo "torch_anchor: CUDA runtime $cudart, headers $cuda_inc"
built=no
for std in c++17 c++20; do
  if "$cxx" -std=$std -O2 -DNDEBUG -D_GLIBCXX_USE_CXX11_ABI="$cxx11_abi" \
    -isystem "$torch_dir/include" -isystem "$cuda_inc" "${extra_inc[@]}" \
    "$here/torch_anchor.cpp" -o "$outdir/torch_anchor" \
    -L"$torch_dir/lib" -lc10_cuda -lc10 "$cudart" -lpthread \
    -Wl,-rpath,"$torch_dir/lib" -Wl,-rpath,"$(dirname "$cudart")" 2>"$outdir/build-$std.log"; then
    built=yes
    break
  fi
  echo "torch_anchor: -std=$std failed (errors in $outdir/build-$std.log)" >&2
done
if [[ $built != yes ]]; then
  head -40 "$outdir/build-c++17.log" >&2
  die "torch_anchor did not compile (see $outdir/build-*.log)"
fi
echo "torch_anchor: built $outdir/torch_anchor (-std=$std)"
