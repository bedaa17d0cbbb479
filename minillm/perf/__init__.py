"""Performance models and timers: the roofline and its calculators, and median timing."""
