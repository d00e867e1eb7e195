"""Trains an EAGLE-3 head for the default model (SmolLM2-135M-Instruct) on its own answers to the shipped prompts, on
this CPU, and writes it in the published format (`spec_decode/eagle3.py`: what `speculative_config {"method":
"eagle3", "model": DIR}` serves, and what vLLM reads).

1. Data: the model answers the shipped chat prompts (`jaxserve/bench/data/prompts.jsonl`) from `--first-prompt` on
   (the first 20 are held out: `benchmarks/spec_decode.py` measures on the first 10; prompts 10-19 choose which
   update's head is kept, by its step-0 accuracy on their answers), greedy, up to `--max-tokens`, through the
   engine.
2. The target, frozen, runs once over each prompt + answer (jaxserve's own forward): the inputs of its layers
   (2, 15, 27) at every position, and its argmax there (the labels: a head is trained to predict what greedy
   verification accepts).
3. The head (a Llama layer over [embedding | fc(hidden states)], the target's embedding table read, not trained)
   is trained with EAGLE-3's training-time test: step 0 reads the target's hidden states; step s > 0 reads the
   head's own output of step s - 1 at the same base position, one position further on, attending to the real
   positions up to the base and to its own steps there, as chained proposals do at serving time. Labels are the
   target's argmax, mapped into a draft vocabulary of the `--draft-vocab` most frequent label ids (d2t).
   Adam (optax) with warm-up and cosine decay, for `--minutes` of wall time; `--freeze-lm-head` keeps the LM head
   at the target's embedding rows (half the head's parameters: less to overfit on a small data set).

    python benchmarks/train_eagle3.py --out benchmarks/results/eagle3-smollm2 --minutes 25
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from jaxserve.bench import datasets

LENGTH = 512  # tokens per training sequence (longer ones are cut)


def answers(args: argparse.Namespace) -> tuple[list[list[int]], list[list[int]]]:
    """The training prompts and the validation prompts (the `--validation-prompts` before `--first-prompt`), each
    followed by the model's greedy answer (token ids)."""
    from jaxserve import LLM, SamplingParams

    llm = LLM(args.model, max_num_seqs=32, max_model_len=1024, warmup=False)
    tokenizer = llm.get_tokenizer()
    entries = datasets.load_prompt_file(datasets.DEFAULT_PROMPTS_FILE)
    split = {"train": entries[args.first_prompt:],
             "validation": entries[args.first_prompt - args.validation_prompts:args.first_prompt]}
    prompts = {name: [ids for ids in (datasets.render_chat(tokenizer, datasets.chat_messages(entry))[1]
                                      for entry in part) if len(ids) < LENGTH - 16]
               for name, part in split.items()}
    prompts["train"] = prompts["train"][:args.num_prompts]
    every = prompts["train"] + prompts["validation"]
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in every],
                           SamplingParams(temperature=0, max_tokens=args.max_tokens), use_tqdm=False)
    del llm
    sequences = [(ids + out.outputs[0].token_ids)[:LENGTH] for ids, out in zip(every, outputs)]
    return sequences[:len(prompts["train"])], sequences[len(prompts["train"]):]


