"""Loading a checkpoint: the GGUF reader, the loader of model families and the tokenizer (lessons 01, 03)."""
