#!/usr/bin/env bash
# Source this on a GPU node that has torch/triton preinstalled but no network (how the recorded GPU
# runs were made): installs carried wheels (papermill, ipykernel, nbclient, nbformat, nbconvert and
# the dependencies the image lacks) from ./.whl into /tmp/site and the project itself, offline.
#   source scripts/offline_gpu_setup.sh && python3 -m pytest --nb-device cuda
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export JUPYTER_PATH=/tmp/site/share/jupyter   # nbconvert's HTML templates ship as data files
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || return 1
export PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
