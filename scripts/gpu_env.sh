# Source from the repository root on an offline CUDA host (see scripts/gpu_wheelhouse.py):
# installs the wheels of .whl into /tmp/site, puts it and the repository on PYTHONPATH, and
# prints the versions the benchmarks report (also into $OUT/env.txt when OUT is set).
set -o pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site:$PWD
{
    date -u
    nvidia-smi --query-gpu=index,name,memory.total --format=csv
    nproc
    python3 -c "import torch,grpc,google.protobuf as p,megatron.core as m,transformers as t,nixl;print(torch.__version__,torch.cuda.device_count(),grpc.__version__,p.__version__,m.__version__,t.__version__)"
} > "${OUT:-/tmp}/env.txt" 2>&1
tail -1 "${OUT:-/tmp}/env.txt"
