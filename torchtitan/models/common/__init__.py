"""What the model families share: the spec (the contract with the rest of torchtitan), the shared
layers (attention kernels and masks, norms, SwiGLU, rotary), the decoder, the mixture-of-experts
block, layout-invariant init, the Hugging Face conversion helpers and the standard decoder TP plan.

It sits below torchtitan.distributed (which imports nothing of models/ but this package); the
families sit above everything, and nothing outside models/ imports a family (tests/test_model_boundaries.py).
"""
