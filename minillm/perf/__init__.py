"""Performance models and timers: the roofline and its calculators, median wall-clock timing, GPU kernel
timing (CUDA events), and memory measurement."""
