#!/usr/bin/env bash
# One worker per visible GPU of this machine, all on one study, then one summary of everything.
#
#   examples/cluster/one_node.sh +space=llm study.storage=postgresql://user@db/tuning \
#       tracking.uri=http://mlflow:5000 study.n_trials=6
#
# Each worker is the ordinary command pinned to its GPU through CUDA_VISIBLE_DEVICES (so it sees
# one device, cuda:0), measuring study.n_trials configurations of its own; the workers skip
# re-validation and the confirmation runs, which the summary run does once, on the first GPU,
# over every worker's trials (study.n_trials=0). Logs: worker-gpuN.log in the current folder.
# GPUS="0 2" picks the GPUs (default: every GPU nvidia-smi lists). sqlite works on one machine;
# a server database is safer under many writers.
set -euo pipefail
gpus=${GPUS:-$(nvidia-smi --query-gpu=index --format=csv,noheader)}
[ -n "$gpus" ] || { echo "no GPU listed (GPUS or nvidia-smi)"; exit 2; }
pids=()
for gpu in $gpus; do
    CUDA_VISIBLE_DEVICES=$gpu python -m search "$@" revalidate.processes=0 retune.confirm=0 \
        >"worker-gpu$gpu.log" 2>&1 &
    pids+=($!)
    echo "worker on GPU $gpu: pid $!, log worker-gpu$gpu.log"
done
# Ctrl-C or a stop of this script stops the workers too (background jobs ignore SIGINT)
trap 'kill -TERM "${pids[@]}" 2>/dev/null; wait; exit 130' INT TERM
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=$((failed + 1)); done
if [ "$failed" -gt 0 ]; then
    echo "$failed worker(s) failed: see worker-gpu*.log; the summary still covers what was stored"
fi
first=$(echo $gpus | cut -d' ' -f1)  # nvidia-smi lists one index a line
CUDA_VISIBLE_DEVICES=$first python -m search "$@" study.n_trials=0
