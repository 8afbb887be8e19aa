#!/usr/bin/env bash
# The GPU check in one call: the `gpu` tests, then depctl's engine eager beside CUDA graphs (benchmarks/gpu_check.py).
#
#   scripts/gpu_check.sh --prepare   # on a machine with PyPI: the wheels a bare GPU image lacks, into .gpu/wheels
#   scripts/gpu_check.sh             # on the GPU machine: installs them under .gpu/site, runs the check (< 8 min)
#   scripts/gpu_check.sh --cpu       # the same steps on a CPU with a tiny model, in seconds: checks this script
#
# The GPU machine needs only python3 with torch (CUDA), transformers, typer, rich, httpx, pyyaml and pytest: the
# rest of depctl's dependencies travel as CPython 3.12 manylinux wheels (.gpu/ is git-ignored; carry it along).
# Without a GPU it says so and exits 0. The table goes to stdout and to $OUT/gpu_check.md (else .gpu/gpu_check.md).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
WHEELS=.gpu/wheels
MAX_MB=48  # a call to a lent GPU machine carries 64 MiB, the working tree included

if [ "${1:-}" = "--prepare" ]; then
    dest="${2:-$WHEELS}"
    PY="${PYTHON:-.venv/bin/python}"
    [ -x "$PY" ] || { scripts/setup.sh >&2; PY=.venv/bin/python; }
    rm -rf "$dest" && mkdir -p "$dest"
    # what the image lacks, at the versions the tests ran with here
    mapfile -t pins < <("$PY" scripts/gpu_wheels.py)
    # pip matches a manylinux tag exactly: name every glibc up to the image's (Ubuntu 24.04: 2.39)
    platforms=(--platform manylinux1_x86_64 --platform manylinux2010_x86_64 --platform manylinux2014_x86_64)
    for glibc in $(seq 5 39); do platforms+=(--platform "manylinux_2_${glibc}_x86_64"); done
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$dest" "${pins[@]}" 2>&1 | grep -v "^WARNING: Location" || true
    [ "$(ls "$dest"/*.whl | wc -l)" -eq "${#pins[@]}" ] || { echo "gpu_check: some wheels are missing" >&2; exit 1; }
    size_mb=$(( $(du -sk "$dest" | cut -f1) / 1024 ))
    echo "gpu_check: ${#pins[@]} wheels, ${size_mb} MiB, in $dest"
    if [ "$size_mb" -gt "$MAX_MB" ]; then
        echo "gpu_check: the wheels take ${size_mb} MiB, more than the ${MAX_MB} MiB a GPU call can carry" >&2
        exit 1
    fi
    exit 0
fi

PY="${PYTHON:-python3}"
bench=(--budget 270)
cpu=0
if [ "${1:-}" = "--cpu" ]; then
    shift
    cpu=1
    PY="${PYTHON:-.venv/bin/python}"  # the wheels are CPython 3.12's; the project's venv has what they hold
    [ -x "$PY" ] || { scripts/setup.sh >&2; PY=.venv/bin/python; }
    bench=(--device cpu --shapes tiny --rows 1,2 --tokens 8 --passes eager --cpu-tokens 8)
elif ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: no CUDA GPU here ($("$PY" -c 'import torch; print("torch", torch.__version__)' 2>/dev/null \
        || echo "no torch")): nothing to check. Run it on a GPU machine, after --prepare here."
    exit 0
fi
SITE="$ROOT/.gpu/site"
rm -rf "$SITE" && mkdir -p "$SITE"
if [ "$cpu" = 0 ]; then
    [ -d "$WHEELS" ] || { echo "gpu_check: no $WHEELS: run scripts/gpu_check.sh --prepare where PyPI is reachable" >&2; exit 2; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl
fi
ln -s "$ROOT/runtime" "$SITE/depctl_runtime"  # the runtime's folder installs under this name (pyproject.toml)
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export DEPCTL_HOME="$ROOT/.gpu/home"
RESULTS="${OUT:-$ROOT/.gpu}"
mkdir -p "$RESULTS"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__)"
status=0
echo "== the gpu tests, a process per file (a device-side assert poisons the rest of its process)"
mapfile -t files < <(grep -rl "mark.gpu" tests --include="test_*.py" | sort)
: >"$RESULTS/gpu_tests.log"
for file in "${files[@]}"; do
    echo "-- $file" >>"$RESULTS/gpu_tests.log"
    if ! timeout 150 "$PY" -m pytest -q -p no:cacheprovider -m gpu -o addopts="" --timeout 120 "$file" \
        >>"$RESULTS/gpu_tests.log" 2>&1; then
        status=1
    fi
    printf '%-50s %s\n' "$file" "$(tail -1 "$RESULTS/gpu_tests.log")"
done
grep -E "^(FAILED|ERROR) " "$RESULTS/gpu_tests.log" || true
echo "== eager beside CUDA graphs, random weights"
timeout 330 "$PY" benchmarks/gpu_check.py "${bench[@]}" --out "$RESULTS/gpu_check.md" "$@" || status=1
exit $status
