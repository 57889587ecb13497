#!/usr/bin/env bash
# The GPU checks in one pass, as run on a lent H100/H200 (bench/README.md, "On a GPU"):
#   tests/gpu (the engine on CUDA/NCCL against fp32 torch), bench/gpu.py (rayzero against DDP, FSDP2
#   and DeepSpeed on the GPU; ZeRO-Offload), bench/offload.py's host sections (swap files against dd,
#   the CPU Adam step) on that machine's cores and disk, bench/compile.py (engine.compile at stage 3
#   against eager on GPT-2 medium's shape, bf16: the issue's >= 1.2x).
# Each part has its own time limit, so one that hangs leaves the others their figures. Outputs go
# to $OUT (default /tmp/rayzero-gpu-check). Packages the machine lacks travel as wheels in .whl/.
set -u
OUT=${OUT:-/tmp/rayzero-gpu-check}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
(nvidia-smi; $PY -c "import torch, pydantic; print('torch', torch.__version__, 'cuda', torch.version.cuda,
  torch.cuda.device_count(), 'GPUs', [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
  'pydantic', pydantic.__version__)"; $PY -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -1
) > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt" | tail -4
start=$(date +%s)
timeout 200 $PY -m pytest tests/gpu -q -p no:cacheprovider --timeout 190 > "$OUT/tests-gpu.log" 2>&1
echo "tests/gpu: exit $? after $(( $(date +%s) - start )) s"; tail -15 "$OUT/tests-gpu.log"
start=$(date +%s)
timeout 300 $PY bench/gpu.py --rounds 2 --job-timeout-s 140 --json "$OUT/gpu.json" ${GPU_BENCH_ARGS:-} > "$OUT/bench-gpu.log" 2>&1
echo "bench/gpu.py: exit $? after $(( $(date +%s) - start )) s"; grep -v "^\[20" "$OUT/bench-gpu.log" | tail -70
start=$(date +%s)
timeout 90 $PY bench/offload.py --quick --sections swap,cpu_step --rounds 3 --json "$OUT/offload-host.json" \
  ${OFFLOAD_BENCH_ARGS:-} > "$OUT/offload-host.log" 2>&1
echo "bench/offload.py: exit $? after $(( $(date +%s) - start )) s"
start=$(date +%s)
timeout 300 $PY bench/compile.py --device cuda --size gpt2-medium --precision bf16 --stages 3 --rounds 3 \
  --json "$OUT/compile-gpu.json" ${COMPILE_BENCH_ARGS:-} > "$OUT/compile-gpu.log" 2>&1
echo "bench/compile.py: exit $? after $(( $(date +%s) - start )) s"; grep -E '"(speedup_|max_loss|compile_s)' "$OUT/compile-gpu.log"
