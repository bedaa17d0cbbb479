"""A model big enough for decode to be bandwidth-bound: Llama-3.2-1B's shape, random weights, bf16.

SmolLM2-135M's 269 MB of bf16 weights stream in a few milliseconds, so its decode step is mostly fixed
costs (dispatch, launches, small ops). At 1.24 B parameters (2.47 GB in bf16) a step must read far more
than any cache holds, and lesson 01's bound, tokens/s <= bandwidth / bytes read per token, is what decides.
One run, on this CPU, the same weights everywhere:

  bound          the read bandwidth measured during the run (roofline.BandwidthProbe, its fastest sample:
                 torch's own read, a lower estimate of what the memory can do) / the bytes a decode step
                 reads (roofline.weight_bytes_read: every weight once, the tied LM head included, the
                 embedding's one row not). Each system's effective GB/s (tokens/s x bytes it reads per
                 token) and fraction of the measured bandwidth are reported beside it.
  minillm        LLM.generate, one prompt, bf16 (the engine's compiled decode step) and int4 (RTN, the CPU
                 int4 kernels: the bytes read shrink about 4x)
  transformers   LlamaForCausalLM with the same weights (gpu_engine.hf_twin), its own KV cache, bf16
  llama.cpp      llama-cpp-python on a GGUF of the same bf16 weights (written with the gguf package), in its
                 own virtual environment, made by this benchmark on first use (never by `make test`)
  engine         minillm at 16 and 64 rows: the median decode-only step of the engine (bench engine-step's
                 measure) and its tokens/s

Each batch-1 system decodes the same 32-token prompt greedily (NEW_TOKENS tokens), a warm-up run first,
then ROUNDS rounds in turn (llama.cpp as a worker process holding its model); decode tokens/s is counted
after the first token (the prompt's prefill is not decode). The bandwidth probe samples between systems.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from minillm.model.llama import random_model_on
from minillm.perf import roofline
from .common import document
from .gpu_engine import IdsTokenizer, hf_twin

NAME = "decode-1b"
SHAPE = "llama3.2-1b"
NEW_TOKENS = 32
PROMPT_TOKENS = 32
ROUNDS = 5
ENGINE_ROWS = (16, 64)
LLAMA_CPP = "llama-cpp-python==0.3.16"
PEER_VENV = Path.home() / ".cache" / "minillm" / "peers" / "llama-cpp"

# run in the peer's own interpreter: load the GGUF once, then one greedy decode per line on stdin, each
# answered with one JSON line (the per-token times are taken as the tokens come)
LLAMA_CPP_WORKER = r"""
import json, sys, time
from llama_cpp import Llama
path, prompt, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
llm = Llama(model_path=path, n_ctx=512, n_threads=2, n_threads_batch=2, n_batch=64, verbose=False)
print(json.dumps({"ready": True}), flush=True)
for _ in sys.stdin:
    stamps, tokens = [], []
    for tok in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        stamps.append(time.perf_counter()); tokens.append(int(tok))
        if len(tokens) == n:
            break
    print(json.dumps({"decode_tok_s": (n - 1) / (stamps[-1] - stamps[0]), "tokens": tokens}), flush=True)
