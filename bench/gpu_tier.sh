#!/usr/bin/env bash
# The GPU tier in one command, on a machine with one CUDA GPU (docs/benchmarks.md keeps its figures):
# the throughput table and packing at Qwen2.5 shapes in bf16, the launch check (--check full) on a
# 0.5B-shaped model, and the GPU tests. The timing-sensitive parts run first, alone on the GPU; the
# check and the tests then run side by side. Every log lands in $OUT (default runs/gpu_tier).
#
#     bash bench/gpu_tier.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_tier}
CACHE=${CACHE:-/tmp/recipes-throughput}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 WANDB_MODE=disabled

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" |
    tee -a "$OUT/gpu.txt"

# 1. grpo.py's steady state at 0.5B and 1.5B shape, padded and padding-free (4 runs)
timeout "${THROUGHPUT_S:-240}" python3 bench/throughput.py --models qwen2.5-0.5b qwen2.5-1.5b \
    --mixed-precision bf16 --steps 3 --micro-batch 32 --cache "$CACHE" --json "$OUT/throughput.json" \
    >"$OUT/throughput.txt" 2>&1
echo "throughput: exit $?"
grep -v "Writing model\|Loading weights" "$OUT/throughput.txt" | tail -8

# 2. the trainer's forward and backward, padded against padding-free, with the top kernels
timeout "${PACKING_S:-70}" python3 bench/packing.py --shape qwen2.5-0.5b --device cuda --dtype bfloat16 \
    --repeats 5 --cache "$CACHE" --profile >"$OUT/packing.txt" 2>&1
echo "packing: exit $?"
grep -E "^model|^spread|^uniform" "$OUT/packing.txt"

# 3. the vocabulary's share of the update: op by op against the fused logprob and entropy pass
timeout "${VOCAB_S:-60}" python3 bench/vocab_ops.py --device cuda --dtype bfloat16 --rows 8192 >"$OUT/vocab.txt" 2>&1
echo "vocab_ops: exit $?"
tail -3 "$OUT/vocab.txt"

# 4. the launch check on the 0.5B-shaped model (bf16 gaps, weight sync, resume), beside the GPU tests
timeout "${CHECK_S:-200}" python3 -m common.check grpo --model "$CACHE/qwen2.5-0.5b" --mixed-precision bf16 \
    --check full --train-batch-size 8 --rollout-n 4 --max-response-length 64 --output-dir /tmp/gpu-tier-check \
    >"$OUT/check.txt" 2>&1 &
CHECK=$!
timeout "${TESTS_S:-200}" python3 -m pytest -m gpu -q -rP -n 4 -p no:cacheprovider >"$OUT/pytest.txt" 2>&1
echo "pytest -m gpu: exit $?"
grep -E "largest|passed|failed|FAILED|ERROR" "$OUT/pytest.txt" | tail -30
wait $CHECK
echo "check: exit $?"
grep -iE "pass|fail|gap|error" "$OUT/check.txt" | tail -12
