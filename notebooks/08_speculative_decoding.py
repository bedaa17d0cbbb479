# %% [markdown]
# # 08 · Speculative decoding — guess cheaply, verify in one forward
#
# *Speculative Decoding 是什么？小模型和大模型怎么配合？ · 为什么不会损失精度？*
#
# A draft proposes `k` tokens; the target scores all of them in **one** forward pass and keeps the
# longest prefix its rejection rule accepts, plus one token of its own. Every target call therefore
# yields between 1 and `k + 1` tokens, and the output is distributed **exactly** as plain sampling
# from the target. This notebook builds the greedy rule by hand, shows the sampling rule on a 10-token
# vocabulary, then runs the three drafts
# of `minillm/speculative/core.py` on SmolLM2-135M and reads the full benchmark
# (`results/speculative.json`).
#
# Set `MINILLM_QUICK=1` for a CI-sized run; on a GPU the same cells run on `cuda`.

# %%
import json, time
from pathlib import Path
import torch
import matplotlib.pyplot as plt
# %matplotlib inline

from minillm.speculative.core import rejection_sample, acceptance_probability, SpecStats, make_draft
from minillm.course.calculators import expected_speedup, expected_tokens_per_call
from minillm.stages.speculative_loop import speculative_stream    # lesson 08's per-request loop (a teaching stage)
from minillm.course.notebook import start
from minillm.stages.reference import stream_contiguous
device, QUICK = start()                        # cuda when present; prints the machine

# %% [markdown]
# ## 1. Greedy verification, by hand
#
# At temperature 0 the rule is plain: the target's argmax at each drafted position is what greedy decoding
# would emit there. Keep the leading drafted tokens that equal it; at the first mismatch emit the target's
# own token instead and drop the rest, even a later guess that happens to match. If all `k` match, the
# target's choice one past them comes free (the bonus token). Below, by hand on made-up logits, then
# against `minillm.speculative.core.greedy_verify`; edit `draft` and re-run.

# %%
from minillm.speculative.core import greedy_verify
gen = torch.Generator().manual_seed(1)
V, k = 10, 4
target_logits = torch.randn(k + 1, V, generator=gen)       # the target's logits at the k drafted positions + 1
choice = target_logits.argmax(-1).tolist()                 # what plain greedy decoding would emit at each
draft = choice[:2] + [(choice[2] + 1) % V, choice[3]]      # right, right, wrong, right but too late
accepted = 0
while accepted < k and draft[accepted] == choice[accepted]:    # leading matches only
    accepted += 1
emitted = draft[:accepted] + [choice[accepted]]            # the target's token: a correction, or the bonus
print(f"draft {draft}   target argmax {choice}   accepted {accepted}, emitted {emitted}")
tokens, num_accepted = greedy_verify(torch.tensor([draft]), target_logits[None])
print("by hand vs greedy_verify, identical:", emitted == tokens[0, :num_accepted[0] + 1].tolist())

# %% [markdown]
# ![One greedy speculative run: drafted, accepted, rejected and added tokens per verification step](../lessons/figures/speculative_timeline.png)
#
# *A real run of SmolLM2 with a prompt-lookup draft: every target forward keeps the accepted guesses and adds one token of its own.*

# %% [markdown]
# ## 2. The rule, on a 10-token vocabulary
#
# Draft token `d ~ q` is accepted with probability `min(1, p(d)/q(d))`; after a rejection the target
# samples from `norm(max(0, p - q))`. Summing both ways of emitting `x`:
#
# `P(x) = min(p(x), q(x)) + (1 - Σ min(p, q)) · max(0, p(x) - q(x)) / (1 - Σ min(p, q)) = p(x)`.
#
# Below: `100_000` rounds with `k = 3`, a random target `p` and a draft `q` that also puts mass on
# tokens the target never emits. The histogram of the first emitted token sits on `p`, not on `q`.

