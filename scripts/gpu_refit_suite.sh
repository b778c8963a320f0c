#!/usr/bin/env bash
# The refit measurements of BENCHMARKS.md on a two-GPU host, in groups that each fit ten
# minutes: `scripts/gpu_refit_suite.sh GROUP...` from the repository root, with the wheels of
# scripts/gpu_wheelhouse.py in .whl. Results (JSON) and logs go to $OUT (default ./runs).
#   install     refit_install, 1b, checksums on: pulled into the model's tensors (in place),
#               and copied in after the pull
#   first-refit refit_install, 1b: a receiver that installs the trainer's start-up version
#               (--publish-start) and then refits every step, its first refit against its
#               steady ones; beside the same run without a start-up version ($DEST_GPU: the
#               receiver's GPU, default 1; 0 on a one-GPU host)
#   colocated   refit_install, 1b, the receiver on the trainer's GPU (one GPU is enough): reads
#               over CUDA IPC (the agents' default), then with UCX's own choice
#               (UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto: no GET without NVLink, so through TCP)
#   moe         refit_install, 1b and moe (Qwen3-MoE's routing: 128 experts, top-8; 5,376
#               per-expert tensors installed as 28 fused ones) in one call, checksums on, in
#               place: the mixture of experts' figure beside the dense one, each with its
#               control plane per refit. The receiver on $DEST_GPU (default 1; 0 on a one-GPU
#               host: trainer and receiver on one GPU)
#   install-more  refit_install, 1b, checksums off, and the path of before issue 15's last
#               steps (--not-before-readable --install copy)
#   install-nc  refit_install, 1b, checksums off
#   behind      refit_install, 1b and 3b, checksums on, each read behind the trainer's
#               snapshot copy (the default) and once the whole copy landed (--not-behind-copy)
#   goal        refit_install, 1b and 3b, reading behind the copy (the default), checksums on
#               and off: the latency figures of the refit-in-peer-copy-time goal
#               (docs/refit.md), about 330 s; `pull` gives its hold-up figure. $GOAL_PRESETS:
#               the presets (default "1b 3b"); $GOAL_STEPS: timed refits per run (default 10)
#   install-window  refit_install, 1b, the direct pull's READ requests in flight at once
#               ($WINDOWS: the counts, default "0 2", 0 for all; the receivers' default: 4)
#   install-taper  refit_install, 1b, the direct pull's first and last requests and check
#               parts halved ($TAPERS: the halvings, default "2")
#   install-3b  refit_install, 3b, checksums on (one slot when the GPU has under 100 GiB)
#   install-3b-nc  the same, checksums off
#   fanout      refit_fanout, 1b, three receivers, one child per source, then two
#   fanout-spread  refit_fanout, 1b, k = 1 and 2, the last receiver on the trainer's GPU
#               (two GPUs share the tree's copies, checks and installs; $SPREAD: the GPUs)
#   fanout-trace  refit_fanout, 1b, one child per source, each pull's timeline recorded and
#               each tree round's levels printed (when each saw its parent's last fill)
#   control     sidecar_control: the control plane alone (tree and direct)
#   pull        refit_pull: the NIXL pull against a peer copy, and what publication holds the
#               next training step up (against a device-local copy of the rank's shards;
#               between two trainer processes, and within one publishing every third version),
#               about 300 s
#   step-tail   trainer_step, 1b: the light step (one 512-token sequence) over gRPC and
#               in-process, its FinishTrainStep profiled (--profile-finish), then the preset's
#               full steps; with the fused and the stock update kernels, alternating
#               ($STEP_ROUNDS: the rounds, default "1 2")
#   graphs      trainer_step, 1b: the light step (one 512-token sequence) over gRPC and
#               in-process, then the preset's full steps in-process, without and with
#               --cuda-graphs layers, alternating ($STEP_ROUNDS: the rounds, default "1 2")
#   packing     trainer_step, 1b, in-process, 2 microbatches of $PACK_SEQS sequences (default
#               "16 8") of 64-4,096 tokens: packed rows with cuDNN's ragged attention and with
#               the variable-length flash kernel, and right-padded rows; the GPU tests of packed
#               rows first ($PACK_REPEATS: runs of each, default 2)
#   recompute   trainer_step, 1b, one 8,192-token sequence per microbatch, in-process: peak
#               memory and tokens/s with --recompute none, selective and full
#   determinism trainer_step, 1b, grpc, in-process and leader: twice each with --deterministic
#               (losses and exported weights compared across every run), then once each without
#   tests       the GPU-marked tests
#   tests-refit the GPU-marked tests of the refit's checksums, check and install
# $OUT then holds env.txt, results.tgz (each run's JSON and printed log, archived again after
# every run, so a call cut off by its time limit keeps what finished) and logs.tgz (the
# services' logs).
set -o pipefail
export OUT=${OUT:-runs}
mkdir -p "$OUT"
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh || exit 1
logs=/tmp/refit-suite-logs
status=0
run() {  # name, command...: output to $OUT/name.log; the summary lines to the terminal
    local name=$1
    shift
    echo "== $name: $*"
    "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    grep -v "\] INFO \|NIXL INFO" "$OUT/$name.log" | tail -25
    [ $rc -eq 0 ] || { echo "== $name failed ($rc)"; status=1; }
    archive
}
archive() {  # the results so far as one archive (a host may hand back only a few files)
    (
        cd "$OUT" && shopt -s nullglob && files=(*.json *.log) && [ ${#files[@]} -gt 0 ] &&
            tar czf results.tgz.part -- "${files[@]}" && mv -f results.tgz.part results.tgz
    )
}
step_pairs() {  # tag, flag, values...: the light and the full 1b step with each value, per round
    local tag=$1 flag=$2 round value
    shift 2
    for round in ${STEP_ROUNDS:-1 2}; do
        for value in "$@"; do
            run "light-${tag//_/-}$value-$round" python3 -m benchmarks.trainer_step --preset 1b \
                --modes grpc,inprocess --repeats 1 --seq-len 512 --seqs-per-microbatch 1 \
                --microbatches 1 --warmup 3 --steps 8 --profile-finish 4 \
                "$flag" "$value" --out "$OUT/trainer_step_light_${tag}${value}_$round.json"
            run "step-${tag//_/-}$value-$round" python3 -m benchmarks.trainer_step --preset 1b \
                --modes inprocess --repeats 1 "$flag" "$value" \
                --out "$OUT/trainer_step_1b_${tag}${value}_$round.json"
        done
    done
}
for group in "$@"; do
    case $group in
    install)
        run install-1b python3 -m benchmarks.refit_install --preset 1b --device cuda \
            --dest-gpu 1 --out "$OUT/refit_install_1b.json" --log-dir $logs/install-1b
        run install-1b-copy python3 -m benchmarks.refit_install --preset 1b \
            --device cuda --dest-gpu 1 --install copy \
            --out "$OUT/refit_install_1b_copy.json" --log-dir $logs/install-1b-copy
        ;;
    colocated)
        run colocated-1b python3 -m benchmarks.refit_install --preset 1b --device cuda \
            --dest-gpu 0 --out "$OUT/refit_install_1b_colocated.json" \
            --log-dir $logs/colocated-1b
        UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto run colocated-1b-ucx-auto python3 -m \
            benchmarks.refit_install --preset 1b --device cuda --dest-gpu 0 --steps 3 \
            --out "$OUT/refit_install_1b_colocated_ucx_auto.json" \
            --log-dir $logs/colocated-1b-ucx-auto
        ;;
    moe)
        for preset in 1b moe; do
            run "moe-$preset" python3 -m benchmarks.refit_install --preset $preset \
                --device cuda --dest-gpu "${DEST_GPU:-1}" \
                --out "$OUT/refit_install_${preset}_moe_call.json" --log-dir "$logs/moe-$preset"
        done
        ;;
    first-refit)
        run first-refit-1b python3 -m benchmarks.refit_install --preset 1b --device cuda \
            --dest-gpu "${DEST_GPU:-1}" --publish-start --warmup 0 --steps 12 \
            --out "$OUT/refit_install_1b_first.json" --log-dir $logs/first-refit-1b
        run first-refit-1b-cold python3 -m benchmarks.refit_install --preset 1b --device cuda \
            --dest-gpu "${DEST_GPU:-1}" --steps 12 \
            --out "$OUT/refit_install_1b_cold.json" --log-dir $logs/first-refit-1b-cold
        ;;
    step-tail)
        step_pairs "" --update-kernels fused stock
        ;;
    graphs)
        step_pairs graphs_ --cuda-graphs none layers
        ;;
    packing)
        run packing-tests python3 -m pytest -p no:cacheprovider -m gpu -q -s \
            tests/gpu/test_ragged_attention_gpu.py tests/gpu/test_sdpa_gpu.py \
            tests/gpu/test_sequence_layouts_gpu.py
        for seqs in ${PACK_SEQS:-16 8}; do
            run "packing-${seqs}seq" python3 -m benchmarks.trainer_step --preset 1b \
                --modes inprocess --sequence-layouts packed,padded --packed-attentions cudnn,flash \
                --length-mix 64:4096 --microbatches 2 --seqs-per-microbatch "$seqs" --warmup 2 \
                --steps 4 --repeats "${PACK_REPEATS:-2}" --log-dir "$logs/packing-${seqs}seq" \
                --out "$OUT/trainer_step_1b_packing_${seqs}seq.json"
        done
        ;;
    recompute)
        for recompute in none selective full; do
            run "recompute-$recompute" python3 -m benchmarks.trainer_step --preset 1b \
                --modes inprocess --repeats 1 --max-positions 8192 --seq-len 8192 \
                --seqs-per-microbatch 1 --microbatches 2 --recompute $recompute \
                --out "$OUT/trainer_step_1b_8k_recompute_$recompute.json"
        done
        ;;
    determinism)
        run determinism-on python3 -m benchmarks.trainer_step --preset 1b \
            --modes grpc,inprocess,leader --repeats 2 --deterministic --weights-digest \
            --out "$OUT/trainer_step_1b_deterministic.json"
        run determinism-off python3 -m benchmarks.trainer_step --preset 1b \
            --modes grpc,inprocess,leader --repeats 1 --weights-digest \
            --out "$OUT/trainer_step_1b_not_deterministic.json"
        ;;
    install-more | install-nc)
        run install-1b-no-checksums python3 -m benchmarks.refit_install --preset 1b \
            --device cuda --dest-gpu 1 --no-checksums \
            --out "$OUT/refit_install_1b_no_checksums.json" --log-dir $logs/install-1b-nc
        [ "$group" = install-more ] && run install-1b-after-report python3 -m \
            benchmarks.refit_install --preset 1b --device cuda --dest-gpu 1 \
            --not-before-readable --install copy \
            --out "$OUT/refit_install_1b_after_report.json" --log-dir $logs/install-1b-ar
        ;;
    behind)
        memory=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0)
        for preset in 1b 3b; do
            slots=2  # the benchmark's default; 3b on a GPU under 100 GiB: one slot
            [ $preset = 3b ] && [ "$memory" -lt 100000 ] && slots=1
            run "behind-$preset" python3 -m benchmarks.refit_install --preset $preset \
                --device cuda --dest-gpu 1 --slots $slots \
                --out "$OUT/refit_install_${preset}_behind.json" --log-dir "$logs/behind-$preset"
            run "whole-$preset" python3 -m benchmarks.refit_install --preset $preset \
                --device cuda --dest-gpu 1 --slots $slots --not-behind-copy \
                --out "$OUT/refit_install_${preset}_whole.json" --log-dir "$logs/whole-$preset"
        done
        ;;
    goal)
        memory=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0)
        steps=(${GOAL_STEPS:+--steps "$GOAL_STEPS"})
        for preset in ${GOAL_PRESETS:-1b 3b}; do
            slots=2
            [ $preset = 3b ] && [ "$memory" -lt 100000 ] && slots=1
            run "goal-$preset" python3 -m benchmarks.refit_install --preset $preset \
                --device cuda --dest-gpu 1 --slots $slots "${steps[@]}" \
                --out "$OUT/refit_install_${preset}.json" --log-dir "$logs/goal-$preset"
            run "goal-$preset-nc" python3 -m benchmarks.refit_install --preset $preset \
                --device cuda --dest-gpu 1 --slots $slots --no-checksums "${steps[@]}" \
                --out "$OUT/refit_install_${preset}_no_checksums.json" \
                --log-dir "$logs/goal-$preset-nc"
        done
        ;;
    install-window)
        for window in ${WINDOWS:-0 2}; do
            run "install-1b-window$window" python3 -m benchmarks.refit_install --preset 1b \
                --device cuda --dest-gpu 1 --requests-in-flight "$window" \
                --out "$OUT/refit_install_1b_window$window.json" \
                --log-dir "$logs/install-1b-w$window"
        done
        ;;
    install-taper)
        for taper in ${TAPERS:-2}; do
            run "install-1b-taper$taper" python3 -m benchmarks.refit_install --preset 1b \
                --device cuda --dest-gpu 1 --request-taper "$taper" \
                --out "$OUT/refit_install_1b_taper$taper.json" \
                --log-dir "$logs/install-1b-t$taper"
        done
        ;;
    install-3b | install-3b-nc)
        memory=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0)
        slots=2
        [ "$memory" -lt 100000 ] && slots=1
        checks=() name=refit_install_3b
        [ "$group" = install-3b-nc ] && checks=(--no-checksums) name=refit_install_3b_no_checksums
        run "$group" python3 -m benchmarks.refit_install --preset 3b --device cuda \
            --dest-gpu 1 --slots $slots "${checks[@]}" --out "$OUT/$name.json" \
            --log-dir "$logs/$group"
        ;;
    fanout)
        # Six timed rounds of each mode at k = 1 (the first two of a mode warm its slots up):
        # two runs of one commit differed by 0.26 x one receiver with three.
        run fanout-k1 python3 -m benchmarks.refit_fanout --preset 1b --receivers 3 \
            --max-children 1 --rounds 8 --out "$OUT/refit_fanout_1b_k1.json" \
            --log-dir $logs/fanout-k1
        run fanout-k2 python3 -m benchmarks.refit_fanout --preset 1b --receivers 3 \
            --max-children 2 --rounds 4 --no-verify --out "$OUT/refit_fanout_1b_k2.json" \
            --log-dir $logs/fanout-k2
        ;;
    fanout-spread)
        # The leaf on the trainer's GPU: it reads the middle receiver over the link's other
        # direction, and its check and install run on the other GPU. $SPREAD overrides.
        run fanout-spread-k1 python3 -m benchmarks.refit_fanout --preset 1b --receivers 3 \
            --max-children 1 --rounds 8 --receiver-gpus "${SPREAD:-1,1,0}" \
            --out "$OUT/refit_fanout_1b_k1_spread.json" --log-dir $logs/fanout-spread-k1
        run fanout-spread-k2 python3 -m benchmarks.refit_fanout --preset 1b --receivers 3 \
            --max-children 2 --rounds 8 --no-verify --receiver-gpus "${SPREAD:-1,1,0}" \
            --out "$OUT/refit_fanout_1b_k2_spread.json" --log-dir $logs/fanout-spread-k2
        ;;
    fanout-trace)
        run fanout-trace python3 -m benchmarks.refit_fanout --preset 1b --receivers 3 \
            --max-children 1 --rounds 5 --no-verify --trace \
            --out "$OUT/refit_fanout_1b_k1_trace.json" --log-dir $logs/fanout-trace
        grep "traced, " "$OUT/fanout-trace.log" | grep " tree " | tail -3
        ;;
    control)
        run control-tree python3 -m benchmarks.sidecar_control --layers 16 --receivers 3 \
            --max-children 1 --out "$OUT/sidecar_control_tree.json"
        run control-direct python3 -m benchmarks.sidecar_control --layers 16 --receivers 3 \
            --direct --out "$OUT/sidecar_control_direct.json"
        ;;
    pull)
        # $INTERLEAVED_STEPS: the steps of the trainer publishing every third version (the
        # hold-up's periods are a third of them; the preset's 2,100 take about 4.5 minutes);
        # $INTERLEAVED_SEQS: 512-token sequences in each of those steps (default 1: light
        # steps, bound by the host; 16: heavier ones, more of their time on the GPU).
        steps=(${INTERLEAVED_STEPS:+--interleaved-steps "$INTERLEAVED_STEPS"})
        steps+=(${INTERLEAVED_SEQS:+--interleaved-seqs-per-microbatch "$INTERLEAVED_SEQS"})
        run refit-pull python3 -m benchmarks.refit_pull --out "$OUT/refit_pull.json" \
            --log-dir $logs/refit-pull "${steps[@]}"
        ;;
    tests-refit)
        run gpu-tests-refit python3 -m pytest -p no:cacheprovider -m gpu -q -s \
            tests/gpu/test_wsum_gpu.py tests/gpu/test_in_place_gpu.py \
            tests/gpu/test_running_check_gpu.py tests/gpu/test_publication_gpu.py \
            tests/gpu/test_progress_words_gpu.py
        ;;
    tests)
        run gpu-tests python3 -m pytest -p no:cacheprovider -m gpu tests/gpu -q -s
        ;;
    *)
        echo "unknown group $group"
        status=2
        ;;
    esac
done
tar czf "$OUT/logs.tgz" -C /tmp refit-suite-logs 2>/dev/null
archive
(cd "$OUT" && rm -f -- *.json *.log)
exit $status
