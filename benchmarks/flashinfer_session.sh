#!/usr/bin/env bash
# One GPU machine's session for the FlashInfer backend (issue 21), in two calls that each fit
# the device tool's 10-minute limit; results and logs go under $OUT (r/ holds the JSON).
#   part 1: FlashInfer's JIT build timed (benchmarks/attention_backends.py jit), the GPU tests
#           of the backend, and both backends side by side (attention_backends.py bench)
#   part 2: prefill 8k, offline 1024 x (512 in, 256 out) and batch-1 decode through each backend
#           (benchmarks/gpu.py), the same run
#   part 3: what a second fresh machine had time for: the JIT build, the GPU tests, and the
#           FlashInfer side of part 2
#   part 4 (nineteenth session): the JIT build, the backend's GPU tests with a window at head
#           dim 128 (Mistral-like) among them, then the runtime's children from the fork server
#           on CUDA (their own tests, the engines' CUDA-graph and overlap tests)
# Run from the repository root after `source .whl/install.sh`, the wheels carried as .whl:
#   ../shared/device/wheelhouse.sh .whl flashinfer-python==0.5.3 nvidia-ml-py requests \
#       opentelemetry-api uvloop
# then delete what the image has and must win (sympy, mpmath, networkx, fsspec, jinja2,
# markupsafe, filelock, cuda_bindings, cuda_pathfinder, protobuf): about 27 MB. flashinfer's
# import needs only pynvml (nvidia-ml-py) beyond the image; the installed fastapi needs
# opentelemetry-api (without it the GPU tests fail at collection, seen 2026-12-02).
# A step past its limit is stopped with SIGABRT first (benchmarks/step.sh).
set -u
part=${1:?part 1 to 4}
source "$(dirname "$0")/step.sh"
if [ "$part" = 1 ]; then
    nproc; nvcc --version | tail -1; python -c "import flashinfer; print('flashinfer', flashinfer.__version__)"
    TAIL=12 step 320 jit python benchmarks/attention_backends.py jit --out "$OUT/r/flashinfer_jit_cuda.json"
    TAIL=15 step 150 pytest_fi python -m pytest -q -m gpu tests/kernels/test_flashinfer_backend.py -p no:cacheprovider
    TAIL=20 step 100 bench python benchmarks/attention_backends.py bench --out "$OUT/r/attention_backends_cuda.json"
elif [ "$part" = 2 ]; then
    for b in flashinfer triton; do
        TAIL=6 step 100 "prefill_$b" python benchmarks/gpu.py prefill --attention-backend "$b" --skip-hf --out "$OUT/r/gpu_prefill_$b.json"
    done
    for b in flashinfer triton; do
        TAIL=6 step 130 "offline_$b" python benchmarks/gpu.py offline --attention-backend "$b" --skip-hf --repeats 1 --out "$OUT/r/gpu_offline_$b.json"
    done
    TAIL=6 step 90 decode_flashinfer python benchmarks/gpu.py decode --attention-backend flashinfer --skip-hf --out "$OUT/r/gpu_decode_flashinfer.json"
elif [ "$part" = 4 ]; then
    TAIL=8 step 200 jit python benchmarks/attention_backends.py jit --out "$OUT/r/flashinfer_jit_cuda.json"
    TAIL=15 step 200 pytest_fi python -m pytest -q -m gpu tests/kernels/test_flashinfer_backend.py -p no:cacheprovider -rfE
    TAIL=8 step 150 pytest_children python -m pytest -q -p no:cacheprovider -rfE tests/runtime/test_child_processes.py \
        tests/runtime/test_cuda_graph.py tests/runtime/test_overlap.py
else  # part 3: one call on a fresh machine, after part 1 and 2 showed fa3 stalls
    TAIL=8 step 190 jit python benchmarks/attention_backends.py jit --cached-limit 30 --out "$OUT/r/flashinfer_jit_cuda.json"
    TAIL=15 step 100 pytest_fi python -m pytest -q -m gpu tests/kernels/test_flashinfer_backend.py -p no:cacheprovider --maxfail 5
    TAIL=8 step 105 offline_flashinfer python benchmarks/gpu.py offline --attention-backend flashinfer --skip-hf --repeats 1 --out "$OUT/r/gpu_offline_flashinfer.json"
    TAIL=8 step 70 prefill_flashinfer python benchmarks/gpu.py prefill --attention-backend flashinfer --skip-hf --repeats 2 --out "$OUT/r/gpu_prefill_flashinfer.json"
    TAIL=8 step 55 decode_flashinfer python benchmarks/gpu.py decode --attention-backend flashinfer --skip-hf --repeats 1 --out "$OUT/r/gpu_decode_flashinfer.json"
fi
