"""The engine: requests, the scheduler, the step loop, sampling and output processing (lesson 07)."""