# %%
gen = torch.Generator().manual_seed(0)
V, k, n = 10, 3, 20_000 if QUICK else 100_000
p = (1.5 * torch.randn(V, generator=gen)).softmax(-1)
p[:3] = 0; p /= p.sum()                               # the target never emits tokens 0, 1, 2
q = (1.5 * torch.randn(V, generator=gen)).softmax(-1)
q[:2] += 0.2; q /= q.sum()                            # ... but the draft likes 0 and 1
drafts = torch.multinomial(q, n * k, replacement=True, generator=gen).view(n, k)       # (n, k)
tokens, accepted = rejection_sample(drafts, q.expand(n, k, V), p.expand(n, k + 1, V), gen)
hist = torch.bincount(tokens[:, 0], minlength=V).float() / n
x = torch.arange(V)
plt.figure(figsize=(7, 2.8))
plt.bar(x - 0.27, q, width=0.27, label="draft q")
plt.bar(x, p, width=0.27, label="target p")
plt.bar(x + 0.27, hist, width=0.27, label="speculative output")
plt.xticks(x); plt.legend(); plt.title("first emitted token over %d rounds" % n); plt.show()
alpha = float(acceptance_probability(p, q))
print(f"max |output - p| = {float((hist - p).abs().max()):.4f}   alpha = sum min(p, q) = {alpha:.3f}")
print(f"first draft accepted: {float((accepted >= 1).float().mean()):.3f}   "
      f"tokens per target call: {float((accepted + 1).float().mean()):.3f} "
      f"(theory {expected_tokens_per_call(alpha, k):.3f})")

# %% [markdown]
# ## 3. How much can it give? `(1 - α^(k+1)) / (1 - α)` tokens per call
#
# With per-token acceptance probability `α` and `k` guesses a target call yields
# `1 + α + … + α^k` tokens. The speedup divides that by the cost of a round, `k·c + 1` target-step
# times, where `c` is the draft's step time relative to the target's (Leviathan et al.). The article's
# "speedup = accepted + 1" is the tokens per call, not the speedup. A draft that costs as much as the target
# (`c ≈ 1`) can never win, however good its guesses.

# %%
ks = range(1, 9)
fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.2))
for a in (0.5, 0.7, 0.8, 0.9, 0.97):
    a1.plot(ks, [expected_tokens_per_call(a, kk) for kk in ks], "-o", ms=3, label=f"alpha={a}")
for c in (0.0, 0.05, 0.2, 0.5, 1.0):
    a2.plot(ks, [expected_speedup(0.8, kk, c) for kk in ks], "-o", ms=3, label=f"c={c}")
a1.set(xlabel="k", ylabel="tokens per target call"); a1.legend(fontsize=7)
a2.axhline(1, color="k", lw=0.8); a2.set(xlabel="k", ylabel="speedup at alpha=0.8"); a2.legend(fontsize=7)
plt.tight_layout(); plt.show()

# %% [markdown]
# ## 4. The real model: three drafts, greedy output identical to plain decoding
#
# The prompt asks SmolLM2-135M-Instruct to fix the spelling of a paragraph: an *input-grounded*
# task, where most of the answer is copied from the prompt. `ngram` (prompt lookup) needs no model;
# `draft` is a bfloat16 copy of the target; `layerskip` is the target with four middle layers
# skipped. At temperature 0 every draft must reproduce plain greedy decoding token for token.

# %%
from minillm import LLM, SamplingParams
llm = LLM(model="smollm2", dtype="float32", device=device)
tok = llm.get_tokenizer()
PARAGRAPH = ("The old lighthouse stood on the edge of the cliff for more then two hundred years. Every night "
             "its lamp turned slowly, and ships that past the rocks trusted it's light to guide them home. In "
             "the winter storms the keeper climbed the stairs evry hour to clean the glass and trim the wick.")
ask = "Fix the spelling mistakes in this paragraph and return the corrected paragraph:\n\n" + PARAGRAPH
prompt = tok.apply_chat_template([{"role": "user", "content": ask}])
params = SamplingParams(temperature=0, max_tokens=12 if QUICK else 40, ignore_eos=True)

def plain(prompt, params):
    (req,) = llm.make_requests([prompt], params)
    t0 = time.perf_counter(); text = "".join(stream_contiguous(llm, req))   # the same contiguous stage
    return req, time.perf_counter() - t0

