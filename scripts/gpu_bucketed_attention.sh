#!/usr/bin/env bash
# The bucketed attention of packed rows against the variable-length kernel on one GPU, in one
# call of about seven minutes on an H200: `scripts/gpu_bucketed_attention.sh` from the
# repository root, with the wheels of scripts/gpu_wheelhouse.py in .whl. In order:
#   tests    the GPU tests of packed rows (-s): bucketed against varlen in bf16, the model's
#            packed rows against padded ones, and one layer's attention timings for the RL mix
#            (also $OUT/bucketed_attention_timings.json)
#   16 seqs  trainer_step, 1b, in-process, 2 microbatches of 16 sequences of 64-4,096 tokens:
#            packed with varlen, packed with bucketed, padded; $REPEATS16 runs of each (default 2)
#   8 seqs   the same with 8 sequences; $REPEATS8 runs of each (default 1, to fit the call)
# Each writes its JSON and printed log to $OUT (default ./runs) as it goes, so a call cut off
# by its time limit keeps what finished.
set -o pipefail
export OUT=${OUT:-runs}
mkdir -p "$OUT"
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh || exit 1
status=0
started=$SECONDS
run() {  # name, command...: output to $OUT/name.log; the summary lines to the terminal
    local name=$1
    shift
    echo "== $name ($((SECONDS - started)) s in): $*"
    "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    grep -v "\] INFO " "$OUT/$name.log" | tail -40
    [ $rc -eq 0 ] || { echo "== $name failed ($rc)"; status=1; }
}
run gpu-tests python3 -m pytest -p no:cacheprovider -m gpu -q -s \
    tests/gpu/test_bucketed_attention_gpu.py tests/gpu/test_sequence_layouts_gpu.py
for seqs in 16 8; do
    repeats=${REPEATS16:-2}
    [ "$seqs" = 8 ] && repeats=${REPEATS8:-1}
    run "step-${seqs}seq" python3 -m benchmarks.trainer_step --preset 1b --modes inprocess \
        --sequence-layouts packed,padded --packed-attentions varlen,bucketed \
        --length-mix 64:4096 --microbatches 2 --seqs-per-microbatch "$seqs" --warmup 2 \
        --steps 4 --repeats "$repeats" --log-dir "$OUT/step-${seqs}seq-logs" \
        --out "$OUT/trainer_step_1b_bucketed_${seqs}seq.json"
done
echo "== done in $((SECONDS - started)) s"
exit $status
