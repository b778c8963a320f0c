#!/usr/bin/env bash
# One benchmark command at two source trees on the same host, alternating A, B, A, B...: the
# comparison of a change that must not change performance (figures of different calls are not
# compared, so both trees run in one call). From the repository root on an offline CUDA host,
# with the wheels of scripts/gpu_wheelhouse.py in .whl:
#   scripts/gpu_ab.sh NAME ROUNDS TREE_A TREE_B -- python3 -m benchmarks.refit_install --preset 1b
# Each run gets `--out $OUT/NAME_{a,b}_ROUND.json` appended and runs from inside its tree (the
# tree and the installed wheels on PYTHONPATH). A tree is a directory holding the repository's
# files (e.g. `git archive COMMIT | tar -x -C DIR`); "." is this one. Logs go to $OUT too.
set -o pipefail
export OUT=${OUT:-runs}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
name=$1 rounds=$2 tree_a=$3 tree_b=$4
shift 4
[ "$1" = "--" ] && shift
# shellcheck source=scripts/gpu_env.sh
source scripts/gpu_env.sh || exit 1
status=0
for round in $(seq 1 "$rounds"); do
    for side in a b; do
        tree=$tree_a
        [ $side = b ] && tree=$tree_b
        tree=$(cd "$tree" && pwd)
        log="$OUT/${name}_${side}_${round}.log"
        echo "== $name $side (round $round, $tree)"
        (cd "$tree" && PYTHONPATH=/tmp/site:$tree "$@" --out "$OUT/${name}_${side}_${round}.json") \
            > "$log" 2>&1 || { echo "== failed: see $log"; status=1; }
        grep -v "\] INFO \|NIXL INFO" "$log" | tail -4
    done
done
exit $status
