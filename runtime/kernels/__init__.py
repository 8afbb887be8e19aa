"""depctl's CPU kernels: the C++ ops (csrc/) and the surgery that swaps them into a loaded model."""
