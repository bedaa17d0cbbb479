"""The course around the library: benchmarks, figures, the quiz, notebook helpers, result views, the demo
and the labs. The inference library imports none of it."""
