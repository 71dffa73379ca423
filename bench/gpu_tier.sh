#!/usr/bin/env bash
# The GPU tier in one command, on a machine with one CUDA GPU (docs/benchmarks.md keeps its figures):
# the update's pass at Qwen2.5-0.5B shape in bf16, eager and with compiled layers, at 16 and 32 sequences a
# micro-batch (64 padded spread sequences do not fit 80 GB); grpo.py's steady state at that shape, padding-free,
# eager and compiled, the whole step's 64 sequences a micro-batch; then the GPU tests. The timing-sensitive
# parts run first, alone on the GPU. Every log lands in $OUT (default runs/gpu_tier). Sized for one 10-minute
# call: at most 570 s of time limits (its third form ran 413 s on an H100). Earlier forms measured the padded
# rows, the vocabulary op and the launch check: VOCAB=1 and CHECK=fast|full add those two (about 55 s and 180 s).
#
# The device's image (torch, transformers, accelerate, peft, pyarrow, pytest-xdist) has no tyro or datasets:
# carry their wheels. Once, in the repository (with /.whl/ in .git/info/exclude, so they are never committed):
#     for p in tyro==1.0.17 typeguard==4.6.1 docstring_parser==0.18.0 datasets==5.2.0 dill==0.4.1 \
#              multiprocess==0.70.19; do pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
#              --platform manylinux2014_x86_64 -d .whl $p; done
# then run, carrying .whl:
#     pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site bash bench/gpu_tier.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_tier}
CACHE=${CACHE:-/tmp/recipes-throughput}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 WANDB_MODE=disabled
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" |
    tee -a "$OUT/gpu.txt"

# 1. the trainer's forward and backward on the spread batch, padded and padding-free, by pass size, eager then
# compiled (the first compiled call's time is said); the largest compiled pass's top kernels
for compiled in "" "--compile"; do
    name=packing${compiled:+-compiled} limit=${PACKING_S:-70}
    [ -n "$compiled" ] && limit=${COMPILED_PACKING_S:-130}
    timeout "$limit" python3 bench/packing.py --shape qwen2.5-0.5b --device cuda --dtype bfloat16 \
        --batches spread spread-groups --seqs 16 32 --repeats 3 --cache "$CACHE" $compiled ${compiled:+--profile} \
        >"$OUT/$name.txt" 2>&1
    echo "$name: exit $?"
    grep -E "^model|^spread|first call" "$OUT/$name.txt"
done

# 2. grpo.py's steady state, padding-free, a micro-batch of the step's 64 sequences, eager then compiled
# (three steps, the first not counted: it compiles)
for compiled in "" "--torch-compile"; do
    name=throughput${compiled:+-compiled} limit=${THROUGHPUT_S:-100}
    [ -n "$compiled" ] && limit=${COMPILED_THROUGHPUT_S:-150}
    timeout "$limit" python3 bench/throughput.py --models qwen2.5-0.5b --layouts padding-free \
        --mixed-precision bf16 --steps 3 --micro-batch 64 --cache "$CACHE" $compiled --json "$OUT/$name.json" \
        >"$OUT/$name.txt" 2>&1
    echo "$name: exit $?"
    grep -v "Writing model\|Loading weights" "$OUT/$name.txt" | tail -3
done

if [ "${VOCAB:-0}" = 1 ]; then  # the vocabulary's share of the update: op by op against the fused pass
    timeout 55 python3 bench/vocab_ops.py --device cuda --dtype bfloat16 --rows 8192 >"$OUT/vocab.txt" 2>&1
    echo "vocab_ops: exit $?"
    tail -3 "$OUT/vocab.txt"
fi
if [ -n "${CHECK:-}" ]; then  # the launch check on the 0.5B-shaped model (bf16 gaps, packing; full: resume)
    timeout 180 python3 -m common.check grpo --model "$CACHE/qwen2.5-0.5b" --mixed-precision bf16 \
        --check "$CHECK" --train-batch-size 8 --rollout-n 4 --max-response-length 64 \
        --output-dir /tmp/gpu-tier-check >"$OUT/check.txt" 2>&1
    echo "check: exit $?"
    grep -iE "pass|fail|gap|error" "$OUT/check.txt" | tail -12
fi

# 3. the GPU tests (every recipe in float32 and bf16, engine against trainer, packed and compiled passes)
timeout "${TESTS_S:-120}" python3 -m pytest -m gpu -q -rP -n 4 -p no:cacheprovider >"$OUT/pytest.txt" 2>&1
echo "pytest -m gpu: exit $?"
grep -E "largest|against|passed|failed|FAILED|ERROR" "$OUT/pytest.txt" | tail -30
