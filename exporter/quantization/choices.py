"""The values quantisation options take, and the bounds its defaults use: a leaf module, so that the plan
(plan.py) and the passes it calls (matmuls.py, ...) both read them without importing each other."""

BITS = {"int4": 4, "int8": 8}
# How the int4/int8 values are chosen, both ONNX Runtime's: "rtn" rounds each block to its nearest
# symmetric grid (DefaultWeightOnlyQuantConfig); "hqq" is Half-Quadratic Quantization
# (HQQWeightOnlyQuantConfig: asymmetric blocks, float zero points fitted by a proximal solver, no
# calibration data; needs torch). HQQ cannot quantise a Gather: the embedding stays fp32.
# "autoround": AutoRound's calibrated rounding (autoround.py: integer zero points, carried over as
# a pre-quantised checkpoint's integers are).
METHODS = ("rtn", "hqq", "autoround")
BLOCK_SIZES = (16, 32, 64, 128)
# ONNX Runtime's MatMulNBits accuracy_level 4: int8 activations in the dot products (its fastest CPU path).
DEFAULT_ACCURACY_LEVEL = 4
# ONNX Runtime's MatMulNBits accuracy levels on the CPU: the precision of its dot products' inputs.
ACCURACY_LEVELS = {1: "fp32", 2: "fp16", 3: "bf16", 4: "int8"}
# int4 on a model under this many parameters keeps its lm_head at 8 bits unless --lm-head-bits says
# otherwise: there the lm_head (vocab x hidden) is a large share of the weights and carries much of
# int4's cost. SmolLM2-135M-Instruct: perplexity +21.8% -> +13.3%, "What is the capital of France?"
# answered instead of rambling, decode 148 -> 137 tokens/s on 2 CPU cores, 89 -> 102 MB
# (docs/quantisation.md). The same bound picks the int4 method (plan.py _choose).
SMALL_MODEL_PARAMETERS = 1_000_000_000
# Where the integers come from (plan.py QuantPlan.origin).
ORIGINS = ("prequantized", "gguf", "autoround", "hqq", "rtn", "none")
DRAFT_LM_HEAD_BITS = (4, 8)  # --draft-lm-head-bits: a speculation head's lm_head as MatMulNBits (draft_lm_head.py)
