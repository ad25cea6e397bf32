"""Tools around the recipes that are not recipes themselves.

    python tools/estimate_memory.py --model_preset 1b --gpu_memory_gb 80   # which memory technique fits a model
    bash tools/lent_gpu.sh --wheels                                         # the GPU suite on a lent GPU machine
"""
