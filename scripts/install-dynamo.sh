#!/bin/sh
# NVIDIA Dynamo 1.6.1 for python -m radixserve.dynamo and its tests (README "Scaling out"; the README's test line runs
# this). The runtime (ai-dynamo-runtime, a Rust wheel) installs as usual. The Python half (ai-dynamo: the frontend and
# dynamo.common.backend) is installed without its dependencies: `pip install ai-dynamo==1.6.1` fails wherever NVIDIA's
# index is out of reach, because it requires aisimulate==0.13.0, which PyPI has only as a placeholder sdist that
# downloads the real wheel from pypi.nvidia.com. Neither the frontend nor the backend SDK imports aisimulate (Dynamo's
# planner simulation does); the requirements they do use are radixserve's own or ai-dynamo-runtime's.
set -e
pip install "ai-dynamo-runtime==1.6.1"
pip install --no-deps "ai-dynamo==1.6.1"
