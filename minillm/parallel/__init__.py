"""One model over several processes with torch.distributed (lesson 11).

    tensor.py     tensor parallelism: column/row-parallel linears, vocabulary-parallel embedding
                  and LM head, heads and their KV cache split across ranks
    pipeline.py   pipeline parallelism: contiguous layer stages, send/recv, GPipe micro-batches
    comm.py       the collectives, wrapped so every byte sent is counted
    workers.py    starting, driving and stopping the ranks (spawned, or under torchrun)
    launch.py     run a function on N fresh ranks (tests, benchmarks, notebook)
    calculator.py time per token in compute, weight reads and communication on real hardware

LLM(model, tensor_parallel_size=N) or LLM(model, pipeline_parallel_size=M) uses workers.start.
"""
