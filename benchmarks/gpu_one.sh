#!/usr/bin/env bash
# The GPU figures one lent GPU (H100 or H200) can give, in one short call: benchmarks/gpu_mfu.py on
#  - configs/h100.yaml (1.3 B dense, FSDP2 bf16), compiled and eager;
#  - configs/dense-8b.yaml cut to 8 of its 32 layers (the full 8 B model's fp32 weights, gradients and Adam
#    states alone are 128 GB), selective activation checkpointing and 2 x 8,192-token micro-batches as
#    torchtitan's Llama 3.1 8B runs: same layer shapes, so its MFU compares with theirs (33.7 % / 39.0 %);
#  - configs/moe-8x.yaml cut to 2 layers (8 experts, top-2; MFU by active parameters).
# and `trainer`: the real training stage (benchmarks/gpu_layouts.py -> run_training -> torchrun -> the worker's
# Trainer, its data loader, logging and step loop; no checkpoint write) on one GPU for the same models.
# The 8-GPU layouts themselves are benchmarks/gpu_layouts.py with its default --gpus 8 (needs a node of 8).
#     OUT=benchmarks/results/gpu_one bash benchmarks/gpu_one.sh [mfu|trainer|all]   (PY=python to pick the interpreter)
set -u
OUT=${OUT:-benchmarks/results/gpu_one}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,power.limit --format=csv | tee "$OUT/nvidia_smi.csv"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
ONE="--set train.parallel.dp_shard=1 --set train.parallel.tp=1 --set train.parallel.ep=1 --set train.nproc_per_node=1"
run() {  # name, seconds allowed, gpu_mfu arguments
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" "$PY" benchmarks/gpu_mfu.py --out "$OUT/gpu_mfu_$name.json" "$@" > "$OUT/.last.log" 2>&1 \
    || echo "FAILED $name (exit $?; its JSON, if any, says why)"
  grep -v Warning "$OUT/.last.log" | tail -4
}
PART=${1:-all}
if [ "$PART" != trainer ]; then
run h100_1b3_eager 70 --config configs/h100.yaml --set train.batch_tokens=65536 --set train.compile=false --warmup 3 --steps 8
run h100_1b3_compile 150 --config configs/h100.yaml --set train.batch_tokens=65536 --warmup 4 --steps 8
run dense8b_8layers_sac_eager 80 --config configs/dense-8b.yaml $ONE --set model.n_layer=8 --set train.micro_batch_size=2 \
  --set train.batch_tokens=32768 --set train.activation_checkpointing=selective --set train.compile=false --warmup 3 --steps 8
run moe8x_2layers_eager 80 --config configs/moe-8x.yaml $ONE --set model.n_layer=2 --set train.micro_batch_size=2 \
  --set train.batch_tokens=32768 --set train.compile=false --warmup 3 --steps 8
run dense8b_8layers_sac_compile 120 --config configs/dense-8b.yaml $ONE --set model.n_layer=8 --set train.micro_batch_size=2 \
  --set train.batch_tokens=32768 --set train.activation_checkpointing=selective --warmup 4 --steps 8
fi
[ "$PART" = mfu ] && { rm -f "$OUT/.last.log"; exit 0; }
trainer() {  # name, seconds allowed, gpu_layouts arguments
  local name=$1 limit=$2; shift 2
  echo "== trainer $name"
  # its own process group: a run cut by its limit takes its torchrun and ranks with it, and nothing else
  setsid timeout -k 10 "$limit" "$PY" benchmarks/gpu_layouts.py --gpus 1 --layouts planner \
    --out "$OUT/trainer_$name.json" "$@" > "$OUT/.last.log" 2>&1 &
  local pid=$!
  wait "$pid" || { echo "FAILED trainer $name (exit $?)"; kill -- -"$pid" 2>/dev/null; }
  grep -v Warning "$OUT/.last.log" | grep -v "^step " | tail -4
}
trainer h100_1b3_compile 120 --config configs/h100.yaml --steps 16 --warmup 6 --batch 32
trainer moe8x_2layers_eager 80 --config configs/moe-8x.yaml --steps 12 --warmup 4 --batch 4 --no-compile \
  --set model.n_layer=2 --set train.parallel.dp_shard=1 --set train.parallel.ep=1 --set train.micro_batch_size=2 --set train.nproc_per_node=1
trainer dense8b_8layers_sac_compile 130 --config configs/dense-8b.yaml --steps 12 --warmup 4 --batch 4 \
  --set model.n_layer=8 --set train.parallel.dp_shard=1 --set train.parallel.tp=1 --set train.nproc_per_node=1 \
  --set train.activation_checkpointing=selective --set train.micro_batch_size=2
rm -f "$OUT/.last.log"
