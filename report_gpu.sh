#!/usr/bin/env bash
# Every GPU measurement this project still lacks, in one command, most wanted first (the README's "Still
# needs a GPU"). Each part runs under its own share of the time, so that a slow part cannot take the
# others' time: fla autotunes for about 45 s a direction at each new shape, and the sweep compiles every
# setting. The scripts save after every row, so a part stopped at its limit keeps the rows it finished.
#
#     bash report_gpu.sh                  # into results/, 540 s in all (up to 25 s more if parts must be killed)
#     bash report_gpu.sh OUT_DIR SECONDS
#
# OUT_DIR gets each part's JSON (and figure) and log, and env.txt (the GPU, its driver, the versions).
# fla is timed where it is installed (pip install flash-linear-attention); without it the report times
# ours and FlashAttention only. PYTHON names the Python to use (default: python3).
set -uo pipefail
out=${1:-results}
budget=${2:-540}
mkdir -p "$out" && out=$(cd "$out" && pwd)  # absolute: the scripts run from this folder
cd "$(dirname "$0")"
export PYTHONUNBUFFERED=1  # each row in the log as it comes
py=${PYTHON:-python3}  # the Python that has torch (an activated virtual environment's, or another)
gpu=$($py -c "from report_kernel import _device, gpu_file_name; print(gpu_file_name(_device()[1]))")
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  $py -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  $py -c "import fla; print('fla', fla.__version__)" 2>/dev/null || echo "fla not installed"; } >"$out/env.txt"

part() {  # name, percent of the budget, command: run it under its limit, its output to the screen and a log
    local name=$1 limit=$((budget * $2 / 100 > 0 ? budget * $2 / 100 : 1))  # (timeout reads 0 as no limit)
    shift 2
    echo "== $name: up to $limit s: $*" | tee "$out/$name.log"
    timeout --kill-after=5 "$limit" "$@" 2>&1 | tee -a "$out/$name.log"
    echo "== $name: exit status ${PIPESTATUS[0]} (124: stopped at its limit)" | tee -a "$out/$name.log"
}

# Hedgehog and 1+ELU at Fig. 6's shape: the fused forward, against FlashAttention (and fla)
part fused 38 $py report_kernel.py --check=timed --shapes=1x12x64 --families=hedgehog,elu \
    --out="$out/kernel_${gpu}_fused.json"
# the launch settings: 32K first, the length of the paper's 6x (Fig. 6)
part sweep 20 $py sweep_kernel.py --lengths=32768,4096 --out="$out/kernel_sweep_${gpu}.json"
# fla's own shape
part fla_shape 16 $py report_kernel.py --check=timed --shapes=8x32x128 --families=hedgehog \
    --out="$out/kernel_${gpu}_fla_shape.json"
# Taylor and OAL, with their closed form in the tiles
part poly 10 $py report_kernel.py --check=timed --shapes=1x12x64 --families=taylor,oal \
    --out="$out/kernel_${gpu}_poly.json"
# the kernels' tests and the oracle tests of every attention form on this GPU (the suite has run on CPUs only);
# -x shows the first failure at once, in parallel where pytest-xdist is installed
part tests 10 $py -m pytest -q -x -p no:cacheprovider $($py -c "import xdist; print('-n 8')" 2>/dev/null) \
    test_kernel.py test_all.py
# generation: time per token against the context
part decode 6 $py decode.py --tokens=10 --out="$out/decode_${gpu}.json"
