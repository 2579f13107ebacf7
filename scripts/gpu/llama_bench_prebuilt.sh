#!/usr/bin/env bash
# llama-bench built on the CPU machine and carried to the GPU machine in parts, so that a side-by-side run
# (scripts/gpu/side_by_side.sh) spends no device time on the 8-minute build. The build is the bench folder's
# (../shared/llamacpp-bench, copied to ./.llamacpp-bench): its source tarball and device_cmd.sh's cmake flags.
# A device call carries at most 64 MiB with the checkout (about 47 MB of it: 20 MB parts no longer fit beside it),
# so the packed bin/ folder (68 MB of llama-bench, libllama and the ggml libraries; the CUDA one is 93 MB unpacked)
# goes in 15 MB parts, one a call, on one machine held warm (call again within its idle release).
#
#   build   (CPU machine, about 60 min with -j 2) build llama-bench with CUDA for sm_90, pack bin/ as tar.xz and
#           split it into .llamacpp-bench/prebuilt-partNN (ignored) with its sha256 in .llamacpp-bench/prebuilt.sha256.
#           Where this machine's CUDA toolkit lacks cuBLAS or the driver library, it takes cuBLAS's headers and
#           libraries from the nvidia-cublas wheel (pip download) and links against a stub libcuda.so of the driver
#           calls ggml-cuda makes, both put into the toolkit's folders; the GPU machine's own are used at run time.
#   stash   (GPU machine) copy the parts this call carried to $STASH (/tmp/llama-bench-parts), which outlives the
#           call on a machine held warm.
#   unpack  (GPU machine) stash, check the joined parts against the sha256, unpack into
#           $SBS_WORK/bee/build-prebuilt/bin (where side_by_side.sh looks for a built llama-bench) and run
#           `llama-bench --help` there; exit 1 when it does not run (then build on the machine: side_by_side.sh build).
#
# A checkout without the demo model's weights (38.7 MB of the 47; a local branch that deletes them, for the device
# calls alone: side_by_side.sh does not use them) takes two calls instead of five: `stash` carrying parts 00-02 with
# the bench folder's files (about 56 MB in all; side_by_side.sh's files and flashdraft phases can run in the same
# call), then `unpack` carrying parts 03-04, prebuilt.sha256 and the bench folder's files again.
# Device calls (carry the parts one by one, then the bench folder's files with the last):
#     bash scripts/gpu/llama_bench_prebuilt.sh stash        carry [".llamacpp-bench/prebuilt-part00"], then 01-03
#     bash scripts/gpu/llama_bench_prebuilt.sh unpack && bash scripts/gpu/side_by_side.sh
#         carry [".llamacpp-bench/prebuilt-part04", ".llamacpp-bench/prebuilt.sha256",
#                ".llamacpp-bench/beellama-src.tar.gz", ".llamacpp-bench/make_gguf.py", ".llamacpp-bench/device_cmd.sh"]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BENCH="${SBS_BENCH:-$ROOT/.llamacpp-bench}"
STASH="${STASH:-/tmp/llama-bench-parts}"
PART_BYTES=15000000

