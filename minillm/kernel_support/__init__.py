"""What a Triton kernel in kernels/ shares with the PyTorch code that launches it: argument checks and tile
choice. These modules import nothing of minillm, so importing a kernel does not import the engine."""
