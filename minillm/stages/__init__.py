"""Teaching stages: one sequence on a contiguous cache, static batching, the per-request speculative loop
(lessons 02, 07, 08). The engine never runs them; tests hold the engine equal to them."""
