#!/usr/bin/env bash
# Put into .whl/ (git-ignored; it travels with the checkout to a GPU machine) the wheels that the
# GPU machine lacks to run scripts/gpu_check.sh: it has Python 3.12 with CUDA torch and no network,
# and no DeepSpeed. Run here, where PyPI is reachable:
#
#     bash scripts/gpu_wheels.sh            # then carry .whl to the GPU machine
#
# - DeepSpeed (the version installed here, else 0.19.8) is published as an sdist only: it is built
#   here into a pure-Python wheel (DS_BUILD_OPS=0: its C++/CUDA ops, which we do not use, are not
#   built); the wheel's own `Requires-Dist` is checked below.
# - Its dependencies that the GPU image does not have (hjson, pydantic, pydantic-core,
#   annotated-types, typing-inspection) and ours (zstandard), as cp312 manylinux x86_64 wheels, at
#   the versions installed here (the ones the CPU suite runs with).
# Ends with the list of wheels and their total size, which must stay well under the 64 MiB a
# carried folder may have; exits 1 if a Requires-Dist of DeepSpeed is neither in the GPU image nor here.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${GPU_WHEEL_DIR:-.whl}
PYTHON=${PYTHON:-python3}

version_here() {  # the installed version of a distribution, or the fallback given
    "$PYTHON" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: print(sys.argv[2])" "$1" "$2"
}

DEEPSPEED=$(version_here deepspeed 0.19.8)
# name==version: what DeepSpeed needs beyond the GPU image, and zstandard for our .zst input.
PINNED=(
    "hjson==$(version_here hjson 3.1.0)"
    "pydantic==$(version_here pydantic 2.13.4)"
    "pydantic-core==$(version_here pydantic-core 2.46.4)"
    "annotated-types==$(version_here annotated-types 0.7.0)"
    "typing-inspection==$(version_here typing-inspection 0.4.2)"
    "zstandard==$(version_here zstandard 0.25.0)"
)
# What the GPU image has (KINDS.md's package list, names normalised): DeepSpeed's other needs.
IMAGE_HAS="einops msgpack ninja numpy packaging psutil py-cpuinfo torch tqdm typing-extensions nvidia-ml-py"

mkdir -p "$DEST"
rm -f "$DEST"/*.whl
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

echo "gpu_wheels: DeepSpeed $DEEPSPEED from its sdist (DS_BUILD_OPS=0)"
"$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$scratch/sdist" "deepspeed==$DEEPSPEED"
DS_BUILD_OPS=0 DS_BUILD_STRING="" "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation \
    -w "$DEST" "$scratch"/sdist/deepspeed-*.tar.gz

echo "gpu_wheels: ${PINNED[*]} (cp312, manylinux x86_64)"
for platform in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
                manylinux_2_24_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$platform")
done
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none "${platforms[@]}" --platform any -d "$DEST" "${PINNED[@]}"

# Every Requires-Dist of DeepSpeed (extras aside) must be in the image or among these wheels.
"$PYTHON" - "$DEST" "$IMAGE_HAS" <<'EOF'
import glob, re, sys, zipfile
dest, image = sys.argv[1], set(sys.argv[2].split())
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
carried = {norm(p.split("/")[-1].split("-")[0]) for p in glob.glob(f"{dest}/*.whl")}
wheel = glob.glob(f"{dest}/deepspeed-*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
needs = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
needs = [n for n in needs if "extra ==" not in n]
missing = [n for n in needs if norm(re.split(r"[ ;<>=!~\[(]", n)[0]) not in image | carried]
print("gpu_wheels: DeepSpeed needs " + ", ".join(needs))
if missing:
    sys.exit(f"gpu_wheels: error: neither the GPU image nor {dest} has: {', '.join(missing)}")
EOF
find "$DEST" -maxdepth 1 -name '*.whl' -printf '%s %p\n' | sort -k2 |
    awk '{ printf "  %8.1f KiB  %s\n", $1 / 1024, $2; total += $1 }
         END { printf "gpu_wheels: %d wheels, %.1f MiB in all (64 MiB may travel)\n", NR, total / 1048576 }'