def spec(prompt, params, method, k):
    (req,) = llm.make_requests([prompt], params)
    stats, draft = SpecStats(), make_draft(llm.model, method)
    t0 = time.perf_counter(); text = "".join(speculative_stream(llm, req, method, k, stats, draft))
    return req, time.perf_counter() - t0, stats

plain(prompt, SamplingParams(temperature=0, max_tokens=2))          # warm-up
base, t_plain = plain(prompt, params)
print(repr(base.text))
print(f"plain: {t_plain:.2f} s")
for method in ("ngram", "draft", "layerskip"):
    out, t, st = spec(prompt, params, method, 4)
    print(f"{method:9s} k=4: identical={out.output_token_ids == base.output_token_ids}  "
          f"acceptance={st.acceptance_rate:.2f}  tokens/call={st.tokens_per_call:.2f}  "
          f"time={t:.2f} s  speedup={t_plain / t:.2f}x")

# %% [markdown]
# ## 5. Sampling: the same request distribution, a lower acceptance rate
#
# At temperature > 0 the target's `p` and the draft's `q` are the *filtered* distributions
# (temperature, top-k, top-p): exactly what plain sampling would draw from. A seeded request
# reproduces. Hotter sampling spreads `p` and `q`, so `Σ min(p, q)` falls: fewer guesses survive.

# %%
for temperature in (0.7, 1.0):
    sampled = SamplingParams(temperature=temperature, max_tokens=12 if QUICK else 40, ignore_eos=True, seed=0)
    out, t, st = spec(prompt, sampled, "draft", 4)
    again, _, _ = spec(prompt, sampled, "draft", 4)
    print(f"T={temperature}: acceptance={st.acceptance_rate:.2f} tokens/call={st.tokens_per_call:.2f} "
          f"seeded rerun identical={out.output_token_ids == again.output_token_ids}")

# %% [markdown]
# ## 6. The full benchmark
#
# `python -m minillm bench speculative --json results/speculative.json` measures every draft at
# k = 1..8, temperatures 0 / 0.7 / 1.0[^temps] and three prompt kinds. The cells below read its committed
# result (they do not rerun it).
#
# [^temps]: measured in results/speculative.json: config.temperatures[1]; config.temperatures[2]

