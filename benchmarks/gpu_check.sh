#!/usr/bin/env bash
# Every GPU check of the repository in one pass, for a short lease of a CUDA machine:
#   1. the tests that need CUDA (Triton kernels compiled for the GPU, the quantized linears' CUDA paths);
#   2. speculative round costs at the real Qwen2.5-Coder shapes (benchmarks/speculative_rounds.py);
#   3. draft-distillation step time at the real shapes (benchmarks/distill_step_time.py);
#   4. the attention kernels against SDPA (benchmarks/bench_attention.py), and with SWEEP=1 their tile
#      sweep (about 4 minutes more: each of its 9 tile configs compiles per kernel).
# Each part has its own time cap (about 6 minutes in all), so one slow part cannot starve the rest.
# Logs and JSON are packed after every part into $OUT/gpu_check.tgz (default OUT: gpu_check/; one
# file, so a lease that returns few files returns all of them), and the tables are printed last.
#
#   OUT=runs/gpu bash benchmarks/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
DEST=${OUT:-gpu_check}
mkdir -p "$DEST"
OUT=$(mktemp -d)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

part() {  # part NAME SECONDS COMMAND...: run with a cap, log to $OUT/NAME.log, record the exit status
    local name=$1 cap=$2
    shift 2
    local start=$SECONDS
    timeout "$cap" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - start)) s (cap $cap s)" | tee -a "$OUT/parts.txt"
    tar czf "$DEST/gpu_check.tgz" -C "$OUT" .
}

{ nvidia-smi -L; $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton',
triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"; } \
    >"$OUT/device.txt" 2>&1
part tests 60 $PY -m pytest -q -p no:cacheprovider --timeout=50 tests/runtime/kernels tests/runtime/test_qlinear.py -k \
    "flash or triton or cuda"
part rounds 120 $PY benchmarks/speculative_rounds.py --draft-tokens 4 --repeats 2 --json "$OUT/rounds.json"
part distill 70 $PY benchmarks/distill_step_time.py --steps 5 --json "$OUT/distill_steps.json"
part attention 110 $PY benchmarks/bench_attention.py --models 1.5b --prefill-lens 1024,4096,8192 \
    --cache-lens 1024,8192,32768 --new-tokens 128 --repeats 2 --json "$OUT/attention.json"
[ "${SWEEP:-0}" = 1 ] && part sweep 240 $PY benchmarks/bench_attention.py --parts sweep --json "$OUT/sweep.json"

cat "$OUT/device.txt" "$OUT/parts.txt"
tail -n 3 "$OUT/tests.log"
for name in rounds distill attention sweep; do
    [ -f "$OUT/$name.log" ] || continue
    echo "== $name"
    grep -E '^(\||###|[A-Z].*torch)' "$OUT/$name.log" || tail -n 5 "$OUT/$name.log"
done
