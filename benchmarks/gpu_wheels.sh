#!/usr/bin/env bash
# The wheels benchmarks/gpu.sh carries to the GPU machine (Python 3.12, x86-64), into .whl/
# (git-ignored; the device call names it in `carry`). Everything here that the machine's image
# lacks, at the versions this project is tested with; nothing it has (torch, triton, peft,
# numpy, pyarrow, pandas, ...). About 27 MB.
#
#   bash benchmarks/gpu_wheels.sh        # then: bash benchmarks/gpu.sh --dry-run (rehearsal)
set -eu
WHEELS=(
    transformers==5.24.0                       # the version of the CPU tests (the image's is older)
    dp-accounting==0.6.0 dm-tree==0.1.10       # the accountant
    faker==40.63.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
    datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19   # the worker loop's data (tests/train/test_loop_cuda.py)
    opacus==1.6.0                              # peers (its own top-level `benchmarks` package is removed by gpu.sh)
    opake==0.16.1 opake-base==0.16.1 opake-engine==0.16.1 opake-accounting==0.16.1 opake-dpsgd==0.16.1
    opake-optimizers==0.16.1 opake-patches==0.16.1 opake-dpftrl==0.16.1 opake-alignment==0.16.1
    opake-transformers==0.16.1 torchopt==0.7.3 optree==0.20.0 graphviz==0.21
)
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d .whl "${WHEELS[@]}"
ls .whl | wc -l
du -sh .whl
