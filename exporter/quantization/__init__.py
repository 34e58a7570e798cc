"""Every way weights become integers, in one place: the plan (plan.py: what an export quantises and why, resolved
once), the input readers (pre-quantised checkpoints, GGUF blocks) and the passes (RTN, HQQ, AutoRound, float
offsets, exact blocks, the experts' int4, the int8 KV cache). Generic exporter modules import only the plan."""
