#!/usr/bin/env bash
# The GPU checks and benchmarks of issue 36 in one call on a CUDA machine, stage by stage:
#
#   bash benchmarks/gpu.sh env tests noise clip peers lora recipe kernels
#
# Wheels the machine lacks (dp-accounting, dm-tree, faker, cryptography, opacus, opake, a
# transformers as here) are installed from .whl/ when that folder exists. Logs and JSON go
# to $OUT (default /tmp/llmdp-gpu). Each stage has its own time limit, so one that hangs
# cannot take the others' time.
set -u
OUT=${OUT:-/tmp/llmdp-gpu}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# 1.6 B Llama-style (Llama-3.2-1B shapes, untied 128k vocabulary), bf16.
BIG="--device cuda --dtype bfloat16 --hidden 2048 --layers 16 --heads 32 --intermediate 8192 --vocab 128256 --steps 5"
T1="--seq 1024 --batch 8"
T2="--seq 256 --batch 32"
PEERS=non-private,llmdp-auto,llmdp-book-keeping,llmdp-two-pass,opacus-hooks,opacus-ghost,opake-whole-batch,opake-microbatch

stage_env() {
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
}
stage_tests() {
    timeout "${TESTS_S:-300}" python3 -m pytest -o addopts="" -p no:cacheprovider --import-mode=importlib \
        -m gpu -q -rfE --tb=short --timeout 150 \
        tests/clipping tests/train/test_loop_cuda.py tests/privacy/rng/test_chacha.py tests/privacy/noise/test_noise.py \
        tests/train/test_worker.py ${TESTS_K:+-k "$TESTS_K"} > "$OUT/tests.log" 2>&1
    echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -40
}
stage_noise() {
    timeout 150 python3 benchmarks/noise.py --cuda-count 1600000000 --cpu-count 10000000 \
        --repeats 5 --json "$OUT/noise.json" --sass "$OUT/noise-kernel.sass" 2>&1 | tail -30
}
stage_clip() {  # llmdp against the non-private step at both shapes, one profiled step each
    for shape in "$T1" "$T2"; do
        timeout 240 python3 benchmarks/clipping.py $BIG $shape \
            --methods "${CLIP_METHODS:-non-private,llmdp-auto}" --profile "$OUT/prof-${shape// /_}" \
            --json "$OUT/clip-${shape// /_}.json" 2>&1 | grep -v "done:" | tail -14
        rm -f "$OUT/prof-${shape// /_}/profile-non-private.txt"
    done
}
stage_peers() {  # every method, peers included, at both shapes (PEER_SHAPES="$T2": one)
    local shapes=("$T1" "$T2")
    [ -n "${PEER_SHAPES:-}" ] && shapes=("$PEER_SHAPES")
    for shape in "${shapes[@]}"; do
        timeout 280 python3 benchmarks/clipping.py $BIG $shape --methods "$PEERS" \
            --json "$OUT/peers-${shape// /_}.json" 2>&1 | grep -v "done:" | tail -14
    done
}
stage_lora() {
    timeout 200 python3 benchmarks/clipping.py $BIG $T1 --lora --lora-rank 16 \
        --methods "${LORA_METHODS:-non-private,llmdp-auto,opacus-hooks,opacus-ghost,opake-whole-batch}" \
        --profile "$OUT/prof-lora" --json "$OUT/lora.json" 2>&1 | grep -v "done:" | tail -12
}
stage_recipe() {  # recipes/gpu-1b-synthetic.yaml as written, its worker loop in this process
    timeout 200 python3 benchmarks/gpu_recipe.py recipes/gpu-1b-synthetic.yaml --steps 4 \
        --out /tmp/llmdp-recipe-runs > "$OUT/recipe.log" 2>&1
    echo "recipe rc=$?"; tail -12 "$OUT/recipe.log"
}
stage_kernels() {  # the two Triton kernels vs cuBLAS per layer shape, with a tile sweep
    timeout "${KERNELS_S:-400}" python3 benchmarks/kernels.py 2>&1 | tee "$OUT/kernels.log" | tail -30
}

for s in "$@"; do
    echo "===== $s ($(date +%T))"
    "stage_$s"
done
echo "===== end ($(date +%T))"