build() {
  local work="${BUILD_WORK:-/tmp/llama-bench-cpu}" cuda
  cuda="$(readlink -f "${CUDA_HOME:-/usr/local/cuda}")"  # the toolkit (nvcc may be a wrapper script elsewhere)
  [ -x "$cuda/bin/nvcc" ] || { echo "no CUDA toolkit at $cuda: set CUDA_HOME" >&2; exit 2; }
  mkdir -p "$work"
  [ -f "$work/beellama/CMakeLists.txt" ] || tar -xzf "$BENCH/beellama-src.tar.gz" -C "$work"
  if [ ! -e "$cuda/lib64/libcublas.so" ]; then  # cuBLAS from its wheel into the toolkit
    pip download -q --no-deps -d "$work/wheels" "nvidia-cublas>=13,<14" --python-version 3.12 --only-binary=:all: \
      --platform manylinux_2_27_x86_64
    (cd "$work/wheels" && rm -rf x && mkdir x && cd x && unzip -q ../nvidia_cublas-*.whl)
    cp "$work"/wheels/x/nvidia/cu*/include/*.h "$cuda/include/"
    cp "$work"/wheels/x/nvidia/cu*/lib/*.so.* "$cuda/lib64/"
    (cd "$cuda/lib64" && ln -sf libcublas.so.13 libcublas.so && ln -sf libcublasLt.so.13 libcublasLt.so)
  fi
  if [ ! -e "$cuda/lib64/stubs/libcuda.so" ] && ! ldconfig -p | grep -q "libcuda.so.1"; then
    # a link-time stand-in for the driver library: the driver calls of ggml-cuda's sources, found by name
    mkdir -p "$cuda/lib64/stubs"
    grep -rhoE "\bcu[A-Z][A-Za-z0-9_]+\s*\(" "$work/beellama/ggml/src/ggml-cuda" | sed 's/\s*(//' | sort -u \
      | grep -vE "^cu(da|blas|Check|bGet|rand)" | sed 's/.*/int &(void) { return 0; }/' > "$work/cuda_stub.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$cuda/lib64/stubs/libcuda.so" "$work/cuda_stub.c"
  fi
  if [ ! -f "$work/build/build.ninja" ]; then  # device_cmd.sh's flags
    cmake -S "$work/beellama" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
      -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DLLAMA_BUILD_SERVER=OFF -DLLAMA_OPENSSL=OFF > "$work/configure.log"
  fi
  nice -n 15 cmake --build "$work/build" --target llama-bench -j "${JOBS:-2}"
  (cd "$work/build/bin" && tar -cJf "$work/prebuilt.tar.xz" --owner=0 --group=0 llama-bench lib*.so*)
  rm -f "$BENCH"/prebuilt-part*
  split -b $PART_BYTES -d "$work/prebuilt.tar.xz" "$BENCH/prebuilt-part"
  (cd "$work" && sha256sum prebuilt.tar.xz | cut -d' ' -f1) > "$BENCH/prebuilt.sha256"
  ls -l "$BENCH"/prebuilt-part* "$BENCH/prebuilt.sha256"
}

stash() {
  mkdir -p "$STASH"
  local part found=0
  for part in "$BENCH"/prebuilt-part*; do [ -f "$part" ] && cp -f "$part" "$STASH/" && found=1; done
  [ $found = 1 ] || { echo "no .llamacpp-bench/prebuilt-part* in this checkout: carry one" >&2; exit 2; }
  ls -l "$STASH"
}

unpack() {
  stash
  local bin="${SBS_WORK:-/tmp/sbs-work}/bee/build-prebuilt/bin" sum
  sum=$(cat "$STASH"/prebuilt-part* | sha256sum | cut -d' ' -f1)
  [ "$sum" = "$(cat "$BENCH/prebuilt.sha256")" ] || { echo "the parts do not join to the packed build: $sum" >&2; exit 1; }
  rm -rf "$bin" && mkdir -p "$bin"
  cat "$STASH"/prebuilt-part* | tar -xJf - -C "$bin"
  if ! LD_LIBRARY_PATH="$(cublas_dir):$bin:${LD_LIBRARY_PATH:-}" "$bin/llama-bench" --help > "$bin/help.log" 2>&1; then
    tail -5 "$bin/help.log" >&2; rm -rf "$bin"; echo "the carried llama-bench does not run here" >&2; exit 1
  fi
  echo "llama-bench unpacked into $bin and runs"
}

cublas_dir() {  # the folder of this machine's cuBLAS (a CUDA toolkit's or a wheel's)
  dirname "$(find /usr/local /usr/lib /opt -name 'libcublas.so.1[0-9]' 2> /dev/null | head -1)"
}

case "${1:-}" in
  build) build ;;
  stash) stash ;;
  unpack) unpack ;;
  cublas-dir) cublas_dir ;;  # for side_by_side.sh: a carried build finds its libraries with LD_LIBRARY_PATH
  *) echo "usage: $0 build|stash|unpack|cublas-dir" >&2; exit 2 ;;
esac