# %%
path = Path("../results/speculative.json")
doc = json.loads(path.read_text()) if path.exists() else None
if doc:
    print(doc["machine"])
    for row in doc["summary"]["draft_choice"]:
        print("  ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
    s = doc["summary"]
    print("\nbest greedy speedup on the grounded prompt:", round(s["best_speedup_greedy_grounded"], 2),
          s["best_greedy_grounded"])
    print(f"\n{'kind':>9} {'temp':>4} {'method':>10} {'k':>2} {'accepted':>8} {'tok/call':>8} {'speedup':>7}")
    for r in doc["results"]:
        if r["k"] in (1, 4, 8):
            print(f"{r['kind']:>9} {r['temperature']:4.1f} {r['method']:>10} {r['k']:2d} {r['acceptance_rate']:8.3f} "
                  f"{r['tokens_per_call']:8.2f} {r['speedup']:7.2f}")
else:
    print("results/speculative.json not found: run the benchmark first")

# %%
from IPython.display import Image, display
for name in ("speculative.png", "speculative-speedup.png"):
    if Path("../results", name).exists():
        display(Image(filename=str(Path("../results", name))))

# %% [markdown]
# **Reading it.** Prompt lookup is the only draft that pays on this CPU, and only where the
# answer copies the prompt. The bfloat16 copy guesses almost perfectly but costs as much per step
# as the target here (`c ≈ 1`), so every extra guess is pure cost. Skipping layers of a 135M model
# loses agreement fast. Hot sampling and creative prompts lower acceptance for every draft: the
# article's pitfall 4. This is about these drafts on this CPU, not about model drafts: on GPUs, drafts that cost a
# few per cent of a target step (EAGLE's one-layer head on the target's features, DeepSeek-V3's MTP module) reach
# 2-3x[^learned]. Under load, each request's KV cache keeps the step memory-bound at contexts beyond a few hundred
# tokens, so speculation keeps paying at large batch there (lesson 08, section 4). See
# `lessons/08-speculative-decoding.md` for the numbers.
#
# [^learned]: published: EAGLE (Li et al., arXiv 2401.15077), abstract: 2.7x-3.5x latency speedup for LLaMA2-Chat 70B; DeepSeek-V3 technical report (arXiv 2412.19437), §5.4.3: MTP gives 1.8x TPS

# %% [markdown]
# ## 7. A learned draft: an EAGLE head trained here, in the engine
#
# EAGLE's head is one decoder layer on the target's own top-layer features: it reads the feature of position
# t and the embedding of token t + 1, predicts the feature of t + 1, and the target's tied LM head (over the
# 8192 most frequent tokens) turns that into a draft. `python -m minillm bench eagle` trains one for SmolLM2
# on text SmolLM2 writes itself and saves it; `LLM(speculative_method="eagle")` loads it, the runner hands
# each request's drafter the features of every verified position, and the engine verifies the drafts like
# any others. Greedy output must equal plain decoding token for token; the acceptance by draft position is
# what `/metrics` reports as `vllm:spec_decode_num_accepted_tokens_per_pos`.

# %%
from minillm.speculative.eagle import default_head_path
if default_head_path().exists():
    eagle = LLM(model=llm.model, tokenizer=tok, max_model_len=llm.max_model_len, speculative_method="eagle",
                num_speculative_tokens=3, speculative_policy="always")
    qa = tok.apply_chat_template([{"role": "user", "content": "Why is the sky blue? Answer briefly."}])
    want = llm.generate([qa], params, use_tqdm=False)[0].outputs[0].token_ids
    got = eagle.generate([qa], params, use_tqdm=False)[0].outputs[0].token_ids
    s = eagle.engine.speculation
    by_pos = [sum(e["num_accepted_per_position"][j] for e in eagle.engine.step_log) / s.verify_runs for j in range(3)]
    print(f"eagle k=3: identical={got == want}  drafted {s.drafted}, accepted {s.accepted}; "
          f"accepted per verification by position {[round(x, 2) for x in by_pos]}")
else:
    print(f"no trained head at {default_head_path()}: python -m minillm bench eagle trains one")

# %% [markdown]
# The same head drafting a **tree**: its first three guesses after the pending token and its first guess after its
# first guess, verified in one step (`speculative_token_tree`, vLLM's option). Each row of the step attends to the
# context and to its own ancestors; the accepted path's K/V then moves to the slots after the pending token.
# Tokens per target call rise against the chain's; greedy output stays plain decoding's.

# %%
if default_head_path().exists():
    tree = LLM(model=llm.model, tokenizer=tok, max_model_len=llm.max_model_len, speculative_method="eagle",
               num_speculative_tokens=4, speculative_token_tree=[(0,), (1,), (2,), (0, 0)], speculative_policy="always")
    got = tree.generate([qa], params, use_tqdm=False)[0].outputs[0].token_ids
    for name, run in (("chain k=3", eagle), ("tree of 4", tree)):      # each ran this one request: its steps are its calls
        print(f"{name}: tokens per target call {len(want) / len(run.engine.step_log):.2f}")
    print(f"tree: identical={got == want}, trees verified {tree.engine.speculation.tree_verifications}")

# %%
for name in ("eagle", "eagle-engine"):
    path = Path(f"../results/{name}.json")
    if not path.exists():
        print(f"{path} not found: run python -m minillm bench {name}")
        continue
    s = json.loads(path.read_text())["summary"]
    if name == "eagle":
        print(f"trained on {s['training_tokens']} tokens in {s['train_seconds'] / 60:.0f} min; teacher-forced "
              f"top-1 agreement {s['final_top1_next_token']:.2f} (train), {s['final_held_out_top1']:.2f} (held out)")
        print("mean drafts accepted of 5, held-out prompts:", {k: round(v, 2) for k, v in s["mean_accepted_of_5"].items()})
    else:
        for key, value in s["speedup"].items():
            print(f"{key:>40}: {value:.2f}x")
        choice = s["tree_choice"]
        print(f"expected drafts accepted per verification (counted): chain of 3 {choice['expected_accepted_chain_k3']:.2f}, "
              f"tree of 4 {choice['expected_accepted_tree_4']:.2f}, tree of 7 {choice['expected_accepted_tree_7']:.2f}")
