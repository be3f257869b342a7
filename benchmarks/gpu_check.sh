#!/usr/bin/env bash
# Every GPU check of the repository in one pass, for a short lease of a CUDA machine:
#   1. the tests that need CUDA (Triton kernels compiled for the GPU, the quantized linears' CUDA
#      paths; needs pytest-timeout, from the dev extra);
#   2. speculative round costs at the real Qwen2.5-Coder shapes (benchmarks/speculative_rounds.py);
#   3. draft-distillation step time at the real shapes (benchmarks/distill_step_time.py);
#   4. the attention kernels against SDPA (benchmarks/bench_attention.py), and with SWEEP=1 their tile
#      sweep (about 4 minutes more: each of its 9 tile configs compiles per kernel).
# Each part has its own time cap (about 7 minutes in all), so one slow part cannot starve the rest.
# Logs and JSON are packed after every part into $OUT/gpu_check.tgz (OUT: an absolute path, default
# gpu_check/ in the repository; one file, so a lease that returns few files returns all of them),
# the tables are printed last, and the exit status is 1 if any part failed.
#
#   OUT=$PWD/runs/gpu bash benchmarks/gpu_check.sh
set -u
cd "$(dirname "$0")/.."
DEST=${OUT:-gpu_check}
mkdir -p "$DEST"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
STATUS=0

part() {  # part NAME SECONDS COMMAND...: run with a cap, log to $WORK/NAME.log, record the exit status
    local name=$1 cap=$2
    shift 2
    local start=$SECONDS
    timeout -k 10 "$cap" "$@" >"$WORK/$name.log" 2>&1
    local rc=$?
    [ "$rc" -eq 0 ] || STATUS=1
    echo "$name: exit $rc in $((SECONDS - start)) s (cap $cap s)" | tee -a "$WORK/parts.txt"
    tar czf "$DEST/gpu_check.tgz" -C "$WORK" . || { echo "could not write $DEST/gpu_check.tgz" >&2; STATUS=1; }
}

{ nvidia-smi -L; $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton',
triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"; } \
    >"$WORK/device.txt" 2>&1
part tests 120 $PY -m pytest -q -p no:cacheprovider --timeout=110 tests/runtime/kernels tests/runtime/test_qlinear.py \
    -k "flash or triton or cuda"
part rounds 150 $PY benchmarks/speculative_rounds.py --draft-tokens 4 --repeats 3 --json "$WORK/rounds.json"
part distill 70 $PY benchmarks/distill_step_time.py --steps 5 --json "$WORK/distill_steps.json"
part attention 110 $PY benchmarks/bench_attention.py --models 1.5b --prefill-lens 1024,4096,8192 \
    --cache-lens 1024,8192,32768 --new-tokens 128 --repeats 3 --json "$WORK/attention.json"
if [ "${SWEEP:-0}" = 1 ]; then
    part sweep 240 $PY benchmarks/bench_attention.py --parts sweep --json "$WORK/sweep.json"
fi

cat "$WORK/device.txt" "$WORK/parts.txt"
tail -n 3 "$WORK/tests.log"
for name in rounds distill attention sweep; do
    [ -f "$WORK/$name.log" ] || continue
    echo "== $name"
    grep -E '^(\||###|[A-Z].*torch)' "$WORK/$name.log" || tail -n 5 "$WORK/$name.log"
done
exit $STATUS