def target_states(model: str | None, sequences: list[list[int]], layers: tuple[int, ...]):
    """The target's config, embedding table, and per sequence its layers' inputs `[T, 3 * hidden]` and argmax `[T]`
    (jaxserve's forward over each whole sequence, float32)."""
    import functools

    import jax
    import jax.numpy as jnp

    from jaxserve.distributed.tensor_parallel import TensorParallel
    from jaxserve.engine.allocator import DeviceAllocator
    from jaxserve.engine.kv_plan import empty_kv_cache
    from jaxserve.layers.attention import AttentionMetadata, make_attention_backend
    from jaxserve.layers.sampler import argmax
    from jaxserve.loading import load_model
    from jaxserve.models import forward, fuse_params

    loaded = load_model(model, jnp.float32)
    config, params = loaded.config, fuse_params(loaded.params, loaded.config)
    backend, page = make_attention_backend("xla"), 16

    @functools.partial(jax.jit, static_argnums=0)
    def run(length: int, params, tokens, count):
        cache = empty_kv_cache([length // page] * config.num_layers, config, TensorParallel(), backend, page,
                               jnp.float32, DeviceAllocator())
        positions = jnp.arange(length, dtype=jnp.int32)[None]
        meta = AttentionMetadata(positions=positions, slot_mapping=positions, page_tables=positions[:, ::page] // page,
                                 context_lens=count[None], query_lens=count[None])
        (logits, aux), _ = forward(params, config, backend, tokens[None], cache, meta, aux_layers=layers)
        return aux[0], argmax(logits[0])

    states = []
    for tokens in sequences:
        length = -(-len(tokens) // 128) * 128
        padded = np.zeros(length, np.int32)
        padded[:len(tokens)] = tokens
        aux, greedy = jax.device_get(run(length, params, padded, np.int32(len(tokens))))
        states.append((aux[:len(tokens)].astype(np.float16), greedy[:len(tokens)]))
    return config, np.asarray(params["embed"]["embedding"]), states


def rms(x, weight, eps):
    from jaxserve.layers.norms import rms_normalize

    return rms_normalize(x, eps) * weight


def rope(x, positions, theta: float):
    """The engine's rope (`layers/rotary.py`) on `x [B, heads, T, dim]` at `positions [T]`: what serving computes."""
    from jaxserve.layers.rotary import apply_rope, rope_inverse_frequencies

    inv_freq = rope_inverse_frequencies(x.shape[-1], theta, None)
    return apply_rope(x.swapaxes(1, 2), positions, inv_freq).swapaxes(1, 2)


def ttt_loss(w: dict, embed_table, hf: dict, steps: int, batch: dict):
    """EAGLE-3's training-time test over a batch (`aux [B, T, 3H]`, `tokens [B, T]`, `labels [B, T]` draft ids or
    -1): the mean cross-entropy of every step's predictions, and step 0's accuracy."""
    import jax
    import jax.numpy as jnp

    eps, heads, kv_heads = hf["rms_norm_eps"], hf["num_attention_heads"], hf["num_key_value_heads"]
    dim, theta = hf["head_dim"], hf["rope_theta"]
    aux, tokens, labels = batch["aux"].astype(jnp.float32), batch["tokens"], batch["labels"]
    b, t = tokens.shape
    causal = jnp.tril(jnp.ones((t, t), bool))
    hidden = aux @ w["fc.weight"].T
    keys, values, total, accuracy = [], [], 0.0, None
    for s in range(steps):
        shifted = jnp.pad(tokens[:, 1 + s:], ((0, 0), (0, 1 + s)))
        target = jnp.pad(labels[:, 1 + s:], ((0, 0), (0, 1 + s)), constant_values=-1)
        normed = rms(hidden, w["midlayer.hidden_norm.weight"], eps)
        x = jnp.concatenate([rms(embed_table[shifted], w["midlayer.input_layernorm.weight"], eps), normed], -1)

        def heads_of(name, count):
            return (x @ w[f"midlayer.self_attn.{name}_proj.weight"].T).reshape(b, t, count, dim).transpose(0, 2, 1, 3)
        positions = jnp.arange(t, dtype=jnp.float32) + s
        q = rope(heads_of("q", heads), positions, theta)
        k = rope(heads_of("k", kv_heads), positions, theta).repeat(heads // kv_heads, axis=1)
        v = heads_of("v", kv_heads).repeat(heads // kv_heads, axis=1)
        if s == 0:
            keys0, values0 = k, v
        else:
            keys.append(k)
            values.append(v)
        scale = dim ** -0.5
        real = jnp.where(causal, q @ keys0.transpose(0, 1, 3, 2) * scale, -jnp.inf)  # [B, h, T, T]
        own = [jnp.sum(q * key, -1, keepdims=True) * scale for key in keys]  # this base's steps 1 .. s
        probs = jax.nn.softmax(jnp.concatenate([real, *own], -1), -1)
        attn = probs[..., :t] @ values0 + sum(probs[..., t + r:t + r + 1] * value for r, value in enumerate(values))
        attn = attn.transpose(0, 2, 1, 3).reshape(b, t, heads * dim)
        residual = hidden + attn @ w["midlayer.self_attn.o_proj.weight"].T
        h = rms(residual, w["midlayer.post_attention_layernorm.weight"], eps)
        gate, up = h @ w["midlayer.mlp.gate_proj.weight"].T, h @ w["midlayer.mlp.up_proj.weight"].T
        out = residual + (jax.nn.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
        logits = rms(out, w["norm.weight"], eps) @ w["lm_head.weight"].T
        valid = target >= 0
        log_probs = jax.nn.log_softmax(logits, -1)
        picked = jnp.take_along_axis(log_probs, jnp.maximum(target, 0)[..., None], -1)[..., 0]
        total = total + -jnp.sum(jnp.where(valid, picked, 0.0)) / jnp.maximum(valid.sum(), 1)
        if s == 0:
            hits = (jnp.argmax(logits, -1) == target) & valid
            accuracy = hits.sum() / jnp.maximum(valid.sum(), 1)
        hidden = out
    return total / steps, accuracy


def init_head(hf: dict, embed_table: np.ndarray, draft_ids: np.ndarray, layers: int, seed: int) -> dict:
    """The head's tensors by checkpoint name: projections drawn with std 0.02, norms at 1, the LM head as the
    target's (tied) embedding rows of the draft vocabulary."""
    rng = np.random.default_rng(seed)
    h, width, dim = hf["hidden_size"], hf["intermediate_size"], hf["head_dim"]
    q, kv = hf["num_attention_heads"] * dim, hf["num_key_value_heads"] * dim
    shapes = {"fc.weight": (h, layers * h), "midlayer.self_attn.q_proj.weight": (q, 2 * h),
              "midlayer.self_attn.k_proj.weight": (kv, 2 * h), "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
              "midlayer.self_attn.o_proj.weight": (h, q), "midlayer.mlp.gate_proj.weight": (width, h),
              "midlayer.mlp.up_proj.weight": (width, h), "midlayer.mlp.down_proj.weight": (h, width)}
    tensors = {name: (0.02 * rng.standard_normal(shape)).astype(np.float32) for name, shape in shapes.items()}
    for name in ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
                 "midlayer.post_attention_layernorm.weight", "norm.weight"):
        tensors[name] = np.ones(h, np.float32)
    tensors["lm_head.weight"] = embed_table[draft_ids].astype(np.float32)
    return tensors


def batches(states, sequences, to_draft: np.ndarray, size: int, rng):
    """Batches of `size` sequences of similar length, padded to a multiple of 128, in a random order."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    groups = [order[i:i + size] for i in range(0, len(order), size)]
    for index in rng.permutation(len(groups)):
        group = groups[index]
        t = -(-max(len(sequences[i]) for i in group) // 128) * 128
        aux = np.zeros((len(group), t, states[group[0]][0].shape[1]), np.float16)
        tokens = np.zeros((len(group), t), np.int32)
        labels = np.full((len(group), t), -1, np.int32)
        for row, i in enumerate(group):
            n = len(sequences[i])
            aux[row, :n] = states[i][0]
            tokens[row, :n] = sequences[i]
            labels[row, :n] = to_draft[states[i][1]]
        yield {"aux": aux, "tokens": tokens, "labels": labels}


def train(args: argparse.Namespace) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import optax

    from jaxserve.spec_decode.eagle3 import default_aux_layers, write_checkpoint

    from jaxserve.loading import model_config, resolve_model

    started = time.perf_counter()
    sequences, held_out = answers(args)
    generated = time.perf_counter()
    layers = default_aux_layers(model_config(resolve_model(args.model)).num_layers)
    config, embed_table, states = target_states(args.model, sequences + held_out, layers)
    states, held_out_states = states[:len(sequences)], states[len(sequences):]
    computed = time.perf_counter()
    counts = np.bincount(np.concatenate([greedy for _, greedy in states]), minlength=config.vocab_size)
    draft_ids = np.sort(np.argsort(-counts, kind="stable")[:args.draft_vocab])
    to_draft = np.full(config.vocab_size, -1, np.int32)
    to_draft[draft_ids] = np.arange(len(draft_ids))
    hf = {"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
          "num_attention_heads": config.num_q_heads, "num_key_value_heads": config.num_kv_heads,
          "head_dim": config.head_dim, "vocab_size": config.vocab_size, "draft_vocab_size": len(draft_ids),
          "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
          "max_position_embeddings": config.max_position_embeddings, "tie_word_embeddings": False,
          "hidden_act": "silu", "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layers)}}
    weights = {name: jnp.asarray(value) for name, value in
               init_head(hf, embed_table, draft_ids, len(layers), args.seed).items()}
    table = jnp.asarray(embed_table)
    warmup = min(50, args.max_updates // 4)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.max_updates, args.lr * 0.05)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(schedule, weight_decay=args.weight_decay))
    state = optimizer.init(weights)
    frozen = ("lm_head.weight",) if args.freeze_lm_head else ()

    @jax.jit
    def update(weights, state, batch):
        (loss, accuracy), grads = jax.value_and_grad(ttt_loss, has_aux=True)(weights, table, hf, args.steps, batch)
        grads = {name: jnp.zeros_like(grad) if name in frozen else grad for name, grad in grads.items()}
        updates, state = optimizer.update(grads, state, weights)
        return optax.apply_updates(weights, updates), state, loss, accuracy

    evaluate = jax.jit(lambda weights, batch: ttt_loss(weights, table, hf, args.steps, batch))
    validation = list(batches(held_out_states, held_out, to_draft, args.batch_size, np.random.default_rng(0)))

    def validation_accuracy(weights) -> float:
        """Step-0 accuracy over the held-out answers (each batch's mean, weighted by its labels)."""
        hits = total = 0.0
        for batch in validation:
            count = float((batch["labels"][:, 1:] >= 0).sum())
            hits += float(evaluate(weights, batch)[1]) * count
            total += count
        return hits / max(total, 1.0)

    rng, updates, history = np.random.default_rng(args.seed), 0, []
    best = (validation_accuracy(weights), 0, weights)
    deadline = time.perf_counter() + 60 * args.minutes
    while time.perf_counter() < deadline and updates < args.max_updates:
        for batch in batches(states, sequences, to_draft, args.batch_size, rng):
            weights, state, loss, accuracy = update(weights, state, batch)
            updates += 1
            if updates % args.eval_every == 0:
                held = validation_accuracy(weights)
                history.append((updates, float(loss), float(accuracy), held))
                print(f"update {updates}: loss {float(loss):.3f}, step-0 accuracy {float(accuracy):.3f}, "
                      f"held out {held:.3f}", flush=True)
                if held > best[0]:
                    best = (held, updates, weights)
            if time.perf_counter() >= deadline or updates >= args.max_updates:
                break
    tensors = {name: np.asarray(value) for name, value in best[2].items()}  # the best on the held-out answers
    tensors["d2t"] = (draft_ids - np.arange(len(draft_ids))).astype(np.int64)
    write_checkpoint(args.out, tensors, hf)
    return {"sequences": len(sequences), "tokens": int(sum(map(len, sequences))), "updates": updates,
            "kept_update": best[1], "held_out_accuracy": best[0], "held_out_sequences": len(held_out),
            "history": history, "generate_s": generated - started, "hidden_states_s": computed - generated,
            "train_s": time.perf_counter() - computed, "draft_vocab": len(draft_ids), "layers": list(layers)}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="the target (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--out", required=True, help="the head's directory")
    parser.add_argument("--first-prompt", type=int, default=20, help="shipped prompts before it are held out")
    parser.add_argument("--validation-prompts", type=int, default=10,
                        help="the held-out prompts just before --first-prompt the head is chosen on (early stopping)")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3, help="training-time-test steps")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--max-updates", type=int, default=3000)
    parser.add_argument("--minutes", type=float, default=25.0, help="wall-time budget of the training loop")
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--freeze-lm-head", action="store_true", help="keep the LM head at the target's rows")
    parser.add_argument("--eval-every", type=int, default=50, help="updates between held-out evaluations")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result = train(args)
    Path(args.out, "training.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({key: value for key, value in result.items() if key != "history"}, indent=2))
    return result


if __name__ == "__main__":
    main()
