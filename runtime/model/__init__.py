"""The model execution layer: the fused decoder, its KV cache, compiled passes and CUDA graphs."""
