"""Lesson 08: the EAGLE head inside the engine at batch 1, against plain decoding and every other draft.

LLM.generate of one request (the engine, a batch of one), greedy, on the held-out prompts of bench eagle
(none of them trained on) and the creative one sampled at T = 0.8. Modes run interleaved, a warm-up round
then REPS timed rounds; each row is one prompt x mode with the median. Needs the head `bench eagle` saves.

    plain             no drafts
    eagle k=N         the trained head, N drafts every step
    eagle adaptive    the head under the adaptive policy (speculative/engine.py), up to K_MAX drafts
    eagle tree N      NEW: the head's drafts as a static tree of N nodes verified in one step, the tree chosen
                      first (below), N drafts every step
    ngram / draft / layerskip adaptive: the other proposers under the same policy

Per row: tokens per second, speedup over plain, whether the tokens equal plain's, drafts proposed and
accepted, the acceptance by draft position (vllm:spec_decode_num_accepted_tokens_per_pos over the
verifications), and the drafter's own seconds per drafted token.

Choosing the tree (counted, before any timing): along SmolLM2's greedy continuation of TREE_PROMPTS (neither
the timed prompts nor training prompts), how often each node of CANDIDATES lies on the continuation (the head
drafting from the target's real features up to each position); the tree of N nodes keeps the N most often
right, each after its parent. Its sum is the expected number of drafts accepted per verification, which the
chain k=3 is compared with on the same positions.
"""
from __future__ import annotations

import statistics

import torch

from minillm.engine.sampling import SamplingParams
from minillm.speculative.eagle import EagleDraft, load_head, target_features
from .common import document, interleaved_generate
from .eagle import TEMPLATES, held_out_prompts

NAME = "eagle-engine"
K_MAX = 6
TREE_SIZES = (4, 7)                     # nodes of the trees timed (7: the most one small step verifies)
TREE_PROMPTS = [t.format(x) for x, t in zip(["the violin", "origami", "a snowstorm", "volunteering"], TEMPLATES)]
CANDIDATES = ((0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (0, 0, 0), (0, 0, 1),
              (0, 1, 0), (1, 0, 0), (0, 0, 0, 0))


def modes(quick: bool, trees: dict[int, tuple] | None = None) -> dict[str, dict]:
    adaptive = dict(num_speculative_tokens=K_MAX)
    out = {"plain": {},
           "eagle k=3": dict(speculative_method="eagle", num_speculative_tokens=3, speculative_policy="always"),
           "eagle adaptive": dict(speculative_method="eagle", **adaptive),
           "ngram adaptive": dict(speculative_method="ngram", **adaptive)}
    for n, tree in (trees or {}).items():
        out[f"eagle tree {n}"] = dict(speculative_method="eagle", num_speculative_tokens=n, speculative_token_tree=tree,
                                      speculative_policy="always")
    if not quick:
        out["draft adaptive"] = dict(speculative_method="draft", **adaptive)
        out["layerskip adaptive"] = dict(speculative_method="layerskip", **adaptive)
    return out


def workloads(quick: bool) -> list[tuple[str, str, float]]:
    prompts = held_out_prompts()
    rows = [(kind, text, 0.0) for kind, text in prompts.items()] + [("creative", prompts["creative"], 0.8)]
    return rows[1:2] + rows[-1:] if quick else rows


def _counts(llm) -> dict:
    spec = llm.engine.speculation
    if spec is None:
        return {"steps": len(llm.engine.step_log)}
    by_pos = [0] * spec.k
    for entry in llm.engine.step_log:
        for j, n in enumerate(entry["num_accepted_per_position"]):
            by_pos[j] += n
    return {"steps": len(llm.engine.step_log), "drafted": spec.drafted, "accepted": spec.accepted,
            "verifications": spec.verify_runs, "draft_seconds": spec.draft_seconds, "by_position": by_pos}


def _delta(after: dict, before: dict) -> dict:
    out = {"target_calls": after["steps"] - before["steps"]}
    if "drafted" in after:
        v = after["verifications"] - before["verifications"]
        drafted = after["drafted"] - before["drafted"]
        out.update(drafted=drafted, accepted=after["accepted"] - before["accepted"], verifications=v,
                   accepted_per_position=[(a - b) / v if v else 0.0
                                          for a, b in zip(after["by_position"], before["by_position"])],
                   draft_ms_per_token=1000 * (after["draft_seconds"] - before["draft_seconds"]) / drafted
                   if drafted else None)
    return out


@torch.no_grad()
def node_acceptance(llm, head, prompts: list[str], max_tokens: int, every: int) -> tuple[dict, int]:
    """How often each CANDIDATES node is right: its path equals the target's greedy continuation there, the head
    drafting from the target's real features (as in the engine after a verification). -> ({path: share of
    positions}, positions)."""
    hits, n = dict.fromkeys(CANDIDATES, 0), 0
    depth = max(map(len, CANDIDATES))
    for text in prompts:
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)[0]
        tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        features = target_features(llm.model, torch.tensor([tokens]))[0]             # (L, dim)
        for end in range(len(out.prompt_token_ids), len(tokens) - depth, every):     # tokens[:end] known
            draft = EagleDraft(head)
            draft.add_features(0, features[:end - 1])
            drafted, parents = draft.propose_tree(tokens[:end], CANDIDATES)
            right = []                                                               # parents come first
            for path, token, parent in zip(CANDIDATES, drafted, parents):
                right.append(token == tokens[end + len(path) - 1] and (parent < 0 or right[parent]))
                hits[path] += right[-1]
            n += 1
    return {path: h / n for path, h in hits.items()}, n


