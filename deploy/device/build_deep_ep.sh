#!/usr/bin/env bash
# Build DeepEP (github.com/deepseek-ai/DeepEP, MIT) on a GPU device machine and install it for d9d's
# `expert_backend: deep_ep`. Run from the repository root; nothing is downloaded (the device machines reach
# no network), so the source comes carried in `.deep_ep_src/` (git-ignored; how to prepare it:
# docs/parallelism.md, "DeepEP").
#
#   bash deploy/device/build_deep_ep.sh [TARGET]     # TARGET: install dir, default /tmp/site
#   PYTHONPATH=TARGET:... python3 -c 'import deep_ep'
#
# What it builds, by the source's layout:
# - DeepEP V1 (`deep_ep/buffer.py`, e.g. its last V1 commit 567632d): intranode (NVLink) kernels only,
#   without NVSHMEM. V1's setup.py links NVSHMEM whenever `nvidia.nvshmem` is importable (the image has
#   nvidia-nvshmem-cu13), so the build copy's lookup is pointed at a module that does not exist, and its
#   -rdc=true is dropped (below); DEEP_EP_WITH_NVSHMEM=1 keeps both (internode and low-latency kernels,
#   which d9d does not use).
# - DeepEP V2 (`deep_ep/buffers/legacy.py`, its main branch since 2026-04): always links NVSHMEM and NCCL
#   (found from the nvidia-nvshmem-cu13 and nvidia-nccl-cu13 pip packages, or EP_NVSHMEM_ROOT_DIR /
#   EP_NCCL_ROOT_DIR) and needs its `third-party/fmt` submodule, which `git archive` leaves out.
# Either way: sm_90 only (TORCH_CUDA_ARCH_LIST=9.0, H100/H200), no build isolation, no index.
#
# Environment: DEEP_EP_SRC (default .deep_ep_src), PYTHON (default python3), MAX_JOBS (default nproc),
# DEEP_EP_WHEEL=path: install that wheel instead of building (one a previous run left in $OUT).
# With $OUT set (a device command), the wheel and the build log are copied there.
set -euo pipefail

# NVLink multicast stays off on the shared hosts (NVSHMEM reads its own switch; DeepEP V1/V2 also set
# NVSHMEM_DISABLE_NVLS=1 themselves before an internode init, which d9d never triggers).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

die() {
    echo "build_deep_ep: FAILED: $*" >&2
    exit 1
}

repo=$(pwd)
src=${DEEP_EP_SRC:-.deep_ep_src}
target=${1:-/tmp/site}
py=${PYTHON:-python3}
out=${OUT:-}

verify() {
    # From outside the source tree, so the installed package (not the checkout's `deep_ep/`) is imported.
    (cd / && PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}" "$py" - <<'EOF'
import importlib.metadata

import torch
import deep_ep

try:
    version = importlib.metadata.version("deep_ep")
except importlib.metadata.PackageNotFoundError:
    version = getattr(deep_ep, "__version__", "unknown")
print(
    f"deep_ep import OK: version {version} from {deep_ep.__file__}; topk_idx_t {deep_ep.topk_idx_t}; "
    f"sm90 features {deep_ep.Buffer.is_sm90_compiled()}; torch {torch.__version__} (CUDA {torch.version.cuda})"
)
EOF
    ) || die "the installed deep_ep does not import (see above)"
}

install_wheel() {
    mkdir -p "$target"
    "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$target" "$1" \
        || die "pip could not install $1 into $target"
}

if [ -n "${DEEP_EP_WHEEL:-}" ]; then
    [ -f "$DEEP_EP_WHEEL" ] || die "DEEP_EP_WHEEL=$DEEP_EP_WHEEL is not a file"
    install_wheel "$DEEP_EP_WHEEL"
    verify
    exit 0
fi

[ -f "$src/setup.py" ] || die "no DeepEP source at $src/ (carry it: docs/parallelism.md, \"DeepEP\")"
command -v nvcc >/dev/null || die "nvcc is not on PATH"
"$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
    || die "torch sees no CUDA device here"
"$py" -c 'import setuptools, wheel' || die "setuptools and wheel are needed to build"

build=$(mktemp -d /tmp/deep_ep_build.XXXXXX)
log=$build.log
cp -a "$src/." "$build/"
cd "$build"

export TORCH_CUDA_ARCH_LIST=9.0
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
unset DISABLE_SM90_FEATURES

