"""What the kernels share with the PyTorch code that launches them: for the Triton kernels in kernels/, argument
checks and tile choice; for the C kernels, their build and cache (c_library) and vector helpers (vec16.h).
Importing these modules imports nothing else of minillm (c_library.cache_path asks the loader for the cache folder
when called), so importing a kernel does not import the engine."""