"""


def prompt_ids(cfg, n: int = PROMPT_TOKENS) -> list[int]:
    return torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()


def minillm_decode(llm, prompt: list[int]) -> dict:
    from minillm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return {"decode_tok_s": 1 / out.metrics.time_per_output_token, "tokens": list(out.outputs[0].token_ids)}


@torch.no_grad()
def transformers_decode(hf, prompt: list[int]) -> dict:
    """Greedy with transformers' own KV cache: one forward for the prompt, then one per token."""
    from transformers import DynamicCache

    cache = DynamicCache()
    logits = hf(torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits[0, -1]
    tokens, stamps = [int(logits.argmax())], [time.perf_counter()]
    while len(tokens) < NEW_TOKENS:
        logits = hf(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True).logits[0, -1]
        tokens.append(int(logits.argmax()))
        stamps.append(time.perf_counter())
    return {"decode_tok_s": (NEW_TOKENS - 1) / (stamps[-1] - stamps[0]), "tokens": tokens}


def engine_rows(llm, prompt: list[int], rows: int) -> dict:
    """rows copies of the prompt decoding together: the median decode-only step and rows / that step."""
    from minillm import SamplingParams

    llm.engine.step_log.clear()
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS // 2, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}] * rows, params, use_tqdm=False)
    steps = [s["seconds"] for s in llm.engine.step_log if s["num_decodes"] == s["num_seqs"] == s["num_tokens"] == rows]
    step = statistics.median(steps)
    return {"rows": rows, "step_ms": 1e3 * step, "tok_s": rows / step, "steps": len(steps)}


def write_gguf(model, path: Path) -> None:
    """model's bf16 weights as a llama-architecture GGUF (q/k rows already interleaved, as llama.cpp's
    converter writes Llama files; the norms' vectors as F32, the same values), with a stand-in vocabulary
    of the model's size (prompts are ids)."""
    import gguf
    import numpy as np

    cfg = model.cfg
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.max_seq_len)
    w.add_embedding_length(cfg.dim)
    w.add_feed_forward_length(cfg.ffn_dim)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    byte_chars = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["!!"]
    tokens = byte_chars + [f"<t{i}>" for i in range(cfg.vocab_size - len(byte_chars))]
    w.add_token_list(tokens)
    w.add_token_types([1] * cfg.vocab_size)
    w.add_token_merges(["! !"])                  # one merge: readers want the list present
    w.add_eos_token_id(cfg.vocab_size - 1)
    names = {"attn_norm": "attn_norm.weight", "ffn_norm": "ffn_norm.weight", "attn_q": "attn.wq.weight",
             "attn_k": "attn.wk.weight", "attn_v": "attn.wv.weight", "attn_output": "attn.wo.weight",
             "ffn_gate": "ffn.w_gate.weight", "ffn_up": "ffn.w_up.weight", "ffn_down": "ffn.w_down.weight"}
    state = {k: v.detach() for k, v in model.state_dict().items()}
    tensors = {"token_embd.weight": state["embed.weight"], "output_norm.weight": state["norm.weight"]}
    for i in range(cfg.n_layers):
        tensors.update({f"blk.{i}.{g}.weight": state[f"layers.{i}.{m}"] for g, m in names.items()})
    for name, t in tensors.items():
        if t.dim() == 1:                                # norms: F32, as llama.cpp's converter writes them
            w.add_tensor(name, t.float().numpy())
            continue
        bits = t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
        w.add_tensor(name, bits, raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def peer_python() -> Path:
    """The llama.cpp peer's interpreter, its venv created (and llama-cpp-python built, minutes) on first use."""
    python = PEER_VENV / "bin" / "python"
    if not python.exists():
        print(f"decode-1b: making {PEER_VENV} with {LLAMA_CPP} (builds llama.cpp: several minutes)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", LLAMA_CPP], check=True)
    return python


