#!/usr/bin/env bash
# On a machine with a CUDA GPU: the checks that CI (CPU only) cannot run.
#   1. the engine's exactness tests with the engine on the GPU: greedy (every draft kind, chains and trees,
#      batch 1 and 8, preemption, prefix caching) and sampling (the joint law of a round's tokens, chain, tree
#      and block drafts, T=1 and T=0.7 with top-p); and the kernel tests (Triton compiled, not interpreted);
#   2. one speculative round per draft kind, by component, at a realistic target shape
#      (scripts/bench_spec_round.py --device cuda), and the block draft's proposal cost against EAGLE-3's
#      single draft step (scripts/bench_block_cost.py --device cuda).
# The target is a random-weight Llama of the shape given below (default: 22 layers x 2048, vocab 32000,
# about 1.1B parameters); untrained drafts accept ~nothing, so the benchmarks measure cost, not speedup.
#
#   scripts/check_gpu.sh [OUT_DIR]            # logs go to OUT_DIR (default artifacts/gpu-check)
#   TESTS_ONLY=1 scripts/check_gpu.sh         # part 1 alone
#   LAYERS=32 HIDDEN=4096 INTERMEDIATE=14336 HEADS=32 KV_HEADS=8 VOCAB=128256 scripts/check_gpu.sh   # 8B shape
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
OUT_DIR="${1:-artifacts/gpu-check}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0

"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name())" || exit 2

echo "== 1. exactness on the GPU"
DRAFTSMITH_TEST_DEVICE=cuda "$PY" -m pytest -q -rfEs tests/serve_eval/speculative/test_spec_greedy_exact.py \
  tests/serve_eval/speculative/test_spec_sampling_exact.py tests/kernels \
  2>&1 | tee "$OUT_DIR/tests.log" | tail -40
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

[ "${TESTS_ONLY:-0}" = "1" ] && exit "$status"
echo "== 2. cost of one round per draft kind"
TARGET="$OUT_DIR/target"
"$PY" - "$TARGET" <<EOF || exit 2
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(num_hidden_layers=${LAYERS:-22}, hidden_size=${HIDDEN:-2048}, intermediate_size=${INTERMEDIATE:-5632},
                  num_attention_heads=${HEADS:-32}, num_key_value_heads=${KV_HEADS:-4}, vocab_size=${VOCAB:-32000},
                  max_position_embeddings=2048, tie_word_embeddings=False)
torch.manual_seed(0)
with torch.device("cuda"):
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
model.save_pretrained(sys.argv[1])
print("random target", sys.argv[1], sum(p.numel() for p in model.parameters()) / 1e9, "B parameters")
EOF
"$PY" scripts/bench_spec_round.py --device cuda --dtype bfloat16 --threads 1 --target "$TARGET" \
  --artifacts "$OUT_DIR/no-artifacts" --methods nospec,standalone,medusa,eagle,eagle3,block --steps 24 --repeats 5 \
  2>&1 | grep -v WARNING | tee "$OUT_DIR/spec_round.log" || status=1
"$PY" scripts/bench_block_cost.py --device cuda --dtype bfloat16 --target "$TARGET" --ks 4 8 --block-layers 1 2 \
  --rounds 100 2>&1 | grep -v WARNING | tee "$OUT_DIR/block_cost.log" || status=1
rm -rf "$TARGET"
exit "$status"