def best_tree(share: dict, nodes: int) -> tuple:
    """The `nodes` paths most often right, each taken only after its parent (a tree)."""
    chosen = []
    while len(chosen) < nodes:
        ready = [p for p in share if p not in chosen and (len(p) == 1 or p[:-1] in chosen)]
        chosen.append(max(ready, key=lambda p: (share[p], -len(p))))
    return tuple(sorted(chosen, key=lambda p: (len(p), p)))


def run(quick: bool) -> dict:
    from minillm import LLM

    base = LLM(model="smollm2", dtype="float32", device="cpu")
    tok = base.get_tokenizer()
    max_tokens, reps = (24, 1) if quick else (96, 3)
    share, positions = node_acceptance(base, load_head(base.model), TREE_PROMPTS[:1] if quick else TREE_PROMPTS,
                                       32 if quick else 96, 4 if quick else 1)
    trees = {n: best_tree(share, n) for n in TREE_SIZES}
    llms = {mode: LLM(model=base.model, tokenizer=tok, max_model_len=base.max_model_len, **kw)
            for mode, kw in modes(quick, trees).items()}
    rows = []
    for kind, text, temperature in workloads(quick):
        prompt = tok.apply_chat_template([{"role": "user", "content": text}])
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=0)
        times, last = interleaved_generate(llms, prompt, params, reps, _counts)
        outputs = {mode: (tokens, _delta(_counts(llms[mode]), before)) for mode, (tokens, before) in last.items()}
        plain = statistics.median(times["plain"])
        for mode in llms:
            tokens, counts = outputs[mode]
            median = statistics.median(times[mode])
            rows.append({"kind": kind, "temperature": temperature, "mode": mode, "tokens": len(tokens),
                         "seconds": median, "all_seconds": times[mode], "tokens_per_s": len(tokens) / median,
                         "speedup": plain / median, "same_tokens_as_plain": tokens == outputs["plain"][0], **counts})
    summary = {"speedup": {f"{r['kind']} T={r['temperature']} {r['mode']}": round(r["speedup"], 3) for r in rows},
               "greedy_tokens_equal_plain": all(r["same_tokens_as_plain"] for r in rows if r["temperature"] == 0),
               "eagle_mean_accepted_per_position": {
                   f"{r['kind']} T={r['temperature']}": [round(p, 3) for p in r["accepted_per_position"]]
                   for r in rows if r["mode"] == "eagle adaptive"},
               "tree_choice": {"positions": positions,
                               "node_share": {str(p): round(v, 4) for p, v in share.items()},
                               "expected_accepted_chain_k3": round(sum(share[(0,) * d] for d in (1, 2, 3)), 4),
                               **{f"expected_accepted_tree_{n}": round(sum(share[p] for p in t), 4)
                                  for n, t in trees.items()},
                               **{f"tree_{n}": [list(p) for p in t] for n, t in trees.items()}}}
    config = {"max_tokens": max_tokens, "reps": reps, "k_max": K_MAX, "modes": list(llms), "dtype": "float32",
              "tree_prompts": TREE_PROMPTS,
              "note": "batch 1, LLM.generate, modes interleaved per round, medians of the timed rounds"}
    return document(NAME, config, rows, summary)