if [ -f deep_ep/buffer.py ]; then
    layout="V1"
    if [ "${DEEP_EP_WITH_NVSHMEM:-0}" = 1 ]; then
        echo "build_deep_ep: DeepEP V1 with NVSHMEM (nvidia.nvshmem or NVSHMEM_DIR)"
    else
        unset NVSHMEM_DIR
        lookup='find_spec("nvidia.nvshmem")'
        grep -qF "$lookup" setup.py || die "V1 setup.py has no $lookup to switch NVSHMEM off (another version?)"
        # Only the throw-away build copy changes; the carried source stays as fetched.
        sed -i "s/find_spec(\"nvidia.nvshmem\")/find_spec(\"nvidia.nvshmem_left_out_by_d9d\")/" setup.py
        # V1 compiles with -rdc=true (relocatable device code, for NVSHMEM's device library) but adds the
        # device-link step only with NVSHMEM: without it the extension does not import ("undefined symbol:
        # __cudaRegisterLinkedBinary_..._intranode_cu", DeepEP issue #429). The intranode kernels call no
        # device code of another file, so they are compiled whole instead.
        grep -qF "'-rdc=true', " setup.py || die "V1 setup.py has no '-rdc=true' flag to drop (another version?)"
        sed -i "s/'-rdc=true', //" setup.py
        # V1's last commit calls three low-latency mask-buffer kernels (internode_ll.cu, built only with
        # NVSHMEM) outside its DISABLE_NVSHMEM guards, so the extension failed to import ("undefined
        # symbol: ...internode_ll18update_mask_buffer..."). Guard those calls like the file's others; the
        # methods keep their host asserts (a mask buffer exists only in low-latency shrink mode).
        perl -0pi -e 's/(\n[ \t]*internode_ll::(?:update|query|clean)_mask_buffer\(.*?\);)/\n#ifndef DISABLE_NVSHMEM$1\n#endif/gs' \
            csrc/deep_ep.cpp
        guarded=$(grep -c "^#ifndef DISABLE_NVSHMEM" csrc/deep_ep.cpp)
        echo "build_deep_ep: csrc/deep_ep.cpp has $guarded DISABLE_NVSHMEM guards"
        echo "build_deep_ep: DeepEP V1, intranode kernels only (NVSHMEM left out, no -rdc)"
    fi
elif [ -f deep_ep/buffers/legacy.py ]; then
    layout="V2"
    [ -f third-party/fmt/include/fmt/format.h ] || die "V2 needs its fmt submodule in $src/third-party/fmt \
(git archive leaves submodules out: docs/parallelism.md, \"DeepEP\")"
    [ -d /usr/local/cuda/include/cccl ] || echo "build_deep_ep: warning: /usr/local/cuda/include/cccl is missing"
    # Its README asks for NCCL >= 2.30.4 (device API); report what torch's NCCL wheel is.
    "$py" - <<'EOF' || true
import glob, os, re
import nvidia.nccl as nccl

root = list(nccl.__path__)[0]
header = open(os.path.join(root, "include", "nccl.h")).read()
version = ".".join(re.search(rf"#define NCCL_{k}\s+(\d+)", header).group(1) for k in ("MAJOR", "MINOR", "PATCH"))
print(f"build_deep_ep: NCCL headers {version} at {root} (DeepEP V2 asks for >= 2.30.4)")
EOF
    echo "build_deep_ep: DeepEP V2, linked with NVSHMEM and NCCL from the pip packages"
else
    die "$src/ is neither DeepEP V1 (deep_ep/buffer.py) nor V2 (deep_ep/buffers/legacy.py)"
fi

echo "build_deep_ep: building in $build (log $log; MAX_JOBS=$MAX_JOBS, TORCH_CUDA_ARCH_LIST=9.0;" \
    "$(nvcc --version | tail -n 1); torch $("$py" -c 'import torch; print(torch.__version__)'))"
start=$(date +%s)
if ! "$py" -m pip wheel -v --no-build-isolation --no-deps --no-index -w "$build/dist-wheel" . >"$log" 2>&1; then
    tail -n 60 "$log" >&2
    [ -n "$out" ] && cp "$log" "$out/deep_ep_build.log"
    die "DeepEP $layout build failed after $(($(date +%s) - start)) s (last lines above; full log $log)"
fi
wheel=$(ls "$build"/dist-wheel/deep_ep-*.whl 2>/dev/null | head -n 1)
[ -n "$wheel" ] || die "the build produced no deep_ep wheel (log $log)"
echo "build_deep_ep: built $(basename "$wheel") in $(($(date +%s) - start)) s"
grep -E "> (Sources|Arch list|NVSHMEM path|NCCL path):" "$log" || true
if [ -n "$out" ]; then
    cp "$wheel" "$log" "$out/"
fi

cd "$repo"
install_wheel "$wheel"
verify
