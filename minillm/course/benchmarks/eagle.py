"""Lesson 08: an EAGLE draft head for SmolLM2, trained here on text SmolLM2 writes itself, and its acceptance
by draft position against the other drafts.

    data        SmolLM2 answers prompts built from topics and templates (half greedy, half at T = 0.8) through
                the engine; the speculation benchmark's prompts are held out
    train       speculative.eagle.train_head: the curve (losses, teacher-forced top-1) per logged step
    acceptance  along SmolLM2's greedy continuation of held-out prompts (what greedy speculation verifies),
                every few positions: how often the first j drafts are all accepted, j = 1 .. K, for the EAGLE
                head, n-gram lookup, the bf16 copy ("draft") and the layer-skipping self-draft ("layerskip")

The head is saved under ~/.cache/minillm (speculative.eagle.save_head) for the engine to load.
"""
from __future__ import annotations

import time

import torch

from minillm.engine.sampling import SamplingParams
from minillm.evaluate import calibration_text
from minillm.speculative.core import NgramDraft, draft_model
from minillm.speculative.eagle import HeadConfig, default_head_path, save_head, target_features, train_head
from minillm.stages.kv_cache import generate_greedy
from .common import document
from .speculative import BATCH1_PROMPTS, PROMPTS

NAME = "eagle"
K = 5                                   # drafts per round measured

TOPICS = ["the ocean", "volcanoes", "a city at night", "learning to cook", "the history of bread", "black holes",
          "bees", "a rainy day", "friendship", "trains", "chess", "mountains", "recycling", "the internet",
          "dinosaurs", "music", "gardening", "winter", "electricity", "birds", "a library", "robots", "coffee",
          "the desert", "rivers", "photography", "football", "clouds", "computers", "forests", "bicycles", "maps",
          "glass", "sleep", "airports", "honey", "bridges", "the printing press", "penguins", "tea", "the moon",
          "earthquakes", "a farm", "saving money", "the human heart", "rainbows", "ants", "a job interview", "knitting",
          "the Roman empire", "solar panels", "whales", "a birthday party", "mathematics", "the immune system",
          "paper", "a lighthouse", "elections", "spiders", "the weather", "painting", "the stock market", "camping",
          "vaccines", "castles", "a hospital", "wind", "the post office", "video games", "salt"]
TEMPLATES = ["Write a short story about {}.", "Explain {} to a child.", "Give three facts about {}.",
             "Describe {} in a few sentences.", "Write a Python function related to {}, with a docstring.",
             "What are the pros and cons of {}?"]


def training_prompts(quick: bool) -> list[str]:
    topics = TOPICS[:8] if quick else TOPICS
    return [t.format(x) for x in topics for t in TEMPLATES]


def held_out_prompts() -> dict[str, str]:
    """The speculation benchmark's prompts (none of them is a training prompt)."""
    return {"qa": PROMPTS["qa"], "creative": PROMPTS["creative"], "copy": BATCH1_PROMPTS["copy"][0],
            "code": BATCH1_PROMPTS["code"][0]}


def continuation_prompts(llm, n: int, length: int = 48) -> list[list[int]]:
    """n windows of `length` tokens from evaluate.calibration_text() (Python's docs, never used for perplexity),
    for the target to continue as plain text."""
    ids = llm.tokenizer.encode(calibration_text())
    step = max(length, (len(ids) - length) // n)
    return [ids[i:i + length] for i in range(0, len(ids) - length, step)][:n]


def self_generated(llm, prompts: list[str], continuations: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Prompt + answer token ids: chat prompts and plain-text continuations, half answered greedily, half
    sampled at T = 0.8 (a sequence's own seed)."""
    chats = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]   # text
    requests = [{"prompt": c} for c in chats] + [{"prompt_token_ids": c} for c in continuations]
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, max_tokens=max_tokens, seed=i)
              for i in range(len(requests))]
    outs = llm.generate(requests, params, use_tqdm=False)
    seqs = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
    return [seqs[i] for i in torch.randperm(len(seqs), generator=torch.Generator().manual_seed(0)).tolist()]


def accepted_prefix(drafts: list[int], want: list[int]) -> int:
    n = 0
    while n < min(len(drafts), len(want)) and drafts[n] == want[n]:
        n += 1
    return n


@torch.no_grad()
def acceptance(llm, head, quick: bool) -> list[dict]:
    """Per held-out prompt and draft: P(first j drafts accepted), j = 1 .. K, along the greedy continuation."""
    model = llm.model
    drafts = {"eagle": None, "ngram": NgramDraft(), "draft": draft_model(model, "draft"),
              "layerskip": draft_model(model, "layerskip")}
    rows, every = [], 4 if quick else 2
    for kind, text in held_out_prompts().items():
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=32 if quick else 64), use_tqdm=False)[0]
        context, cont = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
        tokens = context + cont
        features = target_features(model, torch.tensor([tokens]))[0]           # (L, dim)
        positions = range(0, len(cont) - K, every)
        for name, drafter in drafts.items():
            hits = [0] * (K + 1)
            for t in positions:
                end = len(context) + t                                            # tokens[:end] are known
                if name == "eagle":
                    guess = head.propose(features[:end - 1], tokens[:end], K)
                elif name == "ngram":
                    guess, _ = drafter.propose(tokens[:end], K, None, None)
                else:
                    guess = generate_greedy(drafter, [tokens[:end]], K)[0]
                for j in range(accepted_prefix(guess, cont[t:t + K]) + 1):
                    hits[j] += 1
            n = len(positions)
            rows.append({"part": "acceptance", "prompt": kind, "draft": name, "positions": n,
                         **{f"p_first_{j}": hits[j] / n for j in range(1, K + 1)},
                         "mean_accepted": sum(hits[1:]) / n})
    return rows


def run(quick: bool) -> dict:
    from minillm import LLM

    llm = LLM(model="smollm2", dtype="float32", device="cpu")
    t0 = time.perf_counter()
    sequences = self_generated(llm, training_prompts(quick), continuation_prompts(llm, 16 if quick else 800),
                               64 if quick else 160)
    generate_s = time.perf_counter() - t0
    config = HeadConfig(steps=20 if quick else 1000, batch=6)
    head, curve = train_head(llm.model, sequences, config)
    path = default_head_path()
    save_head(head, path)
    results = [{"part": "train", **row} for row in curve] + acceptance(llm, head, quick)
    by_draft = {}
    for r in results:
        if r["part"] == "acceptance":
            by_draft.setdefault(r["draft"], []).append(r["mean_accepted"])
    summary = {"training_tokens": sum(len(s) for s in sequences), "generate_seconds": generate_s,
               "train_seconds": curve[-1]["seconds"], "draft_vocab_coverage": head.coverage,
               "final_top1_next_token": curve[-1]["top1_next_token"],
               "final_held_out_top1": curve[-1]["held_out_top1"],
               "mean_accepted_of_5": {name: sum(v) / len(v) for name, v in by_draft.items()},
               "saved": str(path)}
    cfg = {"head": config.__dict__, "draft_tokens_measured": K, "held_out": list(held_out_prompts())}
    return document(NAME, cfg, results, summary)
