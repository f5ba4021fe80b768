#!/usr/bin/env bash
# The paper's design and end_to_end tables at the `gpu` scale (cem_jax/scales.py: ~20M-param
# CEM rows, ~30M Llama, 100.7M tokens a row, bf16, 1 seed) in one run on one GPU.
#
#   bash experiments/gpu_tables.sh PREPARED_DIR OUT_DIR [TABLE ...]      (default: design end_to_end)
#
# PREPARED_DIR: a corpus prepared for the gpu scale (vocab 8192), made once beforehand with
#   python -m cem_jax.prepare --config=experiments/paper/design.py:t1,gpu \
#       --config.data.files='/data/corpus/*.txt' --out=PREPARED_DIR
# It should hold >= 100M training tokens: each row trains on 100.7M, and a smaller corpus is
# passed over several times (the run logs how many).
# The runs go to $WORKDIR (relative to where you are; default results/gpu, or
# /tmp/cem_gpu_tables_check/SCALE_stepsSTEPS_KEY under SCALE or STEPS, KEY the first 8 hex
# digits of the sha256 of PREPARED_DIR's absolute path, so that a check leaves no runs that a
# real run or a check of another setting or corpus would refuse; finished runs are skipped,
# interrupted ones resume). OUT_DIR receives each TABLE.{md,csv,png} and gpu_runs.tgz (each run's config.json,
# metrics.jsonl, result.json; no checkpoints). design trains its five headline rows; the
# diagnostic rows (t2_eta_half, ...) are `python -m cem_jax.tables --table=design --scale=gpu
# --seeds=1 --rows=...` with the same --set flags (the table then shows every finished row).
# SCALE=tiny STEPS=2 (environment) make a quick CPU check of the script itself.
# On the workplace's lent H200 (offline; ../shared does not travel), after
# `bash ../shared/tools/gpu/prepare.sh`, adding grain's wheels to .device/whl (the image lacks
# grain; the loop at the end of docs/PERFORMANCE.md) and preparing into .device/corpus here:
#   bash .device/run.sh bash experiments/gpu_tables.sh .device/corpus $OUT design
set -euo pipefail
usage="usage: bash experiments/gpu_tables.sh PREPARED_DIR OUT_DIR [TABLE ...]"
prepared=$(realpath -m "${1:?$usage}")
out=$(realpath -m "${2:?$usage}")
shift 2
if [ "${SCALE:-gpu}" = gpu ] && [ -z "${STEPS:-}" ]; then
  work=$(realpath -m "${WORKDIR:-$(dirname "${BASH_SOURCE[0]}")/../results/gpu}")
else  # a check: one folder per setting (runs of another setting would be refused there)
  # Keyed by the corpus too: its path is in every run's config, so a check of another corpus
  # in the same folder would be refused as another config.
  key=$(printf %s "$prepared" | sha256sum | cut -c1-8)
  work=$(realpath -m "${WORKDIR:-${TMPDIR:-/tmp}/cem_gpu_tables_check/${SCALE:-gpu}_steps${STEPS:-all}_$key}")
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."
fail() { echo "error: $*" >&2; exit 1; }
[ -f "$prepared/manifest.json" ] || fail "$prepared/manifest.json not found: prepare the corpus first (see the header of $0)"
tables=("$@")
[ ${#tables[@]} -gt 0 ] || tables=(design end_to_end)
for t in "${tables[@]}"; do
  [ -f "experiments/paper/$t.py" ] || fail "table $t: no experiments/paper/$t.py"
done
mkdir -p "$out" "$work"
probe="$out/.write_test.$$"
{ : > "$probe" && rm -f "$probe"; } 2>/dev/null || fail "OUT_DIR $out is not writable"
for t in "${tables[@]}"; do
  rows=()
  [ "$t" = design ] && rows=(--rows=t1,t2_fixed,t2_coevolve,t1_precond_diag,t1_precond_dlr)
  start=$(date +%s)
  rm -f "$work/$t.md"  # written only when every run of the table has finished
  python3 -m cem_jax.tables --table="$t" --scale="${SCALE:-gpu}" --seeds=1 --workdir="$work" \
    "${rows[@]}" ${STEPS:+--steps=$STEPS} --set=data.prepared_dir="$prepared" --set=data.files=
  echo "table $t: $(( $(date +%s) - start )) s wall"
  [ -f "$work/$t.md" ] || fail "table $t did not finish (preempted?): rerun the same command to resume it"
  cp "$work/$t.md" "$work/$t.csv" "$work/$t.png" "$out/"
done
tar czf "$out/gpu_runs.tgz" --exclude=checkpoints --exclude=tensorboard --exclude=data \
  -C "$work" .
