#!/bin/sh
# Checks examples/c/smollm.c against the Rust example examples/smollm, which equals
# candle's quantized Llama when the weights are dequantized (--dequantize):
#
#   1. builds smollm.c with -O2 against the release static library
#      (cargo build --release -p kvpage) and the Rust `generate`;
#   2. tokenizes a text of digits, contractions, runs of spaces, newlines and
#      punctuation, and one of accented letters, CJK, Unicode punctuation, numbers,
#      symbols and emoji, with both: the prompt token ids must be identical;
#   3. generates greedily (64 tokens) for three chat-template prompts with both, two
#      samples each (the second a fork after the first token: the prefix cache, forks,
#      chunked prefill mixed with decode; the C program through kvpage's C API, the Rust
#      one through its Rust API): the prompt ids must be identical, and the six
#      generations are compared token by token.
#
# Both compute in f32 with the same weights, but sum the matrix products in different
# orders (candle's gemm kernels, the C program's 8-way dot product), so logits differ in
# the last bits (about 1e-5) and a greedy choice between two nearly tied tokens can go
# either way, after which the texts diverge. The script prints how many tokens agree
# before the first difference, and fails if a generation agrees on fewer than
# $SMOLLM_MIN_AGREE (default 16) leading tokens, or if any prompt tokenizes differently.
#
#   examples/c/check_smollm.sh [MODEL.gguf]
#
# Exit status 77 (skipped, with a message) when the model file is missing: run
# examples/smollm/fetch-model.sh first (with KVPAGE_REQUIRE_MODEL=1, as in CI: 1, a failure).
set -eu

root=$(cd "$(dirname "$0")/../.." && pwd)
model=${1:-${KVPAGE_MODEL_DIR:-$HOME/.cache/kvpage/smollm2}/SmolLM2-135M-Instruct.Q4_1.gguf}
min_agree=${SMOLLM_MIN_AGREE:-16}
tokens=64

if [ ! -f "$model" ]; then
  if [ "${KVPAGE_REQUIRE_MODEL:-0}" = 1 ]; then
    echo "check_smollm: FAIL: model file $model not found (KVPAGE_REQUIRE_MODEL=1); run examples/smollm/fetch-model.sh" >&2
    exit 1
  fi
  echo "check_smollm: SKIPPED: model file $model not found; run examples/smollm/fetch-model.sh" >&2
  exit 77
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cd "$root"
cargo build --release --locked -p kvpage --lib
lib=${CARGO_TARGET_DIR:-$root/target}/release/libkvpage.a
cc -std=c11 -O2 -Wall -Wextra -Werror -pedantic -I host-std/include -o "$work/smollm_c" \
  examples/c/smollm.c examples/c/smollm/error.c examples/c/smollm/gguf.c \
  examples/c/smollm/quant.c \
  examples/c/smollm/bpe.c examples/c/smollm/llama.c \
  "$lib" -lgcc_s -lutil -lrt -lpthread -lm -ldl
cargo build --release --locked --manifest-path examples/smollm/Cargo.toml --bin generate
rust() { cargo run --quiet --release --locked --manifest-path examples/smollm/Cargo.toml --bin generate -- "$@"; }

# 2. The tokenizer on ASCII text with every kind of piece.
tricky=$(printf "I'm 42 years old, aren't you?  It's 3.14159...\n\nNew  line's END!! (x+y)=z; we'll see--they'd DONE it'S\tok   ")
unicode="Café naïve — “quotes” 日本語です。 ½ x² 🙂👍🏽 ok… ¿Qué? 10€ ٣٤ Ⅻ ① µs × ÷ «§1» → ∑ ≤ ∞"
"$work/smollm_c" "$model" --print-ids --max-tokens 1 --prompt "$tricky" --prompt "$unicode" \
  > "$work/c_tok.txt"
rust "$model" --dequantize --print-ids --max-tokens 1 --prompt "$tricky" --prompt "$unicode" \
  > "$work/rust_tok.txt"
grep '^prompt-ids' "$work/c_tok.txt" > "$work/c_tok_ids.txt"
grep '^prompt-ids' "$work/rust_tok.txt" > "$work/rust_tok_ids.txt"
if ! cmp -s "$work/c_tok_ids.txt" "$work/rust_tok_ids.txt"; then
  echo "check_smollm: FAIL: the tokenizers differ:" >&2
  diff "$work/rust_tok_ids.txt" "$work/c_tok_ids.txt" >&2 || true
  exit 1
fi
echo "tokenizer: identical ids for the ASCII and the Unicode texts ($(cut -d: -f2 "$work/c_tok_ids.txt" | wc -w) tokens)"

# 3. Greedy generation.
set -- --chat-template --max-tokens "$tokens" --samples 2 --print-ids \
  --prompt "What is the capital of France?" \
  --prompt "Write a haiku about memory pages." \
  --prompt "Give me three tips for better sleep."
start=$(date +%s)
"$work/smollm_c" "$model" "$@" > "$work/c.txt"
c_time=$(( $(date +%s) - start ))
start=$(date +%s)
rust "$model" --dequantize "$@" > "$work/rust.txt"
rust_time=$(( $(date +%s) - start ))
echo "--- C (smollm_c, ${c_time} s):"
grep -v '^ids\|^prompt-ids' "$work/c.txt"
echo "--- Rust (generate --dequantize, ${rust_time} s): its table"
sed -n '/^  # sample/,$p' "$work/rust.txt"

grep '^prompt-ids' "$work/c.txt" > "$work/c_prompt.txt"
grep '^prompt-ids' "$work/rust.txt" > "$work/rust_prompt.txt"
if ! cmp -s "$work/c_prompt.txt" "$work/rust_prompt.txt"; then
  echo "check_smollm: FAIL: the chat prompts tokenize differently:" >&2
  diff "$work/rust_prompt.txt" "$work/c_prompt.txt" >&2 || true
  exit 1
fi

status=0
for key in "0 0" "1 0" "2 0" "0 1" "1 1" "2 1"; do
  c_ids=$(grep "^ids $key:" "$work/c.txt" | cut -d: -f2)
  r_ids=$(grep "^ids $key:" "$work/rust.txt" | cut -d: -f2)
  set -- $r_ids
  agree=0
  total=$#
  for id in $c_ids; do
    [ $# -gt 0 ] && [ "$id" = "$1" ] || break
    agree=$((agree + 1))
    shift
  done
  c_total=$(echo $c_ids | wc -w)
  if [ "$agree" -eq "$total" ] && [ "$agree" -eq "$c_total" ]; then
    echo "prompt ${key%% *} sample ${key##* }: identical, $agree tokens"
  else
    echo "prompt ${key%% *} sample ${key##* }: $agree of $total (Rust) / $c_total (C) tokens agree before the first difference"
    if [ "$agree" -lt "$min_agree" ]; then status=1; fi
  fi
done
if [ "$status" -ne 0 ]; then
  echo "check_smollm: FAIL: a generation agrees on fewer than $min_agree leading tokens" >&2
fi
exit $status