class LlamaCpp:
    """The llama.cpp peer as a worker process in its own venv: the GGUF loaded once, one decode per call."""

    def __init__(self, path: Path, prompt: list[int]):
        self.proc = subprocess.Popen([str(peer_python()), "-c", LLAMA_CPP_WORKER, str(path), json.dumps(prompt),
                                      str(NEW_TOKENS)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._answer()

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the llama.cpp worker stopped (exit code {self.proc.wait()})")
        return json.loads(line)

    def __call__(self) -> dict:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def bytes_read_per_token(model) -> int:
    """Bytes a decode step reads: every parameter and buffer (an int4 model's packs and scales included),
    less the input embedding where a separate LM head is read instead (a lookup reads one row)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()       # fused views count once
                for t in [*model.parameters(), *model.buffers()]}
    total = sum(storages.values())
    return total - (model.embed.weight.nbytes if model.lm_head is not None else 0)


def run(quick: bool, json_path: str | None = None) -> dict:
    from minillm import LLM

    cfg = roofline.PUBLISHED[SHAPE]
    rounds = 1 if quick else ROUNDS
    probe = roofline.BandwidthProbe()
    prompt = prompt_ids(cfg)
    rows, samples = [], {}
    model = random_model_on(cfg, "cpu", torch.bfloat16)
    llm = LLM(model=model, tokenizer=IdsTokenizer(), device="cpu", max_model_len=512, max_num_seqs=max(ENGINE_ROWS))
    hf = hf_twin(model)
    gguf_path = Path(json_path or "results/decode-1b.json").with_suffix(".gguf")
    write_gguf(model, gguf_path)
    llama_cpp = LlamaCpp(gguf_path, prompt)
    systems = {"minillm bf16": lambda: minillm_decode(llm, prompt), "transformers bf16": lambda: transformers_decode(hf, prompt),
               "llama.cpp bf16": llama_cpp}
    try:
        for name, fn in systems.items():                                # warm-up: compiles, page faults
            fn()
        for r in range(rounds):                                         # in turn, the probe between them
            for name, fn in systems.items():
                probe.sample()
                samples.setdefault(name, []).append(fn())
    finally:
        llama_cpp.close()
    probe.sample()
    engine = [engine_rows(llm, prompt, n) for n in ENGINE_ROWS]
    del hf
    bf16_bytes = bytes_read_per_token(llm.model)
    llm4 = LLM(model=random_model_on(cfg, "cpu", torch.bfloat16), tokenizer=IdsTokenizer(), device="cpu",
               max_model_len=512, quantization="int4")
    minillm_decode(llm4, prompt)
    samples["minillm int4"] = [minillm_decode(llm4, prompt) for _ in range(rounds)]
    int4_bytes = bytes_read_per_token(llm4.model)
    probe.sample()
    gguf_path.unlink()                                                  # 2.5 GB: not a result
    bandwidth = probe.best
    bound = bandwidth / roofline.weight_bytes_read(cfg, 2)
    for name, runs in samples.items():
        tok_s = statistics.median(r["decode_tok_s"] for r in runs)
        read = int4_bytes if "int4" in name else bf16_bytes
        rows.append({"system": name, "decode_tok_s": tok_s, "all_decode_tok_s": [r["decode_tok_s"] for r in runs],
                     "bytes_read_per_token": read, "effective_gb_s": tok_s * read / 1e9,
                     "fraction_of_bound": tok_s * read / bandwidth, "tokens": runs[-1]["tokens"]})
    by = {r["system"]: r for r in rows}
    summary = {
        "bandwidth_gb_s": bandwidth / 1e9, "bandwidth_samples_gb_s": [s / 1e9 for s in probe.samples],
        "weight_gb_read_per_token_bf16": roofline.weight_bytes_read(cfg, 2) / 1e9, "bound_tok_s_bf16": bound,
        **{f"{name.replace(' ', '_').replace('.', '')}_tok_s": r["decode_tok_s"] for name, r in by.items()},
        **{f"{name.replace(' ', '_').replace('.', '')}_fraction_of_bound": r["fraction_of_bound"] for name, r in by.items()},
        **{f"{name.replace(' ', '_').replace('.', '')}_effective_gb_s": r["effective_gb_s"] for name, r in by.items()},
        "bytes_read_per_token_bf16": bf16_bytes, "bytes_read_per_token_int4": int4_bytes,
        "minillm_vs_transformers": by["minillm bf16"]["decode_tok_s"] / by["transformers bf16"]["decode_tok_s"],
        "minillm_vs_llama_cpp": by["minillm bf16"]["decode_tok_s"] / by["llama.cpp bf16"]["decode_tok_s"],
        "int4_vs_bf16_speed": by["minillm int4"]["decode_tok_s"] / by["minillm bf16"]["decode_tok_s"],
        "bf16_vs_int4_bytes": bf16_bytes / int4_bytes,
        "greedy_tokens_equal_minillm_transformers": by["minillm bf16"]["tokens"] == by["transformers bf16"]["tokens"],
        **{f"engine_{e['rows']}_rows_tok_s": e["tok_s"] for e in engine},
        **{f"engine_{e['rows']}_rows_step_ms": e["step_ms"] for e in engine},
    }
    config = {"shape": SHAPE, "parameters": cfg.num_parameters(), "dtype": "bfloat16", "prompt_tokens": PROMPT_TOKENS,
              "new_tokens": NEW_TOKENS, "rounds": rounds, "warm_up": "one untimed run per system",
              "llama_cpp": LLAMA_CPP, "engine_rows": list(ENGINE_ROWS),
              "engine_new_tokens": NEW_TOKENS // 2, "threads": torch.get_num_threads()}
    return document(NAME, config, rows + [{"system": "engine", **e} for e in engine], summary)
