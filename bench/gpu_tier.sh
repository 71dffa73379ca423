#!/usr/bin/env bash
# The GPU tier in one command, on a machine with one CUDA GPU (docs/benchmarks.md keeps its figures):
# the throughput rows, packing and the vocabulary's share at Qwen2.5 shapes in bf16, the launch check
# on a 0.5B-shaped model, and the GPU tests. The timing-sensitive parts run first, alone on the GPU;
# the check and the tests then run side by side. Every log lands in $OUT (default runs/gpu_tier).
# Sized for one 10-minute call: at most 570 s of time limits (its first form ran 430 s on an H100 with the 1.5B
# rows cut short; its second, with three steps a row, got only the 0.5B padded row in 115 s).
#
#     bash bench/gpu_tier.sh             # CHECK=full bash bench/gpu_tier.sh adds the resume proof
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_tier}
CACHE=${CACHE:-/tmp/recipes-throughput}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 WANDB_MODE=disabled

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" |
    tee -a "$OUT/gpu.txt"

# 1. grpo.py's steady state: 0.5B shape padded and padding-free, 1.5B padding-free, two steps a row (the
# second is timed): the HF engine's generation is 95% of a step, 9-12 s on an H100 at either shape
for rows in "140 qwen2.5-0.5b padded padding-free" "110 qwen2.5-1.5b padding-free"; do
    set -- $rows
    timeout "${THROUGHPUT_S:-$1}" python3 bench/throughput.py --models "$2" --layouts "${@:3}" \
        --mixed-precision bf16 --steps 2 --micro-batch 32 --cache "$CACHE" --json "$OUT/throughput-$2.json" \
        >"$OUT/throughput-$2.txt" 2>&1
    echo "throughput $2: exit $?"
    grep -v "Writing model\|Loading weights" "$OUT/throughput-$2.txt" | tail -4
done

# 2. the trainer's forward and backward, padded against padding-free, with the top kernels
timeout "${PACKING_S:-85}" python3 bench/packing.py --shape qwen2.5-0.5b --device cuda --dtype bfloat16 \
    --repeats 5 --cache "$CACHE" --profile >"$OUT/packing.txt" 2>&1
echo "packing: exit $?"
grep -E "^model|^spread|^uniform" "$OUT/packing.txt"

# 3. the vocabulary's share of the update: op by op against the fused logprob and entropy pass
timeout "${VOCAB_S:-55}" python3 bench/vocab_ops.py --device cuda --dtype bfloat16 --rows 8192 >"$OUT/vocab.txt" 2>&1
echo "vocab_ops: exit $?"
tail -3 "$OUT/vocab.txt"

# 4. the launch check on the 0.5B-shaped model (bf16 gaps, packing; CHECK=full adds the resume proof,
# which took 136 s on an H100 and was bit-exact), beside the GPU tests
timeout "${CHECK_S:-180}" python3 -m common.check grpo --model "$CACHE/qwen2.5-0.5b" --mixed-precision bf16 \
    --check "${CHECK:-fast}" --train-batch-size 8 --rollout-n 4 --max-response-length 64 \
    --output-dir /tmp/gpu-tier-check >"$OUT/check.txt" 2>&1 &
CHECK_PID=$!
timeout "${TESTS_S:-180}" python3 -m pytest -m gpu -q -rP -n 4 -p no:cacheprovider >"$OUT/pytest.txt" 2>&1
echo "pytest -m gpu: exit $?"
grep -E "largest|passed|failed|FAILED|ERROR" "$OUT/pytest.txt" | tail -30
wait $CHECK_PID
echo "check: exit $?"
grep -iE "pass|fail|gap|error" "$OUT/check.txt" | tail -12
