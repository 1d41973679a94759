#!/usr/bin/env bash
# What needs a GPU, in one run: the tests that need CUDA, then bench_mnist.py at the paper's sizes on
# the GPU (step times, the periodic Fisher on the 6,000 validation images, and whole runs at K = 10^6
# while they fit in BUDGET seconds). Meant for a lent GPU machine that holds torch and pytest.
#
#   bash benchmarks/gpu_checks.sh [OUT]        # OUT (default build/gpu) receives the logs and tables
#
# MNIST comes from data/ or, where data/ is missing, from .gpu/mnist.tar.gz (made here with
# `tar czf .gpu/mnist.tar.gz data/MNIST`; the loader checks the files' SHA-256 as always).
set -uo pipefail
out=${1:-build/gpu}
mkdir -p "$out"
[ -d data/MNIST/raw ] || tar xzf .gpu/mnist.tar.gz || exit 1
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
nvidia-smi -L
$py -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
$py -m pytest -q -p no:cacheprovider tests/core/test_recursion.py tests/book/test_baselines.py -k cuda 2>&1 \
    | tee "$out/cuda_tests.txt"
tests=$?
# BUDGET counts from the start of bench_mnist.py, not of this script
$py benchmarks/bench_mnist.py --devices cuda --fisher-examples 6000 --full-steps 1000000 \
    --full-variants none fixed-diag ema-diag periodic-diag --budget-s "${BUDGET:-380}" --csv "$out/bench_mnist_gpu" \
    2>&1 | tee "$out/bench_mnist_gpu.md"
bench=$?
[ "$tests" -eq 0 ] || echo "the CUDA tests failed (status $tests): $out/cuda_tests.txt" >&2
exit $(( tests != 0 ? tests : bench ))
